"""The devgraph model-runner path: one device-neutral piece added to the platform's own model runner.

vLLM's GPU runner wraps the model for FULL graphs with ``CUDAGraphWrapper`` in ``load_model``,
vllm-ascend's ``NPUModelRunner`` with ``ACLGraphWrapper``, and vLLM's CPU runner (a subclass of the
GPU runner) not at all. ``adopt_model_runner(runner)`` gives the runner the
``DevgraphModelRunnerMixin`` overrides, keeping its class and state otherwise:

* ``load_model``: the platform's load, then the model's FULL wrapper (whichever class the platform
  used, or none) is replaced by a ``DevgraphGraphWrapper`` around the same model; with vLLM's
  breakable graphs on (``VLLM_USE_BREAKABLE_CUDAGRAPH=1``) a breakable ``DevgraphGraphWrapper`` serves the
  PIECEWISE batches inside it, in place of vLLM's ``BreakableCUDAGraphWrapper`` (a drafter's too);
* ``profile_cudagraph_memory``: vLLM swaps the pools of its own wrapper classes to a profiling pool
  and clears only those classes afterwards; devgraph's wrappers get the same treatment, so no
  profiling-time graph (captured against the profiling KV cache) survives into serving;
* ``_model_forward``: a decode batch above the largest capture size (vLLM runs it eagerly without
  a word) is counted (``stats()["eager.over_capture_size"]``); once per engine a warning says how
  many decode steps ran eagerly, at which sizes, and what to capture (``EagerDecodeReport``: after
  a window of decode steps under load, or at shutdown);
* ``_update_full_graph_params_if_needed`` (vllm-ascend's per-step attention update after a FULL
  replay, with its stream synchronisation): nothing, since devgraph's replay re-issues the updatable
  attention tasks itself (replay first, update after, ordered by events).
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any

from devgraph._errors import DevgraphError
from devgraph.adapters.vllm import _stats
from devgraph.adapters.vllm._wrapper import DevgraphGraphWrapper

__all__ = [
    "DevgraphModelRunnerMixin",
    "EagerDecodeReport",
    "adopt_model_runner",
    "wrap_drafter_model",
    "wrap_full_model",
]

logger = logging.getLogger("devgraph")


def _wants_full_graphs(vllm_config: Any) -> bool:
    from vllm.config import CompilationMode

    cc = vllm_config.compilation_config
    return (
        cc.mode != CompilationMode.STOCK_TORCH_COMPILE
        and cc.cudagraph_mode is not None
        and cc.cudagraph_mode.has_full_cudagraphs()
    )


def _wants_breakable_graphs(vllm_config: Any) -> bool:
    from devgraph.adapters.vllm._breakable import breakable_enabled

    mode = vllm_config.compilation_config.cudagraph_mode
    return mode is not None and mode.has_piecewise_cudagraphs() and breakable_enabled()


def _platform_wrapper(model: Any, mode: Any) -> Any:
    """The model inside the platform's own graph wrapper of runtime ``mode`` (``CUDAGraphWrapper``,
    ``ACLGraphWrapper``, vLLM's ``BreakableCUDAGraphWrapper``: whatever has ``runnable`` and that
    ``runtime_mode``), or ``model`` itself."""
    if getattr(model, "runtime_mode", None) == mode and hasattr(model, "runnable"):
        return model.runnable
    return model


def wrap_full_model(model: Any, vllm_config: Any) -> Any:
    """``model`` as the runner should hold it: inside one FULL ``DevgraphGraphWrapper`` when FULL
    graphs are on, inside a breakable ``DevgraphGraphWrapper`` for PIECEWISE batches when vLLM's breakable
    graphs are on (``VLLM_USE_BREAKABLE_CUDAGRAPH=1``; the FULL wrapper then around it, as vLLM nests
    them), with the graph wrappers the platform put around it taken off first.

    Raises:
        DevgraphError: the model sits in a wrapper devgraph does not know (micro-batching's
            ``UBatchWrapper``): its graphs would not be devgraph's.
    """
    from vllm.config import CUDAGraphMode

    full, breakable = _wants_full_graphs(vllm_config), _wants_breakable_graphs(vllm_config)
    if not (full or breakable) or isinstance(model, DevgraphGraphWrapper):
        return model
    if vllm_config.parallel_config.use_ubatching:
        raise DevgraphError(
            "DEVGRAPH_VLLM=1 with FULL or breakable graphs does not support micro-batching (dual-batch "
            "overlap): vLLM wraps the model in its UBatchWrapper, whose graphs are CUDA graphs; turn off "
            "enable_dbo, or use cudagraph_mode=PIECEWISE without VLLM_USE_BREAKABLE_CUDAGRAPH"
        )
    # The platform's own wrappers (devgraph's take their places): FULL outside, breakable inside.
    inner = _platform_wrapper(_platform_wrapper(model, CUDAGraphMode.FULL), CUDAGraphMode.PIECEWISE)
    if breakable:
        inner = DevgraphGraphWrapper.breakable(inner, vllm_config)
    if not full:
        return inner
    return DevgraphGraphWrapper(inner, vllm_config, runtime_mode=CUDAGraphMode.FULL)


def wrap_drafter_model(model: Any, vllm_config: Any) -> Any:
    """A speculative-decoding drafter's model as the runner should hold it: in a breakable
    ``DevgraphGraphWrapper`` (counted as the drafter's, ``_spec_decode``) when vLLM's breakable graphs
    are on, in place of vLLM's ``BreakableCUDAGraphWrapper`` (its GPU runner's) or around the bare model
    (vLLM's CPU runner wraps nothing); else unchanged.

    vLLM's GPU runner wraps the drafter whenever breakable graphs are on and graphs are not off; the
    drafter's dispatcher then decides per step (PIECEWISE, or NONE: eager, counted ``eager.draft.*``).
    """
    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphWrapper, is_breakable_cudagraph_enabled

    from devgraph.adapters.vllm._wrapper import DRAFT_PREFIX

    if isinstance(model, DevgraphGraphWrapper):
        return model
    if isinstance(model, BreakableCUDAGraphWrapper):
        inner = model.runnable
    elif (
        is_breakable_cudagraph_enabled()
        and vllm_config.compilation_config.cudagraph_mode.name != "NONE"
        and not vllm_config.parallel_config.use_ubatching
    ):
        inner = model
    else:
        return model
    wrapper = DevgraphGraphWrapper.breakable(inner, vllm_config)
    wrapper.role = DRAFT_PREFIX
    return wrapper


def _num_tokens(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int | None:
    for name in ("input_ids", "positions", "inputs_embeds"):
        value = kwargs.get(name)
        if value is not None and hasattr(value, "shape"):
            return int(value.shape[-1] if name == "positions" else value.shape[0])
    return None


def _all_decode(attn_metadata: Any) -> bool:
    """True when every attention metadata of the step says one query token per request."""
    from devgraph.adapters.vllm._host_args import metadata_objects

    found = [getattr(m, "max_query_len", None) for m in metadata_objects(attn_metadata)]
    found = [n for n in found if n is not None]
    return bool(found) and all(n == 1 for n in found)


class EagerDecodeReport:
    """Decode steps of one engine above its largest capture size (vLLM runs them eagerly).

    Reported once, with the numbers: after ``WINDOW`` decode steps from the first eager one (under
    load), or when the engine shuts down, whichever comes first.
    """

    WINDOW = 64

    def __init__(self, largest: int) -> None:
        self.largest = largest
        self.steps = 0  # decode steps since the first eager one (eager ones included)
        self.eager: Counter[int] = Counter()  # eager decode steps by batch size (tokens)
        self.reported = False

    def step(self, num_tokens: int, *, eager: bool) -> None:
        if eager:
            self.eager[num_tokens] += 1
        if self.eager:
            self.steps += 1

    def due(self) -> bool:
        return not self.reported and self.steps >= self.WINDOW

    def message(self, max_num_seqs: int) -> str:
        """The warning: how many steps ran eagerly, at which sizes, and what to capture."""
        n = sum(self.eager.values())
        sizes = ", ".join(f"{size} ({count}x)" for size, count in sorted(self.eager.items()))
        want = max(max_num_seqs, max(self.eager))
        return (
            f"devgraph: {n} of {self.steps} decode steps ran eagerly: their batches were above the largest "
            f"graph capture size {self.largest} (batch sizes in tokens: {sizes}). To replay them from "
            f"graphs, capture sizes up to {want}: compilation_config={{'max_cudagraph_capture_size': {want}}} "
            f"(or list them in cudagraph_capture_sizes), or lower max_num_seqs to {self.largest}. "
            "Counted in devgraph.adapters.vllm.stats()['eager.over_capture_size']."
        )


class DevgraphModelRunnerMixin:
    """What devgraph adds to a vLLM model runner (see the module docstring)."""

    #: over-size eager decode steps of this engine, reported once (see ``EagerDecodeReport``)
    devgraph_eager_report: EagerDecodeReport | None = None
    #: the vLLM model runner's own attributes (set by vLLM's GPUModelRunner this mixes into)
    model: Any
    vllm_config: Any

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)  # type: ignore[misc]
        self.model = wrap_full_model(self.model, self.vllm_config)
        drafter = getattr(self, "drafter", None)
        if drafter is not None and getattr(drafter, "model", None) is not None:
            drafter.model = wrap_drafter_model(drafter.model, self.vllm_config)

    @staticmethod
    @contextlib.contextmanager
    def _freeze_gc() -> Iterator[None]:
        """vLLM's gc freeze around graph capture, without its two full collections.

        vLLM collects before freezing and again after unfreezing (0.4 s each on the CPU test engine:
        a third of devgraph's share of the start). Freezing alone keeps a collection from running
        during capture, which is what capture needs; garbage frozen with the heap is collected by
        the first automatic collection after capture. ``VLLM_ENABLE_CUDAGRAPH_GC=1`` keeps gc on,
        as in vLLM.
        """
        from vllm import envs

        if envs.VLLM_ENABLE_CUDAGRAPH_GC:
            yield
            return
        was_enabled = gc.isenabled()
        gc.disable()
        froze = gc.get_freeze_count() == 0  # the application froze its own heap already: leave it so
        if froze:
            gc.freeze()
        try:
            yield
        finally:
            if froze:
                gc.unfreeze()
            if was_enabled:
                gc.enable()

    def get_model(self) -> Any:
        model: Any = self.model
        if isinstance(model, DevgraphGraphWrapper):
            return model.unwrap()
        return super().get_model()  # type: ignore[misc]

    def profile_cudagraph_memory(self, *args: Any, **kwargs: Any) -> int:
        """vLLM's estimate, with devgraph's wrappers capturing into a profiling pool, cleared after."""
        from vllm.platforms import current_platform

        wrappers = list(DevgraphGraphWrapper._all_instances)
        saved = {id(w): w.graph_pool for w in wrappers}
        profiling_pool = current_platform.graph_pool_handle()
        for wrapper in wrappers:
            wrapper.graph_pool = profiling_pool
        try:
            return super().profile_cudagraph_memory(*args, **kwargs)  # type: ignore[misc]
        finally:
            DevgraphGraphWrapper.clear_all_graphs()
            for wrapper in wrappers:
                wrapper.graph_pool = saved[id(wrapper)]

    def _model_forward(self, *args: Any, **kwargs: Any) -> Any:
        from vllm.config import CUDAGraphMode
        from vllm.forward_context import get_forward_context, is_forward_context_available

        if is_forward_context_available():
            context = get_forward_context()
            largest = self.compilation_config.max_cudagraph_capture_size  # type: ignore[attr-defined]
            if largest and self.compilation_config.cudagraph_mode.name != "NONE":  # type: ignore[attr-defined]
                eager = context.cudagraph_runtime_mode == CUDAGraphMode.NONE
                self._devgraph_note_decode(_num_tokens(args, kwargs), largest, context, eager)
        return super()._model_forward(*args, **kwargs)  # type: ignore[misc]

    def _devgraph_note_decode(self, num_tokens: int | None, largest: int, context: Any, eager: bool) -> None:
        """Count one decode step: eager above the largest capture size, or not; report once."""
        if num_tokens is None or not _all_decode(context.attn_metadata):
            return
        report = self.__dict__.get("devgraph_eager_report")
        if report is None:
            report = self.devgraph_eager_report = EagerDecodeReport(largest)
        if eager and num_tokens > largest:
            _stats.count("eager", "over_capture_size")
        report.step(num_tokens, eager=eager and num_tokens > largest)
        if report.due():
            self.devgraph_report_eager_decode()

    def devgraph_report_eager_decode(self) -> None:
        """Log the over-size eager decode steps seen so far, once per engine (also at shutdown)."""
        report = self.__dict__.get("devgraph_eager_report")
        if report is None or report.reported or not report.eager:
            return
        report.reported = True
        logger.warning("%s", report.message(self.vllm_config.scheduler_config.max_num_seqs))

    def _update_full_graph_params_if_needed(self, *args: Any, **kwargs: Any) -> None:
        """vllm-ascend's attention update after a FULL replay: devgraph's replay did it already."""
        return None


_adopted: dict[type, type] = {}


def adopt_model_runner(runner: Any) -> Any:
    """Give ``runner`` (the platform's model runner, already built) devgraph's overrides in place.

    Its class becomes a subclass of its own class with ``DevgraphModelRunnerMixin`` first; its state
    is untouched, so this works for any runner derived from vLLM's GPU runner (vLLM's CPU and GPU
    runners, vllm-ascend's NPU runner) before ``load_model`` runs.

    Raises:
        DevgraphError: the runner is Model Runner V2, which captures FULL graphs itself.
    """
    cls = type(runner)
    if isinstance(runner, DevgraphModelRunnerMixin):
        return runner
    if cls.__module__.startswith(("vllm.v1.worker.gpu.", "vllm_ascend.worker.v2.")):
        raise DevgraphError(v2_runner_message())
    adopted = _adopted.get(cls)
    if adopted is None:
        adopted = _adopted[cls] = type(
            f"Devgraph{cls.__name__}", (DevgraphModelRunnerMixin, cls), {"__module__": __name__}
        )
    runner.__class__ = adopted
    return runner


def v2_runner_message() -> str:
    """Why Model Runner V2 is refused, and what to set."""
    return (
        "DEVGRAPH_VLLM=1 needs vLLM's V1 model runner: Model Runner V2 (vLLM's default for dense "
        "models on GPU since 0.25.1) captures its FULL graphs itself, without the platform's graph "
        "wrapper, so they would not be devgraph's graphs. Set VLLM_USE_V2_MODEL_RUNNER=0, or "
        "cudagraph_mode=NONE to run without graphs"
    )
