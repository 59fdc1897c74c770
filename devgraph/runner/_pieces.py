"""``Pieces``: the runner part that cuts a model at its splitting ops and captures each piece per size.

Instead of one graph per size it traces the model once with Dynamo (``DevgraphCompiler``: aten
lowering, passes, split, per-piece compile), then captures every piece per size into the runner's
shared pool, largest size first. A replay runs the pieces' graphs with the splitting ops
(attention) run eagerly in between, so attention sees the call's real metadata. A call larger than
every captured size runs the compiled pieces uncaptured.

One trace serves every token count its decisions hold at. A forward that branches on the token
count (``if x.shape[0] == 1:``, the decode fast path) is traced again for the captured sizes where
the first trace went the other way. Size 1 gets a trace of its own, without a symbolic token
dimension, there and wherever the pieces are compiled (inductor, torchair): inside its own ops
torch assumes a symbolic size is not 1, without a guard, and compiled code keeps that (a
``squeeze`` of the token dim stays); eager pieces run the traced aten ops, which decide again at
run time. Each size is captured from the trace that serves it; a call no trace serves runs
eagerly (counted as ``token_count_branch`` above the captured sizes).

Modes (after vLLM's CUDAGraphMode): ``piecewise`` serves every call this way;
``full_and_piecewise`` routes uniform decode batches (``is_decode``) that fit a full-graph bucket
to the runner's ``WholeGraphs`` part and everything else (prefill, mixed batches, larger decode
batches) here; both capture into one pool on one side stream, as vLLM does.

The runner sits above ``devgraph.compile``: it uses the compiler, never the reverse.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch
from torch.utils._pytree import tree_unflatten

from devgraph._errors import DevgraphError
from devgraph._fallback_fixes import with_fix
from devgraph.compile import (
    CapturePlan,
    CompileConfig,
    DevgraphCompiler,
    PiecewiseModule,
    Traced,
    plan_capture_sizes,
    trace_call,
)
from devgraph.graph import Graph
from devgraph.runner._calls import Call, Unsupported
from devgraph.runner._config import RunnerConfig, RunnerStats
from devgraph.runner._part import Kit, Words
from devgraph.runner._progress import size_ranges

__all__ = ["Pieces", "PiecewiseStats"]

logger = logging.getLogger("devgraph")

PIECES = Words(
    kind="piecewise",
    match="traced",
    sizes="sizes",
    graphs="pieces",
    desc="piecewise capture",
    serve_what="piecewise",
    size_options="capture_sizes/capture_budget/traffic",
    remedy="or run the offending op eagerly between the pieces (splitting_ops=[...]), "
    "or capture fewer sizes (capture_sizes=[...])",
    probe="pieces",
    size_noun="capture sizes (tokens)",
)


@attrs.define
class PiecewiseStats(RunnerStats):
    """Counters of a piecewise runner (``graphed.stats``): ``RunnerStats`` and the compiler's own.

    ``replays`` counts piecewise replays; ``eager_calls`` calls that ran without graphs (a size
    above the captured ones runs the compiled pieces uncaptured: ``fallbacks['size_not_captured']``);
    ``full`` holds the full-graph part's own stats in ``full_and_piecewise`` mode; ``traces``
    counts the traces (one, plus one per region of captured sizes the forward branches differently
    at, plus size 1's own where the pieces are compiled).
    """

    compile_seconds: float = 0.0
    traces: int = 0
    dropped_sizes: tuple[int, ...] = ()
    pieces: int = 0
    splitting_ops: int = 0
    passes: dict[str, int] = attrs.field(factory=dict)
    full: RunnerStats | None = None


class Pieces:
    """Per-piece graphs of a traced, split model, one per piece and size (see the module docstring).

    Args:
        kit: what the runner lends (model, device, config: pad values, host args, batch dims, debug;
            the pool shared with a ``WholeGraphs`` part, the inputs, the capture loop, the accounts).
        compile_config: splitting ops, compiler, passes, capture sizes and budget.
        full_sizes: the batch sizes of a ``WholeGraphs`` part beside this one (their graphs count
            against the device's capture budget).
        full_stats: that part's stats (reported in ``stats.full``).
    Raises:
        DevgraphError: a compiler this device cannot run, or an unknown pass.
    """

    words = PIECES

    def __init__(
        self,
        kit: Kit,
        compile_config: CompileConfig,
        *,
        full_sizes: list[int] | None = None,
        full_stats: RunnerStats | None = None,
    ) -> None:
        compile_config.check_device(kit.device)  # its compiler and passes: refused here, not at trace
        self.kit = kit
        self.fn, self.device, self.config = kit.fn, kit.device, kit.config
        self.compile_config = compile_config
        self.shared = kit.shared
        self.inputs = kit.inputs
        self.full_sizes = full_sizes or []
        requested = compile_config.capture_sizes
        self.sizes = list(requested) if requested else list(self.full_sizes or _default_sizes(self.config))
        self.stats = PiecewiseStats(full=full_stats)
        self.plan: CapturePlan | None = None
        #: The sizes a call is bucketed into: the captured ones (None before capture).
        self.buckets: list[int] | None = None
        self.exact_only: str | None = None
        #: Every trace, the first (symbolic, at the largest size) first (see the module docstring).
        self.traces: list[Traced] = []
        self._trace_at: dict[int, Traced | None] = {}
        # Eager pieces run the traced aten ops, which decide size-1 questions again at run time;
        # compiled ones keep what torch decided for a symbolic size (not 1) without a guard.
        self._symbolic_serves_one = compile_config.compiler_for(kit.device) == "eager"
        self._replay_inputs: dict[int, list[torch.Tensor]] = {}

    @property
    def traced(self) -> Traced | None:
        """The first trace (None before the first call or ``capture``)."""
        return self.traces[0] if self.traces else None

    @property
    def module(self) -> PiecewiseModule | None:
        """The first trace's ``PiecewiseModule`` (None before the first call or ``capture``)."""
        return self.traces[0].compiled.module if self.traces else None

    def graphs(self, size: int) -> list[Graph]:
        """The captured graphs of ``size``, one per captured piece, in order."""
        traced = self.trace_for(size) if self.traces else None
        return traced.compiled.module.graphs(size) if traced is not None else []

    def trace_for(self, tokens: int) -> Traced | None:
        """The trace whose pieces compute what the forward does at ``tokens`` tokens (None: none
        does; such a call runs eagerly): a trace made at that count exactly, else the first
        symbolic one that holds there (at 1 token only where the pieces run eagerly)."""
        if tokens in self._trace_at:
            return self._trace_at[tokens]
        found = next((t for t in self.traces if t.static_size == tokens), None)
        if found is None and (tokens != 1 or self._symbolic_serves_one):
            found = next((t for t in self.traces if t.static_size is None and t.holds_at(tokens)), None)
        if len(self._trace_at) < _TRACE_AT_CACHE:
            self._trace_at[tokens] = found
        return found

    @property
    def cache_key(self) -> str:
        """A key of everything that changes what this part compiles and captures."""
        parts = (
            self.config.uuid(),
            self.compile_config.uuid(self.device),
            self.device.name,
            torch.__version__,
        )
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]

    # -- serve ---------------------------------------------------------------------------------

    def replay(self, call: Call, size: int, host_args: Mapping[str, Any] | None) -> Any:
        """Replay the pieces of ``size`` (the call is loaded), the splitting ops eagerly in between;
        the flat outputs (``cut`` rebuilds the forward's)."""
        traced = self.trace_for(size)
        assert traced is not None  # every captured size has its trace
        replay_inputs = self._replay_inputs.get(size)
        if replay_inputs is None:
            replay_inputs = self._piece_inputs(traced, call, size)
            if not call.static:  # then the same tensors every call: the buffers' first rows, weights
                self._replay_inputs[size] = replay_inputs
        return traced.compiled.module.replay(replay_inputs, size, host_args, debug=self.config.debug)

    def cut(self, outputs: Any, size: int, batch: int) -> Any:
        """The forward's outputs from the pieces' flat ``outputs`` at ``size``, cut to ``batch`` rows."""
        traced = self.trace_for(size)
        assert traced is not None
        return self._assemble(traced, outputs, size, batch)

    def beyond(self, call: Call, why: Unsupported) -> Any:
        """A call no captured size serves: the compiled pieces at the call's own size, uncaptured
        (counted: ``size_not_captured`` above the captured sizes, else ``why``'s category); eagerly
        where no trace holds at that size (``token_count_branch``, or ``why``'s category below the
        largest captured size)."""
        traced = self.trace_for(call.batch)
        if traced is None:
            if why.category == "batch_too_large":
                raise Unsupported(
                    "token_count_branch",
                    f"the forward branches on the token count, and no trace holds at {call.batch} tokens "
                    f"({self._branch_lines()}); such calls run eagerly",
                )
            raise why
        if why.category == "batch_too_large":
            self._note_uncaptured(call.batch)
        else:
            self.kit.accounts.note_fallback(why.category, why.detail)
        return self._run_uncaptured(traced, call)

    # -- capture -------------------------------------------------------------------------------

    def drop(self) -> None:
        """Forget the trace and every captured graph; the counters stay."""
        for traced in self.traces:
            traced.compiled.module.reset()
        self.traces = []
        self._trace_at.clear()
        self.plan = None
        self.buckets = None
        self.exact_only = None
        self._replay_inputs.clear()
        self.stats.forget_capture()
        self.stats.pieces = self.stats.splitting_ops = self.stats.traces = 0
        self.stats.passes = {}
        self.stats.dropped_sizes = ()
        self.stats.compile_seconds = 0.0

    def capture(self, example: Call) -> None:
        """Trace, compile and capture every planned size (run inside ``CaptureLoop.all_or_nothing``; the
        runner's inputs hold buffers of enough rows)."""
        inputs = self.inputs
        # The first trace marks the token dim dynamic, at the largest size (at least 2: a traced size
        # of 1 would make torch decide size-1 questions for that size).
        trace_size = max(2, max(self.sizes))
        start = time.perf_counter()
        first = self._trace(example, trace_size, run_sizes=[trace_size])
        self.traces = [first]
        self._trace_at.clear()
        # The sizes to capture the first trace does not serve (see the module docstring): each gets
        # a trace made at it, which then serves every size it holds at that is still open.
        wanting = sorted({n for n in self.sizes if self.trace_for(n) is None})
        while wanting:
            if len(self.traces) >= _MAX_TRACES:  # a branch every few sizes: refuse, naming the line
                first.check_guards(self._run_sizes())
                raise DevgraphError(
                    f"the forward branches on the token count ({self._branch_lines()}) so that "
                    f"{_MAX_TRACES} traces do not serve the capture sizes ({size_ranges(wanting)} are left). "
                    "Make the forward the same code for every token count (torch.where instead of Python "
                    "branching on x.shape), capture fewer sizes (capture_sizes=[...]), or use mode='full'"
                )
            n = wanting[0]
            self.traces.append(self._trace(example, n, static=n == 1))
            self._trace_at.clear()
            wanting = [m for m in wanting[1:] if self.trace_for(m) is None]
        self.stats.compile_seconds = time.perf_counter() - start
        self.stats.traces = len(self.traces)
        module = first.compiled.module
        self.stats.pieces = module.captured_pieces
        self.stats.splitting_ops = sum(p.is_splitting_op for p in first.compiled.split.pieces)
        self.stats.passes = dict(first.compiled.pass_counts)
        self.plan = self._plan(max(t.compiled.module.captured_pieces for t in self.traces))
        self.stats.dropped_sizes = self.plan.dropped
        if len(self.traces) > 1:
            logger.info(
                "devgraph: the forward branches on the token count (%s); %d traces serve the sizes (%s)",
                self._branch_lines(),
                len(self.traces),
                "; ".join(
                    f"{'traced at ' + str(t.static_size) if t.static_size else 'symbolic'}: "
                    f"{size_ranges([n for n in self.plan.sizes if self.trace_for(n) is t]) or 'none captured'}"
                    for t in self.traces
                ),
            )

        def prepare(size: int) -> tuple[Callable[[], Any], Callable[[], None]]:
            host = inputs.padded_host_args({}, size)  # padding only: what warm-up and capture see
            traced = self.trace_for(size)
            assert traced is not None  # a size no trace holds at was traced itself above
            sized = traced.compiled.module
            piece_inputs = self._piece_inputs(traced, example, size)

            def warm_up() -> Any:
                return sized(*piece_inputs, host=host)

            def capture() -> None:
                sized.capture(piece_inputs, size, self.shared, host)

            return warm_up, capture

        verdict = self.kit.loop.run(
            list(self.plan.sizes),
            prepare,
            stats=self.stats,
            words=self.words,
            summary=f"captured {module.captured_pieces} pieces x {len(self.plan.sizes)} sizes ({{sizes}})"
            + (f" from {len(self.traces)} traces" if len(self.traces) > 1 else ""),
            tail=f"; {self.stats.splitting_ops} splitting ops run eagerly in between",
            example=example,
        )
        self.exact_only = verdict.exact_only if verdict is not None else None
        self.buckets = list(self.plan.sizes)

    def _trace(
        self, example: Call, size: int, *, run_sizes: list[int] | None = None, static: bool = False
    ) -> Traced:
        """Trace the model at ``size`` tokens (the buffers' first rows): symbolic in the token dim,
        refused where it fails at ``run_sizes`` or above (the first trace); a later one is ``static``
        at that size, or becomes so where the forward pins the token count to it."""
        cfg, inputs = self.config, self.inputs

        def invoke(tensors: dict[str, torch.Tensor], traced: bool) -> Any:
            values: dict[str, Any] = dict(tensors)
            values.update(example.consts)
            for name in example.host:
                values[name] = [] if traced else [cfg.pad_value(name)] * size
            args, kwargs = example.bind(inputs.signature, values)
            return self.fn(*args, **kwargs)

        tensors = inputs.narrowed(size)
        tensors.update(example.static)
        dynamic = {n: cfg.batch_dim(n) for n in example.batched}
        host = inputs.padded_host_args({}, size)
        compiler = DevgraphCompiler(
            self.device, self.compile_config, host_args=[op for _, op in cfg.host_args]
        )
        return trace_call(
            invoke,
            tensors,
            dynamic,
            compiler,
            host,
            run_sizes,
            check_guards=run_sizes is not None,
            static_size=size if static else None,
            # a later trace may pin its size (``if x.shape[0] == 2:`` at 2): it then serves that size
            static_if_pinned=run_sizes is None,
        )

    def _branch_lines(self) -> str:
        """The user lines the traces branched on the token count at (for messages)."""
        lines = {line for t in self.traces for line in t.branch_lines}
        return "; ".join(sorted(lines)) or "a branch on the token count"

    def _run_sizes(self) -> list[int] | None:
        """The token counts the pieces may run at below the largest (None: every count, when the
        budget leaves no piece captured)."""
        budget = self._budget()
        return None if budget is not None and budget < 1 else list(self.sizes)

    def _budget(self) -> int | None:
        budget = self.compile_config.effective_budget(self.device)
        if budget is not None and self.full_sizes:
            budget -= len(self.full_sizes)  # one graph per decode batch size (assumed one stream each)
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

    def _piece_inputs(self, traced: Traced, call: Call, size: int | None) -> list[torch.Tensor]:
        inputs = []
        for slot in traced.inputs:
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

    def _run_uncaptured(self, traced: Traced, call: Call) -> Any:
        """The compiled pieces of ``traced`` at the call's own size, without graphs."""
        out = traced.compiled.module(
            *self._piece_inputs(traced, call, None), host=self.inputs.padded_host_args(call.host, call.batch)
        )
        return self._assemble(traced, out, call.batch, call.batch)

    def _note_uncaptured(self, tokens: int) -> None:
        accounts = self.kit.accounts
        stats = accounts.stats  # the runner's counters of calls
        stats.eager_calls += 1
        stats.fallbacks["size_not_captured"] = stats.fallbacks.get("size_not_captured", 0) + 1
        if "size_not_captured" not in accounts.warned:
            accounts.warned.add("size_not_captured")
            assert self.plan is not None
            detail = (
                f"{tokens} tokens is above the captured sizes ({size_ranges(self.plan.sizes) or 'none'}); such "
                "calls run the compiled pieces without graphs"
            )
            logger.info("devgraph: %s", with_fix("size_not_captured", detail))

    def _assemble(self, traced: Traced, flat: Any, size: int, batch: int) -> Any:
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


#: Traces one part makes at most: the first, size 1's own and one per further region of token
#: counts its branches divide the captured sizes into; more refuse (a branch every few sizes).
_MAX_TRACES = 4
#: Token counts whose trace ``trace_for`` remembers (captured ones and uncaptured calls' sizes).
_TRACE_AT_CACHE = 4096


def _default_sizes(config: RunnerConfig) -> list[int]:
    from devgraph.runner._buckets import normalise_batch_sizes

    return normalise_batch_sizes(config.batch_sizes, config.max_batch_size)
