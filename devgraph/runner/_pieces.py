"""PiecewiseRunner: a model cut at its splitting ops, each piece captured per token-count bucket.

The runner reads calls like ``GraphRunner`` (both are composed of a ``StaticInputs`` and the
pieces of ``_shared.py``: batched tensors padded into static buffers, host lists padded and
forwarded, outputs sliced back, every size captured or none), but instead of one graph per size
it traces the model once with Dynamo (``DevgraphCompiler``: aten lowering, passes, split,
per-piece compile), then captures every piece per size into one shared pool, largest size first. A call replays the pieces' graphs with the
splitting ops (attention) run eagerly in between, so attention sees the call's real metadata. A
call larger than every captured size runs the compiled pieces uncaptured.

Modes (after vLLM's CUDAGraphMode): ``piecewise`` serves every call this way;
``full_and_piecewise`` sends uniform decode batches (``is_decode``) that fit a full-graph bucket
to a ``GraphRunner`` and everything else (prefill, mixed batches, larger decode batches) through
the pieces; both capture into one pool on one side stream, as vLLM does.

The runner sits above ``devgraph.compile``: it uses the compiler, never the reverse.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch.utils._pytree import tree_unflatten

from devgraph._errors import DevgraphError
from devgraph.compile._config import CompileConfig
from devgraph.compile._pieces import PiecewiseModule
from devgraph.compile._planner import CapturePlan, plan_capture_sizes
from devgraph.compile._trace import DevgraphCompiler, Traced, trace_call
from devgraph.graph._contract import Device, MemoryPool, Stream
from devgraph.runner._buckets import choose_bucket, normalise_batch_sizes
from devgraph.runner._calls import Call, Unsupported
from devgraph.runner._config import RunnerConfig, RunnerStats, positive_int, positive_ints
from devgraph.runner._inputs import StaticInputs
from devgraph.runner._rows import CATEGORY as PADDING_CATEGORY
from devgraph.runner._runner import GraphRunner
from devgraph.runner._shared import Accounts, CaptureLoop, SharedCapture, ThreadOwner
from devgraph.runner._state import registrations
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


class PiecewiseRunner:
    """Serve calls of ``fn`` from per-piece graphs (see the module docstring).

    Args:
        fn: the model (an ``nn.Module`` or callable taking tensors).
        device: the devgraph device to capture on.
        config: a ``RunnerConfig`` (pad values, host args, batch dims, the full graph's batch sizes).
        compile_config: a ``CompileConfig`` (mode, splitting ops, compiler, passes, sizes).
    Raises:
        DevgraphError: ``full_and_piecewise`` without a way to tell decode batches (``is_decode``);
            a compiler (``compile_backend``) this device cannot run (``torchair`` off an NPU); an unknown pass.
    """

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
        self.fn = fn
        self.device = device
        self.config = config
        self._lock = threading.RLock()
        self.inputs = StaticInputs(fn, device, config)
        self.threads = ThreadOwner(config, caller_serialises=False)
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
        self.accounts = Accounts(config, self.stats, self._lock, "piecewise")
        self.capture_loop = CaptureLoop(
            self.inputs,
            device,
            config,
            self.stats,
            self.accounts,
            shared=shared,
            size_noun="capture sizes (tokens)",
            size_options="capture_sizes/capture_budget/traffic",
        )
        if shared is not None:
            shared.users.append(self)
        self.plan: CapturePlan | None = None
        self._traced: Traced | None = None
        self._replay_inputs: dict[int, list[torch.Tensor]] = {}

    # -- public --------------------------------------------------------------------------------

    @property
    def module(self) -> PiecewiseModule | None:
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
            with torch.no_grad():
                try:
                    call = self.inputs.read(example_args, example_kwargs)
                except Unsupported as why:
                    raise DevgraphError(f"cannot capture from this example call: {why.detail}") from None
                self.reset()
                self._capture_all(call)
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
            self._drop()
            if self.full is not None:
                self.full.reset()

    def note_fallback(self, category: str, detail: str) -> None:
        """Account for a call served without graphs: raise when ``strict``, else count it in
        ``stats.fallbacks[category]`` and ``stats.eager_calls`` and warn once per category.

        Raises:
            DevgraphError: ``strict=True``.
        """
        self.accounts.note_fallback(category, detail)

    def padded_host_args(self, host: dict[str, list[Any]], size: int) -> dict[str, list[Any]]:
        """The updatable tasks' host arguments for a call's host lists padded to size ``size``
        (``{op argument: values}``, as the pieces' replays take them)."""
        return self.inputs.padded_host_args(host, size)

    # -- a call: read, route, serve ------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Serve one call: read it once; in ``full_and_piecewise`` mode route it to the full graphs
        or the pieces.

        Raises:
            DevgraphError: a call from a second live thread while outputs are views of graph memory
                (``clone_outputs=False``): the next replay would overwrite the first thread's result.
        """
        with self._lock:
            self.threads.claim()
            if not torch.is_grad_enabled():  # entering no_grad costs as much as reading the call
                return self._call(args, kwargs)
            with torch.no_grad():
                return self._call(args, kwargs)

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            call = self.inputs.read(args, kwargs)
        except Unsupported as why:
            if self.full is not None and self._is_decode_unread(args, kwargs):
                self.full.threads.claim()
                return self.full._call(args, kwargs)  # the full runner reports why it cannot serve it
            return self._eager(why, args, kwargs)
        if self.full is not None and self._full_serves(call):
            self.full.threads.claim()
            return self.full.serve(call, args, kwargs)
        return self.serve(call, args, kwargs)

    def serve(self, call: Call, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Serve a call already read from the pieces; ``args``/``kwargs`` run eagerly when it cannot be."""
        inputs = self.inputs
        try:
            if call.batch == 0:
                raise Unsupported("empty_batch", "the call has 0 rows; there is nothing to replay")
            if inputs.watch.seen != registrations[0]:  # something registered a weight somewhere: look
                replaced = inputs.watch.replaced()
                if replaced is not None:
                    self._drop()  # traced and captured again just below
                    self.accounts.note_recapture(replaced)
            if self._traced is None:
                self._capture_all(call)
            assert self._traced is not None and self.plan is not None
            # match
            inputs.match(call, "traced")
            module = self._traced.compiled.module
            # bucket
            size = choose_bucket(call.batch, self.plan.sizes) if self.plan.sizes else None
            if self.capture_loop.rank_check is not None:
                self.capture_loop.rank_check.agree_on_call(size)
            if size is not None and size != call.batch and inputs.exact_only is not None:
                # Padding would change the result: the compiled pieces at the call's own size, uncaptured.
                self.accounts.note_fallback(
                    PADDING_CATEGORY, f"{inputs.exact_only}; sizes {list(self.plan.sizes)} still replay"
                )
                return self._run_uncaptured(call)
            if size is None:
                # Larger than every captured size (or nothing captured): the compiled pieces, uncaptured.
                self._note_uncaptured(call.batch)
                return self._run_uncaptured(call)
            # load
            inputs.load(call, size)
            debug = self.config.debug
            if debug:
                inputs.weights.check(self.fn)
            replay_inputs = self._replay_inputs.get(size)
            if replay_inputs is None:
                replay_inputs = self._piece_inputs(call, size)
                if not call.static:  # then the same tensors every call: the buffers' first rows, weights
                    self._replay_inputs[size] = replay_inputs
            # replay the pieces, the splitting ops eagerly in between
            out = module.replay(replay_inputs, size, inputs.padded_host_args(call.host, size), debug=debug)
            self.stats.replays += 1
            # slice
            return self._assemble(out, size, call.batch)
        except Unsupported as why:
            unsupported = why
        # Outside the except block: an error of the model's own eager run is not chained to ours.
        return self._eager(unsupported, args, kwargs)

    def _eager(self, why: Unsupported, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.accounts.note_fallback(why.category, why.detail)
        return self.fn(*args, **kwargs)

    def _full_serves(self, call: Call) -> bool:
        """Whether a call is a uniform decode batch that fits a full-graph bucket (larger decode
        batches, prefill and mixed batches go through the pieces)."""
        assert self.full is not None and self.is_decode is not None
        if choose_bucket(call.batch, self.full.sizes) is None:
            return False
        return bool(self.is_decode(**self.inputs.reader.arguments(call)))

    def _is_decode_unread(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """``is_decode`` for a call the reader refused (it binds, but holds something no graph can
        take): such a decode call goes to the full runner, which reports why, as before."""
        assert self.is_decode is not None
        try:
            bound = self.inputs.signature.bind(*args, **kwargs)
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
        self.inputs.clear()
        self.capture_loop.clear()
        self.stats.pieces = self.stats.splitting_ops = 0
        self.stats.passes = {}
        self.stats.dropped_sizes = ()
        self.stats.compile_seconds = 0.0

    def _capture_all(self, example: Call) -> None:
        self.capture_loop.all_or_nothing(lambda: self._capture(example), self._drop)

    def _capture(self, example: Call) -> None:
        cfg, inputs = self.config, self.inputs
        # The trace marks the token dim dynamic; Dynamo specialises sizes 0 and 1, so trace with >= 2.
        trace_size = max(2, max(self.sizes))
        inputs.alloc(example, trace_size)

        def invoke(tensors: dict[str, torch.Tensor], traced: bool) -> Any:
            values: dict[str, Any] = dict(tensors)
            values.update(example.consts)
            for name in example.host:
                values[name] = [] if traced else [cfg.pad_value(name)] * trace_size
            args, kwargs = example.bind(inputs.signature, values)
            return self.fn(*args, **kwargs)

        tensors = inputs.narrowed(trace_size)
        tensors.update(example.static)
        dynamic = {n: cfg.batch_dim(n) for n in example.batched}
        host = inputs.padded_host_args({}, trace_size)
        compiler = DevgraphCompiler(
            self.device, self.compile_config, host_args=[op for _, op in cfg.host_args]
        )
        start = time.perf_counter()
        self._traced = traced = trace_call(invoke, tensors, dynamic, compiler, host, self._run_sizes())
        self.stats.compile_seconds = time.perf_counter() - start
        module = traced.compiled.module
        self.stats.pieces = module.captured_pieces
        self.stats.splitting_ops = sum(p.is_splitting_op for p in traced.compiled.split.pieces)
        self.stats.passes = dict(traced.compiled.pass_counts)
        inputs.remember(example)
        self.plan = self._plan(module.captured_pieces)
        self.stats.dropped_sizes = self.plan.dropped

        def prepare(size: int) -> tuple[Callable[[], Any], Callable[[MemoryPool, Stream], None]]:
            host = inputs.padded_host_args({}, size)  # padding only: what warm-up and capture see
            piece_inputs = self._piece_inputs(example, size)

            def warm_up() -> Any:
                return module(*piece_inputs, host=host)

            def capture(pool: MemoryPool, stream: Stream) -> None:
                module.capture(piece_inputs, size, pool, stream, host)

            return warm_up, capture

        self.capture_loop.run(
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

    def _piece_inputs(self, call: Call, size: int | None) -> list[torch.Tensor]:
        assert self._traced is not None
        inputs = []
        for slot in self._traced.inputs:
            if slot[0] == "fixed":
                inputs.append(slot[1])
                continue
            name = slot[1]
            if name in call.static:
                inputs.append(call.static[name])
            elif size is None:
                inputs.append(call.batched[name])
            else:
                inputs.append(self.inputs.buffers[name].narrow(self.config.batch_dim(name), 0, size))
        return inputs

    # -- serve ---------------------------------------------------------------------------------

    def _run_uncaptured(self, call: Call) -> Any:
        """The compiled pieces at the call's own size, without graphs."""
        assert self._traced is not None
        module = self._traced.compiled.module
        out = module(
            *self._piece_inputs(call, None), host=self.inputs.padded_host_args(call.host, call.batch)
        )
        return self._assemble(out, call.batch, call.batch)

    def _note_uncaptured(self, tokens: int) -> None:
        self.stats.eager_calls += 1
        self.stats.fallbacks["size_not_captured"] = self.stats.fallbacks.get("size_not_captured", 0) + 1
        if "size_not_captured" not in self.accounts.warned:
            self.accounts.warned.add("size_not_captured")
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
        for slot in traced.outputs:
            if slot[0] == "const":
                leaves.append(slot[1])
                continue
            index = slot[1]
            t = outputs[index]
            if size != batch:
                for d in traced.batch_dims[index]:
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
