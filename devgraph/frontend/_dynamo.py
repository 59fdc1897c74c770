"""Dynamo in front, devgraph behind: ``torch.compile(model, backend="devgraph")``.

Dynamo traces the forward: it inlines the Python (properties, helpers, closures, partials), guards
what the forward read (globals, class attributes, list and dict items, torch's global flags) on
every call as the call was made, replays the forward's side effects on Python objects after each
call, and breaks the graph where it cannot follow, running that code eagerly. What it hands a
backend is an FX graph: a function of tensors and sizes, with no Python state left in it. devgraph
reads each one (``devgraph.frontend._traced_graph.TracedGraph``: which tensors are batched, which are the
model's state, which sizes derive from which tensors) and serves it with a ``GraphRunner``
(``mode='full'``): captured per batch-size bucket, the call padded to its bucket and replayed, the
outputs cut to the call's rows.

A graph devgraph cannot serve runs as Dynamo traced it, eagerly, counted by reason in
``stats.unservable`` with one warning naming it; a call Dynamo ran without any graph is counted in
``stats.fallbacks``. ``torch.compile``'s own ``mode`` is refused: devgraph takes ``options={...}``, the
``RunnerConfig`` fields plus ``device``. ``devgraph.frontend.TracedModule`` (what ``devgraph.wrap``
returns in ``mode='full'``) holds one ``DynamoGraphs``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import torch
from torch._dynamo.utils import counters

from devgraph._errors import DevgraphError
from devgraph._plugins import device as find_device
from devgraph.compile import compile_option_names
from devgraph.frontend._traced_graph import PYTHON_RANDOM, TracedGraph, Unservable
from devgraph.graph import Device
from devgraph.runner import (
    MODE_TABLE,
    Accounts,
    GraphRunner,
    RunnerConfig,
    RunnerStats,
    make_config,
    piecewise_config,
    piecewise_runner,
)

__all__ = ["DynamoGraphs", "DynamoStats", "Served", "backend_for", "call_traced", "compile_graph"]

logger = logging.getLogger("devgraph")

#: The modes whose graphs are served with Dynamo in front: each graph whole, breakable, or in pieces
#: (those that route by ``is_decode``, called with the model's own arguments, are not)
SERVED_MODES = tuple(name for name, mode in MODE_TABLE.items() if not mode.routes)
#: ``RunnerConfig`` fields a Dynamo graph's runner sets itself (read from the graph)
_DERIVED = ("batch_dims", "static_args", "host_args", "pad_values")
#: How Dynamo traces for devgraph (``torch._dynamo.config``, set while Dynamo traces a call of a
#: ``TracedModule``, never between): an int attribute of a module that changes every call
#: (``self.calls += 1``) is a size input of the graph, not a guard failing at every call; a Python
#: float the forward reads is a constant of the graph, guarded, never a 0-d tensor read with
#: ``.item()`` inside it (a graph would freeze it). Dynamo's guards do not include its config, so
#: setting it at each call would cost the call (17 us here) for nothing.
DYNAMO_CONFIG = {"allow_unspec_int_on_nn_module": True, "specialize_float": True}


class _Tracing(threading.local):
    """Per thread: how deep in ``TracedModule`` calls it is, the config a trace replaced, the backend
    of the call being traced and Dynamo's graph-break counts when its trace started."""

    depth = 0
    saved: dict[str, Any] | None = None
    graphs: DynamoGraphs | None = None
    breaks: dict[str, int] | None = None


_TRACING = _Tracing()
_HOOKED = threading.Lock()


def _on_compile_start(args: Any) -> None:
    if _TRACING.depth and _TRACING.saved is None:
        config = torch._dynamo.config
        _TRACING.saved = {k: getattr(config, k) for k in DYNAMO_CONFIG}
        for k, v in DYNAMO_CONFIG.items():
            setattr(config, k, v)
        _TRACING.breaks = dict(counters["graph_break"])


def _on_compile_end(args: Any) -> None:
    saved = _TRACING.saved
    if saved is not None:
        _TRACING.saved = None
        for k, v in saved.items():
            setattr(torch._dynamo.config, k, v)
        before, graphs = _TRACING.breaks or {}, _TRACING.graphs
        _TRACING.breaks = None
        if graphs is not None:
            for reason, n in list(counters["graph_break"].items()):
                if n > before.get(reason, 0):
                    graphs.note_break(reason, n - before.get(reason, 0))


@functools.cache
def _handler() -> Any:
    import torch._dynamo.callback as callback

    return callback.callback_handler


def _hook_compiles() -> None:
    """Register Dynamo's compile-start and -end callbacks that set ``DYNAMO_CONFIG`` for the traces a
    ``TracedModule`` call starts (inert for every other compile of the process). Checked at every
    call: ``torch._dynamo.reset()`` clears the callbacks."""
    handler = _handler()
    if _on_compile_start in handler.start_callbacks:
        return
    with _HOOKED:
        if _on_compile_start not in handler.start_callbacks:
            handler.register_start_callback(_on_compile_start)
            handler.register_end_callback(_on_compile_end)


def call_traced(graphs: DynamoGraphs, compiled: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call ``compiled`` (a model ``torch.compile``'d with ``graphs`` as its backend), with
    ``DYNAMO_CONFIG`` set for the traces the call starts and their graph breaks noted in ``graphs``."""
    _hook_compiles()
    _TRACING.depth += 1
    outer, _TRACING.graphs = _TRACING.graphs, graphs
    try:
        return compiled(*args, **kwargs)
    finally:
        _TRACING.depth -= 1
        _TRACING.graphs = outer


class _GraphFunction:
    """``graph.run`` as the function a ``GraphRunner`` serves: its signature names the runner's
    arguments, and it declares the graph's state tensors (buffers, caches it may write in place:
    ``devgraph_traced_state``), which the capture loop snapshots and puts back after the capture's
    runs. Dynamo guards every Python value the graph was traced with, so the runner guards none."""

    def __init__(self, graph: TracedGraph) -> None:
        self.graph = graph
        params = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in graph.arguments]
        self.__signature__ = inspect.Signature(params)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:  # called by argument name (a bisect's eager run of a recorded step)
            args = (*args, *(kwargs[name] for name in self.graph.arguments[len(args) :]))
        return self.graph.run(*args)

    def devgraph_traced_state(self) -> dict[str, Any]:
        return self.graph.state

    def devgraph_parameters(self) -> list[torch.Tensor]:
        """The model's parameters the graph reads (a served output requires grad where one does)."""
        return self.graph.parameters()


@attrs.frozen
class Served:
    """One graph replay of a call: the graph, its runner, the runner's arguments (batched tensors
    cloned), and the tensor outputs it returned (cloned)."""

    graph: TracedGraph
    runner: Any
    arguments: list[Any]
    outputs: list[Any]


@attrs.define
class DynamoStats:
    """Counters of the graphs Dynamo handed devgraph (``graphed.stats`` with ``frontend='dynamo'``).

    ``replays``, ``eager_calls``, ``fallbacks``, ``capture_seconds``, ``pool_bytes`` and
    ``recaptures`` add up every graph's runner; ``graphs`` is how many graphs Dynamo handed over
    (a graph break makes two; a recompile, one more); ``unservable`` counts by reason the graphs
    devgraph runs as traced, eagerly.
    """

    replays: int = 0
    eager_calls: int = 0
    fallbacks: dict[str, int] = attrs.field(factory=dict)
    capture_seconds: float = 0.0
    pool_bytes: int = 0
    recaptures: int = 0
    #: graphs Dynamo traced again because a guard failed (a value the forward reads changed)
    recompiles: int = 0
    graphs: int = 0
    unservable: dict[str, int] = attrs.field(factory=dict)
    #: Dynamo's graph breaks by reason (its first line): the code at each runs eagerly at every call
    graph_breaks: dict[str, int] = attrs.field(factory=dict)
    captured_sizes: tuple[int, ...] = ()
    #: every graph's ``RunnerStats.row_count_rounding`` (rows, bucket, largest difference)
    row_count_rounding: tuple[Any, ...] = ()
    #: how the forward was read: ``"dynamo"`` (traced, guarded; ``"raw"`` is ``RunnerStats``')
    frontend: str = "dynamo"
    #: ``mode='piecewise'``: every graph's pieces, splitting ops met, traces, compile seconds and
    #: matches per pass, added up (``PiecewiseStats``)
    pieces: int = 0
    splitting_ops: int = 0
    traces: int = 0
    compile_seconds: float = 0.0
    passes: dict[str, int] = attrs.field(factory=dict)


class DynamoGraphs:
    """The graphs of one ``torch.compile(backend="devgraph")``: a runner per graph Dynamo handed over.

    The backend of ``torch.compile`` is this object (``compile_graph`` makes one per call); a
    ``devgraph.wrap(..., frontend="dynamo")`` holds one and reads its ``stats``.
    """

    def __init__(self, device: Any, config: Any, compile_options: dict[str, Any] | None = None) -> None:
        self.device = device
        self.config = config
        #: ``CompileConfig`` fields of ``mode='piecewise'`` (each graph is cut and its pieces captured)
        self.compile_options = dict(compile_options or {})
        #: the batch dim of the compiled function's arguments by name (default 0)
        self.batch_dims: dict[str, int] = {}
        #: the compiled function's arguments never batched (``static_args``), and the fill value of
        #: padded rows of those that are (``pad_values``), by argument name
        self.unbatched: frozenset[str] = frozenset()
        self.pad_values: dict[str, Any] = {}
        #: the name of the compiled forward's ``**kwargs`` parameter, if it has one
        self.var_keyword: str | None = None
        #: FX passes (``devgraph.compile.passes.Pass``) run over each graph Dynamo hands over, before
        #: it is read and captured (an adapter's rewrite of an op that cannot be captured as traced);
        #: a ``DevgraphError`` from one makes that graph run as traced, eagerly, with its message
        self.graph_passes: tuple[Any, ...] = ()
        #: a wrapper owns the calling thread for every graph (``TracedModule``): the graphs' runners
        #: claim none of their own
        self.caller_serialises = False
        #: a graph drew Python random numbers (``PYTHON_RANDOM``); a wrapper that can run the model
        #: eagerly instead sets ``eager_on_python_random`` (else the backend raises)
        self.python_random = False
        self.eager_on_python_random = False
        self.runners: list[Any] = []
        #: Dynamo's graph breaks in the traced forward, by reason (the code at each runs eagerly, every call)
        self.graph_breaks: dict[str, int] = {}
        #: graphs Dynamo traced again because a guard failed; how many of each code's guard failures
        #: were seen (``torch._dynamo.utils.guard_failures``)
        self.recompiles = 0
        self._failures_seen: dict[Any, int] = {}
        self._frames: set[Any] = set()  # Dynamo's ids of the frames this backend was handed graphs of
        self._unservable: dict[str, int] = {}
        self._eager_calls = 0
        self._warned: set[str] = set()
        self._runner_warned: set[str] = set()  # what every graph's runner warned about (once for all)
        #: the calls no graph's runner served: counted by reason, warned once (``strict`` raises)
        self.accounts = Accounts(config, RunnerStats(), threading.RLock(), "through Dynamo")
        self._lock = threading.Lock()
        #: calls of any graph's callable, served or eager (a wrapper tells a call Dynamo ran by itself)
        self.served = 0
        #: while ``recording``: (graph, runner, the runner's arguments, its outputs) per graph a call
        #: replayed, in call order (what a bisect of the call looks at)
        self._log: list[Served] | None = None

    def __call__(self, gm: Any, example_inputs: Sequence[Any], **kwargs: Any) -> Callable[..., Any]:
        """Dynamo's backend: the callable that serves graph ``gm`` (see the module docstring)."""
        self._note_recompile()
        try:
            self._rewrite(gm)
            graph = TracedGraph(gm, example_inputs, self.batch_dims, self.unbatched, self.var_keyword)
        except Unservable as why:
            return self._as_traced(gm, why)
        if graph.fixed_batch == 0:  # Dynamo specialises a size of 0: nothing to capture or replay
            return self._empty(gm)
        pad = {n: self.pad_values[u] for n, u in graph.user_names.items() if u in self.pad_values}
        config = attrs.evolve(
            self.config, batch_dims=graph.batch_dims, static_args=graph.static, pad_values=pad
        )
        if graph.fixed_batch is not None:  # Dynamo specialised the graph to this size: capture it alone
            config = attrs.evolve(config, batch_sizes=[graph.fixed_batch], max_batch_size=None)
        runner = self._runner(_GraphFunction(graph), config)
        runner.accounts.warned = self._runner_warned  # one warning per reason for all the graphs
        with self._lock:
            self.runners.append(runner)
        logger.debug(
            "devgraph: Dynamo graph %d: batched %s, static %d",
            len(self.runners),
            graph.batch_dims,
            len(graph.static),
        )

        def serve(*args: Any) -> Any:
            self.served += 1
            graph.current = args
            moved = graph.moved(args)
            if moved and runner.captured:  # the graphs read the old memory: capture again
                runner.reset()
                shown = ", ".join(moved[:4]) + (f" and {len(moved) - 4} more" if len(moved) > 4 else "")
                runner.accounts.note_recapture(shown)  # counted, warned once, as the raw path does
            arguments = graph.split(args)
            log, replays = self._log, runner.stats.replays
            if log is not None:  # clone what a later replay overwrites: the call's batched tensors
                batched = set(graph.batch_dims)
                kept = [a.clone() if n in batched else a for n, a in zip(graph.arguments, arguments)]
            if runner.captured:
                out = runner(*arguments)
            else:  # capture: what it changed must be what the graph says it writes (put back)
                before = graph.unwritten_versions(args)
                out = runner(*arguments)
                wrote = graph.changed_unwritten(args, before)
                if wrote:
                    runner.reset()
                    raise DevgraphError(
                        f"capturing a graph Dynamo traced wrote {', '.join(wrote[:4])} in place, which devgraph "
                        "did not find written in the graph (so the capture's runs advanced it and it was not "
                        "put back). Write model state with in-place tensor methods (buf.add_(1)) the graph "
                        "shows, or wrap with frontend='raw'"
                    )
            if log is not None and runner.stats.replays != replays:
                log.append(Served(graph, runner, kept, [t.clone() for t in out]))
            return graph.assemble(args, out)

        return serve

    def _rewrite(self, gm: Any) -> None:
        """Run ``graph_passes`` over ``gm`` (raises ``Unservable`` with a pass's refusal)."""
        changed = 0
        for graph_pass in self.graph_passes:
            try:
                changed += graph_pass(gm.graph)
            except DevgraphError as why:
                raise Unservable(graph_pass.name, str(why)) from why
        if changed:
            gm.recompile()

    def _runner(self, fn: _GraphFunction, config: RunnerConfig) -> GraphRunner:
        """The runner of one graph, by mode: whole graphs per bucket, breakable graphs (the break ops
        run eagerly between segments), or pieces (the graph traced once more, as a function of
        tensors only, cut at the splitting ops, each piece captured per size)."""
        pieces = MODE_TABLE[config.mode].serves == "pieces"
        whole = fn.graph.fixed_batch is not None or fn.graph.untraceable is not None
        if pieces and whole:
            # Specialised by Dynamo to one size (a branch on ``x.shape[0] == 1``: pieces need a
            # symbolic size to trace), or holding what Dynamo cannot trace again (a ``.data`` read):
            # this graph is captured whole, each size on its own.
            logger.debug(
                "devgraph: a Dynamo graph captured whole in piecewise mode (%s)",
                "one size" if fn.graph.fixed_batch is not None else fn.graph.untraceable,
            )
            return GraphRunner(
                fn, self.device, attrs.evolve(config, mode="full"), caller_serialises=self.caller_serialises
            )
        if pieces:
            options = dict(self.compile_options)
            if config.batch_sizes is not None and "capture_sizes" not in options:
                options["capture_sizes"] = config.batch_sizes
            return piecewise_runner(
                fn, self.device, config, caller_serialises=self.caller_serialises, **options
            )
        return GraphRunner(fn, self.device, config, caller_serialises=self.caller_serialises)

    def _note_recompile(self) -> None:
        """Count a graph Dynamo traced again because a guard failed (a value the forward read changed),
        and warn once naming the guard."""
        compile_id = torch._guards.CompileContext.current_compile_id()
        # Guard failures of other wrappers' cache entries (another wrapper of the same class) are
        # not shown; a frame this wrapper traced before is what makes a recompile.
        reasons = [r for r in new_guard_failures(self._failures_seen) if "BACKEND_MATCH" not in r]
        if compile_id is None:
            return
        with self._lock:
            again = compile_id.frame_id in self._frames
            self._frames.add(compile_id.frame_id)
        if not again:
            return
        # A size Dynamo had specialised (0 or 1 rows first, then another count) is a new graph for the
        # batch dimension, expected and counted, not a value that changed: no warning.
        sizes_only = bool(reasons) and all("size mismatch" in r for r in reasons[-2:])
        with self._lock:
            self.recompiles += 1
            first = not sizes_only and "recompile" not in self._warned
            if first:
                self._warned.add("recompile")
        if first:
            logger.warning(
                "devgraph: Dynamo traced the forward again: a guard failed (%s). The new graph is captured "
                "for the new value (stats.recompiles); a value that changes at every call makes Dynamo "
                "trace again until its recompile limit, then run eagerly (stats.fallbacks['dynamo_untraced']): "
                "pass such a value as a tensor",
                "; ".join(reasons[-2:]) or "reason not recorded",
            )

    def note_break(self, reason: str, n: int) -> None:
        """Count Dynamo's graph break (its reason, as Dynamo words it) and warn once per reason."""
        lines = [line.strip() for line in reason.splitlines() if line.strip()]
        short = lines[0] if lines else "unknown"
        hint = next((line for line in lines if line.startswith("Hint:")), "")
        with self._lock:
            first = short not in self.graph_breaks
            self.graph_breaks[short] = self.graph_breaks.get(short, 0) + n
        if first:
            logger.warning(
                "devgraph: Dynamo broke the forward's graph (%s): the code there runs eagerly at every call, "
                "between the graphs devgraph replays (each padded to its bucket and cut on its own). %s "
                "Pass fullgraph=True to refuse it instead; stats.graph_breaks counts them",
                short,
                hint,
            )

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[Served]]:
        """Within the block, each graph replay is logged (``Served``), in call order."""
        log: list[Served] = []
        self._log = log
        try:
            yield log
        finally:
            self._log = None

    def _empty(self, gm: Any) -> Callable[..., Any]:
        """A graph of 0 rows: run as traced at every call, each counted as the raw path counts it."""
        return self._eager(gm, lambda me: me.accounts.note_fallback("empty_batch", _EMPTY))

    def _eager(self, gm: Any, count: Callable[[DynamoGraphs], None]) -> Callable[..., Any]:
        """``gm`` run as Dynamo traced it, eagerly, each call served and counted by ``count`` (held by
        weak reference: Dynamo's cache keeps the callable, which must not keep the backend alive)."""
        forward, owner = gm.forward, weakref.ref(self)

        def eager(*args: Any) -> Any:
            me = owner()
            if me is not None:
                me.served += 1
                count(me)
            return forward(*args)

        return eager

    def _as_traced(self, gm: Any, why: Unservable) -> Callable[..., Any]:
        if why.category == "python_random":
            self.python_random = True  # a TracedModule runs later calls eagerly, Dynamo not at all
            if not self.eager_on_python_random:  # torch.compile's own backend: nothing can run eagerly
                raise DevgraphError(f"devgraph cannot serve this forward through Dynamo: {PYTHON_RANDOM}")
        with self._lock:
            self._unservable[why.category] = self._unservable.get(why.category, 0) + 1
            first = why.category not in self._warned
            self._warned.add(why.category)
        if self.config.strict:
            raise DevgraphError(f"devgraph cannot serve a graph Dynamo traced: {why.detail}")
        if first:
            logger.warning("devgraph: a graph Dynamo traced runs eagerly (%s): %s", why.category, why.detail)
        return self._eager(gm, _count_eager_call)

    @property
    def stats(self) -> DynamoStats:
        """Every graph's counters added up (a new object each time: read it again for new counts)."""
        total = DynamoStats(graphs=len(self.runners) + sum(self._unservable.values()))
        total.unservable = dict(self._unservable)
        total.graph_breaks = dict(self.graph_breaks)
        total.recompiles = self.recompiles
        total.eager_calls = self._eager_calls
        mine = self.accounts.stats
        total.eager_calls += mine.eager_calls
        total.fallbacks.update(mine.fallbacks)
        sizes: set[int] = set()
        rounding: list[Any] = []
        for runner in self.runners:
            s = runner.stats
            rounding.extend(s.row_count_rounding)
            total.pieces += getattr(s, "pieces", 0)
            total.splitting_ops += getattr(s, "splitting_ops", 0)
            total.traces += getattr(s, "traces", 0)
            total.compile_seconds += getattr(s, "compile_seconds", 0.0)
            for name, n in getattr(s, "passes", {}).items():
                total.passes[name] = total.passes.get(name, 0) + n
            total.replays += s.replays
            total.eager_calls += s.eager_calls
            total.capture_seconds += s.capture_seconds
            total.pool_bytes += s.pool_bytes
            total.recaptures += s.recaptures
            for reason, n in s.fallbacks.items():
                total.fallbacks[reason] = total.fallbacks.get(reason, 0) + n
            sizes.update(s.captured_sizes)
        total.captured_sizes = tuple(sorted(sizes))
        total.row_count_rounding = tuple(rounding)
        return total

    def reset(self) -> None:
        """Drop every graph's captures (the next call of each captures again)."""
        for runner in self.runners:
            runner.reset()


_EMPTY = "the call has 0 rows; there is nothing to replay"


def _count_eager_call(graphs: DynamoGraphs) -> None:
    graphs._eager_calls += 1


def new_guard_failures(seen: dict[Any, int]) -> list[str]:
    """Dynamo's guard-failure reasons recorded since ``seen`` (updated), oldest first."""
    from torch._dynamo.utils import guard_failures

    found: list[str] = []
    for code, reasons in list(guard_failures.items()):
        found.extend(str(r) for r in reasons[seen.get(code, 0) :])
        seen[code] = len(reasons)
    return found


def compile_graph(
    gm: Any, example_inputs: Sequence[Any], *, options: dict[str, Any] | None = None, mode: str | None = None
) -> Callable[..., Any]:
    """The ``"devgraph"`` backend of ``torch.compile`` (registered through torch's
    ``torch_dynamo_backends`` entry point): ``torch.compile(model, backend="devgraph",
    options={"device": "cpu", "batch_sizes": [1, 2, 4]})``.

    A backend made by this function serves one graph; ``torch.compile(model, backend=graphs)`` with a
    ``DynamoGraphs`` (what ``devgraph.wrap(..., frontend="dynamo")`` builds) keeps every graph's
    counters in one place.

    Raises:
        DevgraphError: ``mode=`` given (devgraph takes ``options``), an unknown option (the message
            lists the valid ones), or a bad value.
    """
    return backend_for(options, mode)(gm, example_inputs)


def backend_for(options: dict[str, Any] | None = None, mode: str | None = None) -> DynamoGraphs:
    """A ``DynamoGraphs`` for ``options`` (``RunnerConfig`` fields and ``device``)."""
    if mode is not None:
        raise DevgraphError(
            f"torch.compile(backend='devgraph') takes options={{...}}, not mode={mode!r}: devgraph "
            "captures and replays every graph Dynamo hands it (mode='reduce-overhead' is inductor's)"
        )
    options = dict(options or {})
    device = options.pop("device", None)
    derived = sorted(set(options) & set(_DERIVED))
    if derived:
        raise DevgraphError(
            f"option(s) {derived} are read from Dynamo's graph (which tensors are batched, which are "
            "passed as they are); drop them"
        )
    names = compile_option_names()
    compile_options = {k: options.pop(k) for k in list(options) if k in names}
    config = make_config(
        RunnerConfig, options, extra_valid=names, what=" for torch.compile(backend='devgraph')"
    )
    if config.mode not in SERVED_MODES:
        raise DevgraphError(
            f"mode={config.mode!r} is not served with Dynamo in front: it routes decode batches with is_decode, "
            "which is called with the model's own arguments. Use devgraph.wrap(model, mode=..., "
            f"frontend='raw'), or one of {list(SERVED_MODES)}"
        )
    if compile_options and MODE_TABLE[config.mode].serves != "pieces":
        raise DevgraphError(
            f"option(s) {sorted(compile_options)} apply to mode='piecewise' only; add mode='piecewise' or drop them"
        )
    dev = device if isinstance(device, Device) else find_device(device)
    if MODE_TABLE[config.mode].serves == "pieces":
        # A bad size, a compiler the device lacks, an unknown pass: refused now, not at the first trace
        piecewise_config(config.mode, compile_options).check_device(dev)
    return DynamoGraphs(dev, config, compile_options=compile_options)
