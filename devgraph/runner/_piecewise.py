"""PiecewiseRunner: a model cut at its splitting ops, each piece captured per token-count bucket.

The runner reads calls like ``GraphRunner`` (both are ``BucketedRunner``: batched tensors padded
into static buffers, host lists padded and forwarded, outputs sliced back, every size captured or
none), but instead of one graph per size it traces the model once with Dynamo
(``DevgraphBackend``: aten lowering, passes, split, per-piece compile), then captures every piece
per size into one shared pool, largest size first. A call replays the pieces' graphs with the
splitting ops (attention) run eagerly in between, so attention sees the call's real metadata. A
call larger than every captured size runs the compiled pieces uncaptured.

Modes (after vLLM's CUDAGraphMode): ``piecewise`` serves every call this way;
``full_and_piecewise`` sends uniform decode batches (``is_decode``) that fit a full-graph bucket
to a ``GraphRunner`` and everything else (prefill, mixed batches, larger decode batches) through
the pieces; both capture into one pool on one side stream, as vLLM does.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch.utils._pytree import tree_unflatten

from devgraph._contract import Device, MemoryPool, Stream
from devgraph._errors import DevgraphError
from devgraph.compile._config import CompileConfig
from devgraph.compile._planner import CapturePlan, plan_capture_sizes
from devgraph.compile._trace import DevgraphBackend, Traced, trace_call
from devgraph.runner import GraphRunner, RunnerConfig, RunnerStats, choose_bucket, normalise_batch_sizes
from devgraph.runner._base import BucketedRunner, SharedCapture
from devgraph.runner._calls import Call, Unsupported
from devgraph.runner._config import positive_int, positive_ints
from devgraph.runner._rows import CATEGORY as PADDING_CATEGORY
from devgraph.runner._util import size_ranges

__all__ = ["PiecewiseRunner", "PiecewiseStats", "piecewise_runner"]

logger = logging.getLogger("devgraph")


@attrs.define
class PiecewiseStats(RunnerStats):
    """Counters of a PiecewiseRunner (``graphed.stats``): ``RunnerStats`` and the compiler's own.

    ``replays`` counts piecewise replays; ``eager_calls`` calls that ran without graphs (a size
    above the captured ones runs the compiled pieces uncaptured: ``fallbacks['size_not_captured']``);
    ``full`` holds the full-graph runner's own stats in ``full_and_piecewise`` mode.
    """

    compile_seconds: float = 0.0
    dropped_sizes: tuple[int, ...] = ()
    pieces: int = 0
    splitting_ops: int = 0
    passes: dict[str, int] = attrs.field(factory=dict)
    full: RunnerStats | None = None


class PiecewiseRunner(BucketedRunner):
    """Serve calls of ``fn`` from per-piece graphs (see the module docstring).

    Args:
        fn: the model (an ``nn.Module`` or callable taking tensors).
        device: the devgraph device to capture on.
        config: a ``RunnerConfig`` (pad values, host args, batch dims, the full graph's batch sizes).
        compile_config: a ``CompileConfig`` (mode, splitting ops, compile backend, passes, sizes).
    Raises:
        DevgraphError: ``full_and_piecewise`` without a way to tell decode batches (``is_decode``);
            a compile backend this device cannot run (``torchair`` off an NPU); an unknown pass.
    """

    _serve_what = "piecewise"
    size_noun = "capture sizes (tokens)"
    size_options = "capture_sizes/capture_budget/traffic"

    def __init__(
        self,
        fn: Callable[..., Any],
        device: Device,
        config: RunnerConfig | None = None,
        compile_config: CompileConfig | None = None,
    ) -> None:
        compile_config = compile_config or CompileConfig()
        mode = compile_config.mode
        if mode == "full":
            raise DevgraphError(
                "PiecewiseRunner serves mode='piecewise' or 'full_and_piecewise'; use GraphRunner"
            )
        compile_config.check_device(device)
        config = attrs.evolve(config or RunnerConfig(), mode=mode)
        shared = SharedCapture(device) if mode == "full_and_piecewise" else None
        super().__init__(fn, device, config, shared=shared)
        self.compile_config = compile_config
        full_sizes = normalise_batch_sizes(self.config.batch_sizes, self.config.max_batch_size)
        requested = self.compile_config.capture_sizes
        self.sizes = list(requested) if requested else full_sizes
        self.full: GraphRunner | None = None
        self.is_decode: Callable[..., bool] | None = None
        if mode == "full_and_piecewise":
            self.is_decode = self.compile_config.is_decode or getattr(fn, "devgraph_is_decode", None)
            if self.is_decode is None:
                raise DevgraphError(
                    "mode='full_and_piecewise' needs to tell uniform decode batches (full graph) from prefill "
                    "and mixed batches (piecewise): pass is_decode=fn, called with the call's arguments by "
                    "name and returning True for a decode batch (or give the model a devgraph_is_decode method)"
                )
            # One pool and one side stream for the full graphs and the pieces (vLLM's global pool).
            self.full = GraphRunner(fn, device, attrs.evolve(self.config, mode="full"), shared=shared)
        from devgraph.compile.passes import resolve_passes

        resolve_passes(self.compile_config.passes, device)  # unknown pass names fail here, not at trace
        self.stats: PiecewiseStats = PiecewiseStats(full=self.full.stats if self.full else None)
        self.plan: CapturePlan | None = None
        self._traced: Traced | None = None
        self._replay_inputs: dict[int, list[Any]] = {}

    # -- public --------------------------------------------------------------------------------

    @property
    def module(self) -> Any:
        """The ``PiecewiseModule`` (None before the first call or ``capture``)."""
        return self._traced.compiled.module if self._traced else None

    @property
    def traced(self) -> Traced | None:
        """The trace: compiled graph, pieces, pass counts (None before the first call)."""
        return self._traced

    @property
    def captured(self) -> bool:
        return self._traced is not None

    @property
    def cache_key(self) -> str:
        """A key of everything that changes what this runner compiles and captures."""
        parts = (
            self.config.uuid(),
            self.compile_config.uuid(self.device),
            self.device.name,
            torch.__version__,
        )
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]

    def capture(self, *example_args: Any, **example_kwargs: Any) -> PiecewiseRunner:
        """Trace, compile and capture now from an example call (any size); the full graphs too."""
        with self._lock:
            super().capture(*example_args, **example_kwargs)
            if self.full is not None:
                try:
                    self.full.capture(*example_args, **example_kwargs)
                except BaseException:
                    self.reset()  # both kinds of graph or neither
                    raise
        return self

    def reset(self) -> None:
        """Drop the trace and every captured graph, the full graphs too (the next call builds them again).

        Outputs returned earlier are views of graph memory (unless ``clone_outputs=True``): after a
        reset that memory goes back to the pool and the next capture reuses it, so those views read
        garbage. Clone what you keep across a reset.
        """
        with self._lock:
            super().reset()
            if self.full is not None:
                self.full.reset()

    # -- routing -------------------------------------------------------------------------------

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Read the call once; in ``full_and_piecewise`` mode route it to the full graphs or the pieces."""
        try:
            call = self._reader.read(args, kwargs)
        except Unsupported as why:
            if self.full is not None and self._is_decode_unread(args, kwargs):
                self.full._claim()
                return self.full._call(args, kwargs)  # the full runner reports why it cannot serve it
            return self._fallback(why, args, kwargs)
        if self.full is not None and self._full_serves(call):
            self.full._claim()
            return self.full._call_read(call, args, kwargs)
        return self._call_read(call, args, kwargs)

    def _full_serves(self, call: Call) -> bool:
        """Whether a call is a uniform decode batch that fits a full-graph bucket (larger decode
        batches, prefill and mixed batches go through the pieces)."""
        assert self.full is not None and self.is_decode is not None
        if choose_bucket(call.batch, self.full.sizes) is None:
            return False
        return bool(self.is_decode(**self._reader.arguments(call)))

    def _is_decode_unread(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """``is_decode`` for a call the reader refused (it binds, but holds something no graph can
        take): such a decode call goes to the full runner, which reports why, as before."""
        assert self.is_decode is not None
        try:
            bound = self._signature.bind(*args, **kwargs)
        except TypeError:
            return False
        bound.apply_defaults()
        return bool(self.is_decode(**bound.arguments))

    # -- build ---------------------------------------------------------------------------------

    def _drop(self) -> None:
        if self._traced is not None:
            self._traced.compiled.module.reset()
        self._traced = None
        self.plan = None
        self._replay_inputs.clear()
        super()._drop()
        self.stats.pieces = self.stats.splitting_ops = 0
        self.stats.passes = {}
        self.stats.dropped_sizes = ()
        self.stats.compile_seconds = 0.0

    def _capture(self, example: Call) -> None:
        cfg = self.config
        # The trace marks the token dim dynamic; Dynamo specialises sizes 0 and 1, so trace with >= 2.
        trace_size = max(2, max(self.sizes))
        self._alloc_buffers(example, trace_size)

        def invoke(tensors: dict[str, torch.Tensor], traced: bool) -> Any:
            values: dict[str, Any] = dict(tensors)
            values.update(example.consts)
            for name in example.host:
                values[name] = [] if traced else [cfg.pad_value(name)] * trace_size
            args, kwargs = example.bind(self._signature, values)
            return self.fn(*args, **kwargs)

        tensors = self._narrowed(trace_size)
        tensors.update(example.static)
        dynamic = {n: cfg.batch_dim(n) for n in example.batched}
        host = self.padded_host_args({}, trace_size)
        backend = DevgraphBackend(self.device, self.compile_config, host_args=[op for _, op in cfg.host_args])
        start = time.perf_counter()
        self._traced = traced = trace_call(invoke, tensors, dynamic, backend, host, self._run_sizes())
        self.stats.compile_seconds = time.perf_counter() - start
        module = traced.compiled.module
        self.stats.pieces = module.captured_pieces
        self.stats.splitting_ops = sum(p.is_splitting_op for p in traced.compiled.split.pieces)
        self.stats.passes = dict(traced.compiled.pass_counts)
        self._remember_weights(example)
        self.plan = self._plan(module.captured_pieces)
        self.stats.dropped_sizes = self.plan.dropped

        def prepare(size: int) -> tuple[Callable[[], Any], Callable[[MemoryPool, Stream], None]]:
            host = self.padded_host_args({}, size)  # padding only: what warm-up and capture see
            inputs = self._inputs(example, size)

            def warm_up() -> Any:
                return module(*inputs, host=host)

            def capture(pool: MemoryPool, stream: Stream) -> None:
                module.capture(inputs, size, pool, stream, host)

            return warm_up, capture

        self._capture_each(
            list(self.plan.sizes),
            prepare,
            remedy="or run the offending op eagerly between the pieces (splitting_ops=[...]), "
            "or capture fewer sizes (capture_sizes=[...])",
            summary=f"captured {module.captured_pieces} pieces x {len(self.plan.sizes)} sizes ({{sizes}})",
            tail=f"; {self.stats.splitting_ops} splitting ops run eagerly in between",
            desc=f"devgraph piecewise capture ({self.device})",
            example=example,
        )

    def _run_sizes(self) -> list[int] | None:
        """The token counts the pieces may run at below the largest (None: every count, when the
        budget leaves no piece captured)."""
        budget = self._budget()
        return None if budget is not None and budget < 1 else list(self.sizes)

    def _budget(self) -> int | None:
        budget = self.compile_config.effective_budget(self.device)
        if budget is not None and self.full is not None:
            budget -= len(self.full.sizes)  # one graph per decode batch size (assumed one stream each)
        return budget

    def _plan(self, pieces: int) -> CapturePlan:
        traffic = dict(self.compile_config.traffic) if self.compile_config.traffic else None
        budget = self._budget()
        if budget is not None and budget < 1:
            logger.warning("devgraph: the full graphs use the whole capture budget; pieces are not captured")
            return CapturePlan((), tuple(self.sizes), max(1, pieces), budget)
        return plan_capture_sizes(
            self.sizes,
            max(1, pieces),
            budget,
            traffic,
            max_sizes=getattr(self.device, "max_capture_sizes", None),
        )

    def _inputs(self, call: Call, size: int | None) -> list[Any]:
        assert self._traced is not None
        inputs = []
        for kind, value in self._traced.inputs:
            if kind == "fixed":
                inputs.append(value)
            elif value in call.static:
                inputs.append(call.static[value])
            elif size is None:
                inputs.append(call.batched[value])
            else:
                inputs.append(self._buffers[value].narrow(self.config.batch_dim(value), 0, size))
        return inputs

    # -- serve ---------------------------------------------------------------------------------

    def _serve(self, call: Call) -> Any:
        assert self._traced is not None and self.plan is not None
        self._check_template(call, "traced")
        module = self._traced.compiled.module
        size = choose_bucket(call.batch, self.plan.sizes) if self.plan.sizes else None
        if self._rank_check is not None:
            self._rank_check.agree_on_call(size)
        if size is not None and size != call.batch and self._exact_only is not None:
            # Padding would change the result: the compiled pieces at the call's own size, uncaptured.
            self.note_fallback(
                PADDING_CATEGORY, f"{self._exact_only}; sizes {list(self.plan.sizes)} still replay"
            )
            out = module(*self._inputs(call, None), host=self.padded_host_args(call.host, call.batch))
            return self._assemble(out, call.batch, call.batch)
        if size is None:
            # Larger than every captured size (or nothing captured): the compiled pieces, uncaptured.
            self._note_uncaptured(call.batch)
            out = module(*self._inputs(call, None), host=self.padded_host_args(call.host, call.batch))
            return self._assemble(out, call.batch, call.batch)
        self._load(call, size)
        debug = self.config.debug
        if debug:
            self._weights.check(self.fn)
        inputs = self._replay_inputs.get(size)
        if inputs is None:
            inputs = self._inputs(call, size)
            if not call.static:  # then the same tensors every call: the buffers' first rows, weights
                self._replay_inputs[size] = inputs
        out = module.replay(inputs, size, self.padded_host_args(call.host, size), debug=debug)
        self.stats.replays += 1
        return self._assemble(out, size, call.batch)

    def _note_uncaptured(self, tokens: int) -> None:
        self.stats.eager_calls += 1
        self.stats.fallbacks["size_not_captured"] = self.stats.fallbacks.get("size_not_captured", 0) + 1
        if "size_not_captured" not in self._warned:
            self._warned.add("size_not_captured")
            assert self.plan is not None
            logger.info(
                "devgraph: %d tokens is above the captured sizes (%s); such calls run the compiled pieces "
                "without graphs",
                tokens,
                size_ranges(self.plan.sizes) or "none",
            )

    def _assemble(self, flat: Any, size: int, batch: int) -> Any:
        assert self._traced is not None
        traced = self._traced
        outputs = list(flat) if isinstance(flat, (list, tuple)) else [flat]
        if len(traced.outputs) == 1 and traced.outputs[0][0] == "out" and traced.spec.is_leaf():
            t = outputs[traced.outputs[0][1]]  # one tensor: no tree to rebuild
            if size != batch:
                for d in traced.batch_dims[traced.outputs[0][1]]:
                    t = t[:batch] if d == 0 else t.narrow(d, 0, batch)
            return t.clone() if self.config.clone_outputs else t
        leaves = []
        for kind, value in traced.outputs:
            if kind == "const":
                leaves.append(value)
                continue
            t = outputs[value]
            if size != batch:
                for d in traced.batch_dims[value]:
                    t = t.narrow(d, 0, batch)
            leaves.append(t.clone() if self.config.clone_outputs else t)
        return tree_unflatten(leaves, traced.spec)

    def __repr__(self) -> str:
        return (
            f"<PiecewiseRunner {type(self.fn).__name__} on {self.device}, mode {self.compile_config.mode}, "
            f"sizes {self.sizes}>"
        )


def piecewise_runner(
    fn: Callable[..., Any], device: Device, config: RunnerConfig, **options: Any
) -> PiecewiseRunner:
    """The runner ``devgraph.wrap`` builds for ``mode='piecewise'`` / ``'full_and_piecewise'``.

    ``options`` are ``CompileConfig`` fields (``splitting_ops``, ``compile_backend``, ``passes``,
    ``capture_sizes``, ``capture_budget``, ``traffic``, ``is_decode``); the mode is ``config.mode``.

    Raises:
        DevgraphError: ``capture_sizes`` or ``capture_budget`` not positive integers (``2.5``, ``"4"``
            and ``True`` included), or what ``PiecewiseRunner`` raises.
    """
    if options.get("capture_sizes") is not None:
        options["capture_sizes"] = positive_ints("capture_sizes", options["capture_sizes"])
    if options.get("capture_budget") is not None:
        options["capture_budget"] = positive_int("capture_budget", options["capture_budget"])
    return PiecewiseRunner(fn, device, config, CompileConfig(mode=config.mode, **options))
