"""``DevgraphGraphWrapper``: vLLM's static graph wrapper protocol over ``devgraph.Graph``.

vLLM's dispatcher decides per step, through the forward context, which runtime mode runs
(``cudagraph_runtime_mode``) and for which padded batch (``batch_descriptor``). A wrapper whose mode
differs, or NONE, runs its callable eagerly (that is how the FULL wrapper around the model and the
PIECEWISE wrappers around its pieces nest); otherwise it captures an unseen descriptor (only while
vLLM's capture phase allows it) and replays a seen one, returning the outputs captured for it.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import torch

from devgraph._errors import DevgraphError
from devgraph.adapters.vllm import _compare_eager, _stats
from devgraph.adapters.vllm._breakable import check_breaks, vllm_break_ops
from devgraph.adapters.vllm._host_args import step_host_args, updatable_ops
from devgraph.graph import BreakableGraph, Graph, GraphSet, MemoryPool, SharedPool, weak_ref_tensors

__all__ = ["DevgraphGraphWrapper"]

logger = logging.getLogger("devgraph")

#: ``stats()`` labels of the drafter's wrappers start with this (``capture.draft.PIECEWISE``).
DRAFT_PREFIX = "draft."

#: vLLM's model tags of drafter models (``set_model_tag`` around the drafter's ``get_model``): the
#: compiled pieces of a drafter carry them as their backend's prefix.
DRAFTER_MODEL_TAGS = ("draft_model", "eagle_head")


def is_drafter_runnable(runnable: Any) -> bool:
    """True for a compiled piece of a drafter model (its vLLM backend's prefix is the drafter's tag)."""
    backend = getattr(runnable, "vllm_backend", None)
    return getattr(backend, "prefix", None) in DRAFTER_MODEL_TAGS


class _Entry:
    """One captured batch descriptor's input and attention-metadata addresses (its graph and weak
    outputs are in the wrapper's ``GraphSet``). The inputs are checked on the first replay (and on
    every replay in debug mode), the metadata in debug mode."""

    __slots__ = ("input_addresses", "inputs_checked", "metadata_addresses")

    def __init__(self, input_addresses: list[tuple[str, int]], metadata_addresses: dict) -> None:
        self.input_addresses = input_addresses
        self.metadata_addresses = metadata_addresses
        #: the first replay found every input at its capture address
        self.inputs_checked = False


def _metadata_addresses(context: Any) -> dict[str, int]:
    """Data pointers of the tensor fields of the step's attention metadata, by field name: a FULL
    graph reads them at their capture-time addresses, so vLLM must keep them in persistent buffers."""
    from devgraph.adapters.vllm._host_args import metadata_objects

    found: dict[str, int] = {}
    for i, m in enumerate(metadata_objects(getattr(context, "attn_metadata", None))):
        fields = vars(m) if hasattr(m, "__dict__") else {}
        unread = getattr(m, "devgraph_unread_fields", ())  # made per step, never read by a graph
        for name, value in fields.items():
            if isinstance(value, torch.Tensor) and value.numel() and name not in unread:
                found[f"{type(m).__name__}[{i}].{name}"] = value.data_ptr()
    return found


def _addresses(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[str, int]]:
    """(name, data pointer) of the tensor arguments, positional (``argument 0``, ...) then keyword (by
    name): vLLM calls the FULL wrapper with keywords (``input_ids=``, ``positions=``), the pieces
    positionally."""
    named = [*((f"argument {i}", a) for i, a in enumerate(args)), *((k, kwargs[k]) for k in sorted(kwargs))]
    return [(name, a.data_ptr()) for name, a in named if isinstance(a, torch.Tensor)]


@contextlib.contextmanager
def _gc_paused(pause: bool) -> Iterator[None]:
    # vLLM collects garbage before the first piece of a forward only: collecting once per piece
    # (per layer) makes a piecewise capture very slow. Automatic collection is what can be paused
    # without replacing anything in gc or torch.
    if not pause or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _carries_host_args(context: Any) -> bool:
    from devgraph.adapters.vllm._host_args import metadata_objects

    return any(
        getattr(m, "devgraph_host_args", None)
        for m in metadata_objects(getattr(context, "attn_metadata", None))
    )


class DevgraphGraphWrapper:
    """Capture and replay ``runnable`` per vLLM batch descriptor through devgraph.

    Args:
        runnable: the model (FULL) or a compiled piece (PIECEWISE).
        vllm_config: vLLM's config.
        runtime_mode: ``CUDAGraphMode.FULL`` or ``PIECEWISE`` (FULL_AND_PIECEWISE nests one FULL
            wrapper around PIECEWISE ones).
        cudagraph_options: vLLM's ``CUDAGraphOptions`` (``gc_disable``, ``weak_ref_output``,
            ``debug_log_enable``).
        breaks: serve vLLM's PIECEWISE mode with one devgraph ``BreakableGraph`` of the whole
            (uncompiled) model per batch descriptor, cut at these ops (``_breakable.vllm_break_ops``;
            ``DevgraphGraphWrapper.breakable`` picks them), in place of vLLM's
            ``BreakableCUDAGraphWrapper``. Counted as ``capture.BREAKABLE``, ``replay.BREAKABLE``,
            ``eager.BREAKABLE``, with ``segments.BREAKABLE`` and ``breaks.BREAKABLE``. Each break reads
            the step's attention metadata from vLLM's forward context, so a replay hands it no host
            arguments; a capture whose attention ran inside a segment is refused by name.

    The graphs share vLLM's global graph pool (a devgraph ``MemoryPool``) and the device's capture
    stream. Outputs are kept as weak references and are overwritten by the next replay. The first
    replay of each captured batch descriptor checks that its tensor arguments live at their capture
    addresses (a graph reads that memory: a moved input would replay stale data); with
    ``DEVGRAPH_DEBUG=1`` (or vLLM's debug logging) every replay checks them, and the FULL graphs'
    attention-metadata tensors too. Replays of graphs holding updatable tasks (attention reading host
    sequence lengths) first update them with the step's host arguments from the attention metadata.
    """

    _all_instances: ClassVar[weakref.WeakSet[DevgraphGraphWrapper]] = weakref.WeakSet()

    def __init__(
        self,
        runnable: Callable[..., Any],
        vllm_config: Any,
        runtime_mode: Any,
        cudagraph_options: Any = None,
        *,
        breaks: Sequence[str] | None = None,
    ) -> None:
        from vllm.compilation.cuda_graph import CUDAGraphOptions
        from vllm.config import CUDAGraphMode
        from vllm.platforms import current_platform

        if runtime_mode not in (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE):
            raise DevgraphError(
                f"DevgraphGraphWrapper needs runtime_mode FULL or PIECEWISE, got {runtime_mode}; "
                "FULL_AND_PIECEWISE is a FULL wrapper around PIECEWISE-wrapped pieces"
            )
        if not hasattr(current_platform, "devgraph_device"):
            raise DevgraphError(
                f"DevgraphGraphWrapper runs on the devgraph vLLM platform, but vLLM's platform is "
                f"{type(current_platform).__name__}: set DEVGRAPH_VLLM=1"
            )
        if breaks is not None and runtime_mode != CUDAGraphMode.PIECEWISE:
            raise DevgraphError(f"breakable graphs serve vLLM's PIECEWISE runtime mode, not {runtime_mode}")
        self.runnable = runnable
        self.vllm_config = vllm_config
        self.runtime_mode = runtime_mode
        #: the break ops of a breakable wrapper (None: one ``devgraph.Graph`` per descriptor)
        self.breaks: tuple[str, ...] | None = None if breaks is None else tuple(breaks)
        self.cudagraph_options = cudagraph_options or CUDAGraphOptions()
        self.device = current_platform.devgraph_device()
        pool = current_platform.get_global_graph_pool()
        if not isinstance(pool, MemoryPool):
            raise DevgraphError(
                f"vLLM's global graph pool is {type(pool).__name__}, not a devgraph MemoryPool; "
                "devgraph captures need the devgraph platform's graph_pool_handle()"
            )
        # Graphs by batch descriptor, in vLLM's global pool (renewed through the platform once retired).
        self.graphs: GraphSet[Any, Any] = self._graph_set(
            SharedPool(self.device, make=current_platform.graph_pool_handle)
        )
        self.graphs.shared.adopt(pool)
        self.entries: dict[Any, _Entry] = {}
        #: ``""`` for the target model's graphs, ``"draft."`` for a speculative drafter's (``stats()``
        #: counts them apart: ``replay.draft.PIECEWISE``)
        self.role = DRAFT_PREFIX if is_drafter_runnable(runnable) else ""
        #: replays of this wrapper's graphs (a drafter's graphs captured but never replayed are reported)
        self.replays = 0
        self.debug = os.environ.get("DEVGRAPH_DEBUG", "") == "1" or logging.getLogger("vllm").isEnabledFor(
            logging.DEBUG
        )
        DevgraphGraphWrapper._all_instances.add(self)

    @classmethod
    def breakable(
        cls, runnable: Callable[..., Any], vllm_config: Any, cudagraph_options: Any = None
    ) -> DevgraphGraphWrapper:
        """A PIECEWISE wrapper of breakable graphs cut at the ops vLLM's compiled PIECEWISE mode splits
        at (``_breakable.vllm_break_ops``)."""
        from vllm.config import CUDAGraphMode

        breaks = vllm_break_ops(vllm_config)
        return cls(runnable, vllm_config, CUDAGraphMode.PIECEWISE, cudagraph_options, breaks=breaks)

    @property
    def label(self) -> str:
        """What the counters of ``stats()`` call this wrapper's graphs (``capture.<label>``, ...)."""
        return self.role + ("BREAKABLE" if self.breaks is not None else str(self.runtime_mode.name))

    def _graph_set(self, shared: SharedPool) -> GraphSet[Any, Any]:
        """The set holding this wrapper's graphs: one ``devgraph.Graph`` per batch descriptor, or one
        ``BreakableGraph`` (a ``Replayable`` like a Graph) with ``breaks``."""
        device, breaks = self.device, self.breaks
        if breaks is None:
            return GraphSet(device, shared)
        return GraphSet(device, shared, make=lambda: BreakableGraph(device, breaks))

    # -- vLLM's wrapper surface -----------------------------------------------------------------

    def __getattr__(self, key: str) -> Any:
        # Attribute access falls through to the wrapped runnable (as with vLLM's CUDAGraphWrapper).
        runnable = self.__dict__.get("runnable")
        if runnable is not None and hasattr(runnable, key):
            return getattr(runnable, key)
        raise AttributeError(f"{type(self).__name__} (around {type(runnable).__name__}) has no {key!r}")

    def unwrap(self) -> Callable[..., Any]:
        """The original callable, through nested wrappers."""
        runnable = self.runnable
        return runnable.unwrap() if hasattr(runnable, "unwrap") else runnable

    @property
    def cudagraph_wrapper(self) -> DevgraphGraphWrapper:
        return self

    @property
    def graph_pool(self) -> MemoryPool:
        """The pool this wrapper captures into (vLLM's global graph pool unless swapped)."""
        return self.graphs.shared.pool

    @graph_pool.setter
    def graph_pool(self, pool: MemoryPool) -> None:
        self.graphs.shared.adopt(pool)

    @classmethod
    def clear_all_graphs(cls) -> None:
        """Drop the graphs of every wrapper; the next capture phase captures them again.

        A pool whose graphs were all reset is not captured into again (CUDA's allocator asserts),
        so wrappers holding such a pool get a fresh one, and so does the platform when it was its
        global graph pool.
        """
        from vllm.platforms import current_platform

        wrappers = list(cls._all_instances)
        for wrapper in wrappers:
            wrapper.clear_graphs()
        fresh: dict[int, MemoryPool] = {}
        platform_cls = type(current_platform)
        for wrapper in wrappers:
            pool = wrapper.graphs.shared.current
            if pool is None or not pool.retired:  # a graph of another owner still holds it
                continue
            if id(pool) not in fresh:
                fresh[id(pool)] = current_platform.graph_pool_handle()
                if platform_cls._global_graph_pool is pool:
                    platform_cls._global_graph_pool = fresh[id(pool)]
            wrapper.graph_pool = fresh[id(pool)]

    def clear_graphs(self) -> None:
        """Drop this wrapper's graphs; the next capture phase captures them again."""
        self.graphs.reset()
        self.entries.clear()

    # -- dispatch ---------------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from vllm.config import CUDAGraphMode
        from vllm.forward_context import get_forward_context, is_forward_context_available

        if not is_forward_context_available():
            return self.runnable(*args, **kwargs)  # outside a model step (e.g. an encoder)
        context = get_forward_context()
        mode = context.cudagraph_runtime_mode
        if mode == CUDAGraphMode.NONE or mode != self.runtime_mode:
            _stats.count("eager", self.label)
            return self.runnable(*args, **kwargs)
        descriptor = context.batch_descriptor
        if descriptor is None:
            raise DevgraphError(
                f"vLLM dispatched {mode.name} without a batch descriptor; cannot pick a graph"
            )
        entry = self.entries.get(descriptor)
        if entry is None:
            return self._capture(descriptor, args, kwargs, context)
        output = self._replay(descriptor, entry, args, kwargs, context)
        if _compare_eager.CHECK is not None:  # DEVGRAPH_COMPARE_EAGER: off by default
            _compare_eager.replayed(self, output, args, kwargs)
        return output

    def _capture(self, descriptor: Any, args: tuple[Any, ...], kwargs: dict[str, Any], context: Any) -> Any:
        from vllm.compilation.monitor import validate_cudagraph_capturing_enabled

        validate_cudagraph_capturing_enabled()  # only inside vLLM's capture phase
        if self.cudagraph_options.debug_log_enable:
            logger.debug("devgraph: capturing %s graph for %s", self.runtime_mode.name, descriptor)
        addresses = _addresses(args, kwargs)

        def body(graph: Graph) -> Any:
            output = self.runnable(*args, **kwargs)
            if self.cudagraph_options.weak_ref_output:
                # Only safe for the last piece (or the whole model): nothing captured after it
                # reads this output, so its memory may go back to the pool right away.
                output = weak_ref_tensors(output)
            return output

        with _gc_paused(self.cudagraph_options.gc_disable):
            output = self.graphs.capture(descriptor, body, auto_update_ops=updatable_ops(self.device))
        graph = self.graphs.graph(descriptor)
        if self.runtime_mode.name == "FULL" and not graph.tasks and _carries_host_args(context):
            # The step's attention reads host lengths a replay must re-issue, but the capture found
            # no updatable task (the attention ran inside an op devgraph cannot see into): every
            # replay would attend over the capture-time lengths.
            self.graphs.discard(descriptor)
            raise DevgraphError(
                f"{self.runtime_mode.name} graph for {descriptor}: the attention metadata carries "
                "devgraph_host_args, but the capture recorded no updatable attention task (was the "
                "attention called inside vLLM's opaque custom op?). Use cudagraph_mode=FULL_DECODE_ONLY "
                "or PIECEWISE"
            )
        if self.breaks is not None:
            try:
                check_breaks(graph, self.unwrap(), self.breaks, descriptor)
            except DevgraphError:
                self.graphs.discard(descriptor)
                raise
            _stats.count("segments", self.label, len(graph.graphs))
            _stats.count("breaks", self.label, len(graph.captured_breaks))
        metadata = _metadata_addresses(context) if self.runtime_mode.name == "FULL" else {}
        self.entries[descriptor] = _Entry(addresses, metadata)
        _stats.count("capture", self.label)
        # The caller gets the captured tensors themselves, not weak views of them.
        return output

    def _replay(
        self, descriptor: Any, entry: _Entry, args: tuple[Any, ...], kwargs: dict[str, Any], context: Any
    ) -> Any:
        if self.debug or not entry.inputs_checked:
            # Once per descriptor (its first replay), every replay in debug mode: vLLM's own check
            # runs only under debug logging, and a moved input silently replays stale data.
            self._check_addresses(descriptor, entry, _addresses(args, kwargs))
            entry.inputs_checked = True
        if self.debug and entry.metadata_addresses:
            now = _metadata_addresses(context)
            moved = sorted(k for k, v in entry.metadata_addresses.items() if now.get(k, v) != v)
            if moved:
                raise DevgraphError(
                    f"FULL graph replay: attention metadata tensor(s) {', '.join(moved)} moved since "
                    "capture; a FULL graph reads them at their capture-time addresses (vLLM's "
                    "persistent buffers), so this replay would read stale metadata"
                )
        host_args = self._step_host_args(context, self.graphs.graph(descriptor))
        output = self.graphs.replay(descriptor, host_args)
        if host_args is not None:
            _stats.count("update", self.label)
        _stats.count("replay", self.label)
        self.replays += 1
        return output

    def _step_host_args(self, context: Any, graph: Any) -> Mapping[str, Any] | None:
        """The host arguments this step's replay re-issues to the graph's updatable tasks (None: none;
        a breakable graph's breaks read the step's metadata from vLLM's forward context themselves)."""
        if self.breaks is not None:
            return None
        return step_host_args(context, graph) if graph.tasks else None

    def _check_addresses(self, descriptor: Any, entry: _Entry, now: list[tuple[str, int]]) -> None:
        """Raise when a tensor argument is not where it was at capture (or their number changed)."""
        captured = entry.input_addresses
        if now == captured:
            return
        if [name for name, _ in now] != [name for name, _ in captured]:
            what = (
                f"the tensor arguments are {[n for n, _ in now]}, at capture they were "
                f"{[n for n, _ in captured]}"
            )
        else:
            moved = [
                f"{n} (captured at {a:#x}, now at {b:#x})" for (n, a), (_, b) in zip(captured, now) if a != b
            ]
            what = f"tensor argument(s) {', '.join(moved)} moved since capture"
        raise DevgraphError(
            f"{self.label} graph replay for {descriptor}: {what}. A graph reads its inputs from the memory "
            "they had at capture, so this replay would compute from stale data (wrong tokens, no error). "
            "Whatever produces this input must write each step's data into the tensor passed at capture: "
            "vLLM's model runner keeps persistent input buffers for the model's inputs (a model, plugin or "
            "runner change that hands the graph a new tensor must write into them instead), and a piece's "
            "input returned as a new tensor every step by an op in compilation_config['splitting_ops'] "
            "cannot be replayed (take that op out of splitting_ops). Until then run without graphs: "
            "compilation_config={'cudagraph_mode': 'NONE'}"
        )
