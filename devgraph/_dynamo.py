"""Dynamo in front, devgraph behind: ``torch.compile(model, backend="devgraph")``.

Dynamo traces the forward: it inlines the Python (properties, helpers, closures, partials), guards
what the forward read (globals, class attributes, list and dict items, torch's global flags) on
every call as the call was made, replays the forward's side effects on Python objects after each
call, and breaks the graph where it cannot follow, running that code eagerly. What it hands a
backend is an FX graph: a function of tensors and sizes, with no Python state left in it. devgraph
serves each such graph with a ``GraphRunner`` (``mode='full'``): captured per batch-size bucket,
the call padded to its bucket and replayed, the outputs cut to the call's rows.

What devgraph reads from the graph, not from guesses:

* **the batch.** The size symbol at the first dynamic dimension of the first user input (Dynamo
  made it dynamic: ``devgraph.wrap(..., frontend="dynamo")`` marks every tensor argument's batch
  dimension so, and Dynamo's automatic dynamic does after a second size). Every tensor whose shape
  holds that symbol is batched along that dimension; every other tensor (parameters, buffers,
  caches of fixed size) is passed as it is, its address checked at every call. A graph whose shapes
  hold no symbol was specialised to one size by Dynamo: it is captured at that size only.
* **sizes.** Dynamo passes a graph the sizes it computes with (``s0``): devgraph derives each from
  the tensor dimension it names, so the padded bucket's graph computes at the bucket's size, and a
  size the graph returns is computed from the call's own sizes, never the bucket's.
* **state written in place.** A buffer the graph writes (``self.count.add_(1)``) is restored after
  the capture's runs, so it advances once per call, as eagerly.

A graph devgraph cannot serve (the batch symbol inside an expression of a tensor's shape, a size the
graph returns that is not a function of its inputs' sizes) runs as Dynamo traced it, eagerly,
counted by reason in ``stats.fallbacks`` with one warning naming it. ``torch.compile``'s own
``mode`` is refused: devgraph takes ``options={...}``, the ``RunnerConfig`` fields plus ``device``.
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

from devgraph._errors import DevgraphError

__all__ = ["DynamoGraphs", "DynamoStats", "Served", "TracedGraph", "TracedModule", "compile_graph"]

logger = logging.getLogger("devgraph")

#: Why a forward that draws Python random numbers is not run through Dynamo after its first call.
PYTHON_RANDOM = (
    "the forward draws Python random numbers (random.random(), a random.Random's methods): Dynamo draws "
    "them before each call of its graph, and for a random.Random instance it repeats the first call's "
    "draw on every later call (torch 2.13; the global random module's draws are right), a wrong value "
    "devgraph cannot see. Every call after the first runs the model eagerly. Draw with torch's "
    "generators on tensors instead, or pass the number in as a tensor"
)
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
    """Per thread: how deep in ``TracedModule`` calls it is, and the config a trace replaced."""

    depth = 0
    saved: dict[str, Any] | None = None


_TRACING = _Tracing()
_HOOKED = threading.Lock()


def _on_compile_start(args: Any) -> None:
    if _TRACING.depth and _TRACING.saved is None:
        import torch

        config = torch._dynamo.config
        _TRACING.saved = {k: getattr(config, k) for k in DYNAMO_CONFIG}
        for k, v in DYNAMO_CONFIG.items():
            setattr(config, k, v)


def _on_compile_end(args: Any) -> None:
    saved = _TRACING.saved
    if saved is not None:
        import torch

        _TRACING.saved = None
        for k, v in saved.items():
            setattr(torch._dynamo.config, k, v)


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


@attrs.frozen
class _Slot:
    """Where one placeholder of Dynamo's graph takes its value from at a call: a tensor argument of
    the runner (``"tensor"``: batched, or passed as it is and matched), a dimension of one (``"size"``:
    ``dim`` of argument ``name``), an argument of the runner passed through as a constant
    (``"value"``), or Dynamo's own argument of the call, not the runner's: the model's state
    (``"state"``: parameters, buffers; their addresses checked by ``TracedGraph.moved``) and ints the
    graph only returns arithmetic of (``"call"``)."""

    kind: str
    name: str
    dim: int = -1


def _symbol(size: Any) -> Any:
    """The sympy symbol a dynamic size is (None: a plain int, or an expression of symbols)."""
    import torch

    if isinstance(size, torch.SymInt):
        expr = size.node.expr
        return expr if getattr(expr, "is_Symbol", False) else None
    return None


def _is_symbolic(size: Any) -> bool:
    import torch

    return isinstance(size, torch.SymInt) and not getattr(size.node.expr, "is_Integer", False)


def _argument_name(node: Any) -> str:
    """The compiled function's argument a user input comes from (``x`` for ``L['x']``)."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    while source is not None and getattr(source, "base", None) is not None:
        source = source.base
    return str(getattr(source, "local_name", ""))


def _source_name(node: Any) -> str:
    """Where Dynamo found a placeholder's value (``L['self']._buffers['steps']``), else its name."""
    name = getattr(getattr(node.meta.get("grapharg"), "source", None), "name", None)
    return name if isinstance(name, str) else node.name


def _feeds_tensors(node: Any) -> bool:
    """Whether any tensor the graph computes depends on placeholder ``node``."""
    import torch

    seen: set[Any] = set()
    todo = list(node.users)
    while todo:
        n = todo.pop()
        if n in seen or n.op == "output":
            continue
        seen.add(n)
        if isinstance(n.meta.get("example_value"), torch.Tensor):
            return True
        todo.extend(n.users)
    return False


def _from_user(node: Any) -> bool:
    """A placeholder the user passed (an argument of the compiled function, or inside one), not state
    Dynamo lifted from a module (parameters, buffers, attributes) or from a global."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    if source is None:
        return False
    while True:
        kind = type(source).__name__
        if "NNModule" in kind or "ParamBuffer" in kind or "Global" in kind:
            return False
        base = getattr(source, "base", None)
        if base is None:
            return kind == "LocalSource" and bool(getattr(source, "is_input", False))
        source = base


class Unservable(Exception):
    """A Dynamo graph devgraph cannot serve from graphs: it runs as traced, eagerly."""

    def __init__(self, category: str, detail: str) -> None:
        super().__init__(detail)
        self.category, self.detail = category, detail


class TracedGraph:
    """One FX graph from Dynamo as a function of named tensors (what a ``GraphRunner`` serves).

    Its arguments are the graph's tensors and the values it takes that are not sizes of them; the
    sizes are derived from the tensors at every run. It returns the graph's tensor outputs; the
    sizes the graph returns are computed by ``sizes_out`` from the call's own tensors.
    """

    def __init__(
        self, gm: Any, example_inputs: Sequence[Any], user_dims: dict[str, int] | None = None
    ) -> None:
        import torch

        self.gm = gm
        #: the batch dim of the compiled function's arguments by name (default 0)
        self.user_dims = user_dims or {}
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(example_inputs):
            raise Unservable("unsupported_graph", "Dynamo's graph and its example inputs disagree")
        fakes = [n.meta.get("example_value") for n in placeholders]
        for node in placeholders:
            source = getattr(node.meta.get("grapharg"), "source", None)
            if type(source).__name__ == "RandomValueSource":
                raise Unservable("python_random", PYTHON_RANDOM)
            if getattr(node.meta.get("grapharg"), "pass_arg_as_tensor", False):
                raise Unservable(
                    "python_scalar",
                    f"Dynamo passes the Python number {node.name!r} the forward reads into the graph as a "
                    "tensor read on the host (.item()): a replay would freeze it. devgraph.wrap(model, "
                    "frontend='dynamo') traces numbers as guarded constants (or set "
                    "torch._dynamo.config.specialize_float = True)",
                )
        self.batch_symbols = self._batch_symbols(placeholders, fakes)
        self.slots: list[_Slot] = []
        self.batch_dims: dict[str, int] = {}
        self.static: list[str] = []
        self.fixed_batch: int | None = None
        where: dict[Any, tuple[str, int]] = {}  # symbol -> (argument, dim) that carries it
        for node, fake, example in zip(placeholders, fakes, example_inputs):
            if isinstance(example, torch.Tensor):
                dims = self._dims_of(node.name, fake, where)
                if dims is not None:
                    self.slots.append(_Slot("tensor", node.name))
                    self.batch_dims[node.name] = dims
                elif _from_user(node):
                    self.slots.append(_Slot("tensor", node.name))
                    self.static.append(node.name)  # an argument passed as it is: matched every call
                else:
                    # The model's own state (parameters, buffers) or a global's: Dynamo's guards check
                    # its shape, strides and dtype at every call; its address is checked by ``moved``.
                    self.slots.append(_Slot("state", node.name))
            else:
                self.slots.append(_Slot("value", node.name))
        self.values: dict[Any, int] = {}  # symbol -> index of the placeholder that is that value
        for i, (node, fake) in enumerate(zip(placeholders, fakes)):
            symbol = _symbol(fake)
            if self.slots[i].kind != "value" or symbol is None:
                continue
            if symbol in where:
                self.slots[i] = _Slot("size", *where[symbol])
            else:
                self.values[symbol] = i
                if not _feeds_tensors(node):
                    # An int the graph only does arithmetic on for its outputs (a counter, a length):
                    # taken from each call, not frozen, not matched.
                    self.slots[i] = _Slot("call", node.name)
        if not self.batch_symbols:  # specialised to one size: the user inputs' first dim, exactly
            self._static_batch(placeholders, example_inputs)
        self.arguments = [s.name for s in self.slots if s.kind in ("tensor", "value")]
        #: Dynamo's arguments of the call being served (the "call" slots are read from it)
        self.current: Sequence[Any] = ()
        #: run node by node, each op under its FX node's meta (a bisect names the user's line)
        self.interpret = False
        self.where = where
        self.outputs = self._outputs()
        self._only_tensors = all(kind == "tensor" for kind, _ in self.outputs)
        #: positions of the model-state placeholders, their names, and their addresses as captured
        self.state_positions = [i for i, slot in enumerate(self.slots) if slot.kind == "state"]
        self._state_names = [_source_name(placeholders[i]) for i in self.state_positions]
        self.state_addresses: list[int] | None = None
        #: buffers and caches the graph may write in place (parameters are not written by a forward),
        #: named by Dynamo's source (``L['self']._buffers['steps']``): the capture loop restores them
        #: after its runs, so they advance once per call. Rebound when they move (``moved``).
        self.state: dict[str, Any] = {}
        self._bind_state(example_inputs)

    # -- reading the graph -------------------------------------------------------------------------

    def _user_dim(self, node: Any, fake: Any) -> int | None:
        """The batch dim of a user input (``user_dims`` by argument name, else 0); None: not a user
        input, or a tensor without that dim."""
        if not _from_user(node) or not fake.dim():
            return None
        d = self.user_dims.get(_argument_name(node), 0)
        return d if d < fake.dim() else None

    def _batch_symbols(self, placeholders: list[Any], fakes: list[Any]) -> frozenset[Any]:
        """The symbols that are a batch size: each user input's batch dimension (``user_dims``, else
        the first), where Dynamo made it dynamic. Two inputs may carry two symbols (nothing in the
        forward tied them): both are padded to the bucket; a call whose two sizes differ runs eagerly
        (counted)."""
        import torch

        found = set()
        for node, fake in zip(placeholders, fakes):
            if isinstance(fake, torch.Tensor):
                d = self._user_dim(node, fake)
                symbol = _symbol(fake.shape[d]) if d is not None else None
                if symbol is not None:
                    found.add(symbol)
        return frozenset(found)

    def _dims_of(self, name: str, fake: Any, where: dict[Any, tuple[str, int]]) -> int | None:
        """The batch dim of tensor ``name`` (None: not batched); notes where each symbol is."""
        batch_dim = None
        for d, size in enumerate(getattr(fake, "shape", ())):
            symbol = _symbol(size)
            if symbol is not None:
                where.setdefault(symbol, (name, d))
            if not self.batch_symbols:
                continue
            if symbol in self.batch_symbols:
                if batch_dim is not None:
                    raise Unservable(
                        "batch_in_two_dims",
                        f"graph input {name!r} has the batch size in two dimensions ({tuple(fake.shape)}): "
                        "padding it to a bucket is not defined",
                    )
                batch_dim = d
            elif _is_symbolic(size) and self.batch_symbols & size.node.expr.free_symbols:
                raise Unservable(
                    "batch_in_expression",
                    f"graph input {name!r} has a dimension {size} computed from the batch size: padding it to a "
                    "bucket is not defined; pass a tensor whose dimension is the batch size itself",
                )
        return batch_dim

    def _static_batch(self, placeholders: list[Any], example_inputs: Sequence[Any]) -> None:
        import torch

        for node, example in zip(placeholders, example_inputs):
            if isinstance(example, torch.Tensor):
                d = self._user_dim(node, example)
                if d is not None:
                    self.batch_dims[node.name] = d
                    self.static.remove(node.name)
        rows = {
            example_inputs[i].shape[self.batch_dims[n.name]]
            for i, n in enumerate(placeholders)
            if n.name in self.batch_dims
        }
        if len(rows) != 1:
            raise Unservable(
                "unsupported_graph",
                "Dynamo specialised this graph to fixed sizes and its inputs disagree on the batch size",
            )
        self.fixed_batch = rows.pop()

    def _outputs(self) -> list[tuple[str, Any]]:
        """Per output of the graph: ``("tensor", batch dim or None)``, ``("size", expr)`` or
        ``("value", value)``."""
        import torch

        (output,) = [n for n in self.gm.graph.nodes if n.op == "output"]
        values = output.args[0]
        if not isinstance(values, (tuple, list)):
            raise Unservable("unsupported_graph", "Dynamo's graph returns a single value, not a tuple")
        kinds: list[tuple[str, Any]] = []
        for value in values:
            example = value.meta.get("example_value") if hasattr(value, "meta") else value
            if isinstance(example, torch.Tensor):
                # the dim that is the batch, marked dynamic on the served output: code after a graph
                # break that reads it is traced for any batch size, not specialised to the first call's
                dims = [d for d, size in enumerate(example.shape) if _symbol(size) in self.batch_symbols]
                kinds.append(("tensor", dims[0] if len(dims) == 1 else None))
            elif _is_symbolic(example):
                expr = example.node.expr
                if not expr.free_symbols <= set(self.where) | set(self.values):
                    raise Unservable(
                        "unsupported_graph",
                        f"the graph returns the size {expr}, which its inputs' sizes do not determine",
                    )
                kinds.append(("size", expr))
            elif hasattr(value, "meta"):
                raise Unservable(
                    "unsupported_graph",
                    f"the graph returns a {type(example).__name__} it computes; a replay would freeze it",
                )
            else:
                kinds.append(("value", value))
        return kinds

    # -- running it ----------------------------------------------------------------------------------

    def run(self, *args: Any) -> tuple[Any, ...]:
        """The graph over the runner's arguments (sizes derived): its tensor outputs."""
        named = dict(zip(self.arguments, args))
        call = self.current
        full = []
        for i, s in enumerate(self.slots):
            if s.kind == "size":
                full.append(named[s.name].shape[s.dim])
            elif s.kind in ("call", "state"):
                full.append(call[i])
            else:
                full.append(named[s.name])
        if self.interpret:
            import torch.fx
            from torch.fx import traceback as fx_traceback

            with fx_traceback.preserve_node_meta():
                out = torch.fx.Interpreter(self.gm).run(*full)
        else:
            out = self.gm(*full)
        return tuple(v for (kind, _), v in zip(self.outputs, out) if kind == "tensor")

    def split(self, args: Sequence[Any]) -> list[Any]:
        """Dynamo's arguments (every placeholder) -> the runner's (sizes dropped)."""
        return [a for s, a in zip(self.slots, args) if s.kind in ("tensor", "value")]

    def moved(self, args: Sequence[Any]) -> list[str]:
        """The model-state tensors of this call (Dynamo's ``args``) whose address is not the captured
        one (a weight replaced, a buffer rebound), by name; rebinds the capture loop's view of them.
        The first call binds them."""
        addresses = [args[i].data_ptr() for i in self.state_positions]
        if addresses == self.state_addresses:
            return []
        before, self.state_addresses = self.state_addresses, addresses
        self._bind_state(args)
        if before is None:
            return []
        return [n for n, a, b in zip(self._state_names, addresses, before) if a != b]

    def _bind_state(self, args: Sequence[Any]) -> None:
        import torch

        self.state.clear()
        for name, i in zip(self._state_names, self.state_positions):
            if not isinstance(args[i], torch.nn.Parameter):
                self.state[name] = args[i]

    def assemble(self, args: Sequence[Any], tensors: Sequence[Any]) -> tuple[Any, ...]:
        """The graph's outputs: the served tensors, and each size it returns computed from the call's
        own ``args`` (Dynamo's, every placeholder), never from the bucket's."""
        import torch

        if self._only_tensors:  # the usual graph: nothing to compute, only the batch dims to mark
            for tensor, (_, dim) in zip(tensors, self.outputs):
                if dim is not None:
                    torch._dynamo.maybe_mark_dynamic(tensor, dim)
            return tuple(tensors)
        sizes = self._sizes(args)
        it = iter(tensors)
        out: list[Any] = []
        for kind, what in self.outputs:
            if kind == "tensor":
                tensor = next(it)
                if what is not None:
                    torch._dynamo.maybe_mark_dynamic(tensor, what)
                out.append(tensor)
            elif kind == "size":
                out.append(int(what.xreplace(sizes)))
            else:
                out.append(what)
        return tuple(out)

    def _sizes(self, args: Sequence[Any]) -> dict[Any, Any]:
        """The value of each size symbol in the call Dynamo made (``args``: every placeholder)."""
        import sympy

        named = dict(zip(self.arguments, self.split(args)))
        sizes = {
            symbol: sympy.Integer(int(named[name].shape[dim])) for symbol, (name, dim) in self.where.items()
        }
        sizes.update((symbol, sympy.Integer(int(args[i]))) for symbol, i in self.values.items())
        return sizes


def _run(graph: TracedGraph, state: dict[str, Any], *args: Any) -> Any:
    return graph.run(*args)


def _graph_function(graph: TracedGraph) -> Callable[..., Any]:
    """``graph.run`` as the function a ``GraphRunner`` serves: its signature names the runner's
    arguments, and it holds the graph's state tensors (buffers, caches) among its bound arguments,
    where the capture loop's snapshot finds them and puts them back after the capture's runs."""
    fn = functools.partial(_run, graph, graph.state)
    params = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in graph.arguments]
    fn.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    return fn


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
    graphs: int = 0
    unservable: dict[str, int] = attrs.field(factory=dict)
    captured_sizes: tuple[int, ...] = ()


class DynamoGraphs:
    """The graphs of one ``torch.compile(backend="devgraph")``: a runner per graph Dynamo handed over.

    The backend of ``torch.compile`` is this object (``compile_graph`` makes one per call); a
    ``devgraph.wrap(..., frontend="dynamo")`` holds one and reads its ``stats``.
    """

    def __init__(self, device: Any, config: Any, batch_dims: dict[str, int] | None = None) -> None:
        self.device = device
        self.config = config
        #: the batch dim of the compiled function's arguments by name (default 0)
        self.batch_dims = dict(batch_dims or {})
        #: a graph drew Python random numbers (``PYTHON_RANDOM``); a wrapper that can run the model
        #: eagerly instead sets ``eager_on_python_random`` (else the backend raises)
        self.python_random = False
        self.eager_on_python_random = False
        self.runners: list[Any] = []
        self._unservable: dict[str, int] = {}
        self._eager_calls = 0
        self._recaptures = 0
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        #: calls of any graph's callable, served or eager (a wrapper tells a call Dynamo ran by itself)
        self.served = 0
        #: while ``recording``: (graph, runner, the runner's arguments, its outputs) per graph a call
        #: replayed, in call order (what a bisect of the call looks at)
        self._log: list[Served] | None = None

    def __call__(self, gm: Any, example_inputs: Sequence[Any], **kwargs: Any) -> Callable[..., Any]:
        """Dynamo's backend: the callable that serves graph ``gm`` (see the module docstring)."""
        from devgraph.runner import GraphRunner

        try:
            graph = TracedGraph(gm, example_inputs, self.batch_dims)
        except Unservable as why:
            return self._as_traced(gm, why)
        config = attrs.evolve(self.config, batch_dims=graph.batch_dims, static_args=graph.static)
        if graph.fixed_batch is not None:  # Dynamo specialised the graph to this size: capture it alone
            config = attrs.evolve(config, batch_sizes=[graph.fixed_batch], max_batch_size=None)
        runner = GraphRunner(_graph_function(graph), self.device, config)
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
                self._note_moved(moved)
            arguments = graph.split(args)
            log, replays = self._log, runner.stats.replays
            if log is not None:  # clone what a later replay overwrites: the call's batched tensors
                batched = set(graph.batch_dims)
                kept = [a.clone() if n in batched else a for n, a in zip(graph.arguments, arguments)]
            out = runner(*arguments)
            if log is not None and runner.stats.replays != replays:
                log.append(Served(graph, runner, kept, [t.clone() for t in out]))
            return graph.assemble(args, out)

        return serve

    def _note_moved(self, names: list[str]) -> None:
        self._recaptures += 1
        if "moved" not in self._warned:
            self._warned.add("moved")
            logger.warning(
                "devgraph: %s moved since a Dynamo graph was captured (a weight or buffer replaced): its "
                "graphs are captured again (counted in stats.recaptures; once per replacement)",
                ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else ""),
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
        forward = gm.forward
        owner = weakref.ref(self)

        def eager(*args: Any) -> Any:
            me = owner()
            if me is not None:
                me._eager_calls += 1
                me.served += 1
            return forward(*args)

        return eager

    @property
    def stats(self) -> DynamoStats:
        """Every graph's counters added up (a new object each time: read it again for new counts)."""
        total = DynamoStats(graphs=len(self.runners) + sum(self._unservable.values()))
        total.unservable = dict(self._unservable)
        total.eager_calls = self._eager_calls
        total.recaptures = self._recaptures
        sizes: set[int] = set()
        for runner in self.runners:
            s = runner.stats
            total.replays += s.replays
            total.eager_calls += s.eager_calls
            total.capture_seconds += s.capture_seconds
            total.pool_bytes += s.pool_bytes
            total.recaptures += s.recaptures
            for reason, n in s.fallbacks.items():
                total.fallbacks[reason] = total.fallbacks.get(reason, 0) + n
            sizes.update(s.captured_sizes)
        total.captured_sizes = tuple(sorted(sizes))
        return total

    def reset(self) -> None:
        """Drop every graph's captures (the next call of each captures again)."""
        for runner in self.runners:
            runner.reset()


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
    from devgraph._plugins import device as find_device
    from devgraph.graph import Device
    from devgraph.runner import RunnerConfig, make_config

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
    config = make_config(RunnerConfig, options, extra_valid=(), what=" for torch.compile(backend='devgraph')")
    if config.mode != "full":
        raise DevgraphError(
            f"torch.compile(backend='devgraph') captures each graph Dynamo hands it whole (mode='full'); "
            f"mode={config.mode!r} is served by devgraph.wrap(model, mode={config.mode!r}) without Dynamo"
        )
    dev = device if isinstance(device, Device) else find_device(device)
    return DynamoGraphs(dev, config)


class TracedModule:
    """What ``devgraph.wrap(model, frontend="dynamo")`` returns: ``model`` compiled by Dynamo with
    devgraph as its backend, every tensor argument's batch dimension marked dynamic.

    Callable like the model. ``stats`` adds up every graph Dynamo handed over (``DynamoStats``),
    with ``eager_calls`` also counting the calls Dynamo ran without any graph (its recompile limit
    reached: one warning names the guard that kept failing). ``module`` is the model;
    ``compiled`` the ``torch.compile``'d model; ``reset()`` drops every capture.
    """

    def __init__(self, module: Any, graphs: DynamoGraphs, batch_dims: dict[str, int]) -> None:
        import torch

        self.module = module
        self.graphs = graphs
        self._batch_dims = batch_dims
        from devgraph.runner import Accounts, RunnerStats

        self.compiled = torch.compile(module, backend=graphs)
        graphs.eager_on_python_random = True
        #: the calls no graph served at all (Dynamo ran them as Python, or devgraph ran the model)
        self._accounts = Accounts(graphs.config, RunnerStats(), threading.RLock(), "through Dynamo")
        #: the forward's positional parameter names (a positional argument's ``batch_dims`` key)
        self._positional = _positional_names(module)

    @property
    def device(self) -> Any:
        return self.graphs.device

    @property
    def stats(self) -> DynamoStats:
        total = self.graphs.stats
        mine = self._accounts.stats
        total.eager_calls += mine.eager_calls
        for reason, n in mine.fallbacks.items():
            total.fallbacks[reason] = total.fallbacks.get(reason, 0) + n
        return total

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import torch

        mark = torch._dynamo.maybe_mark_dynamic
        positional = self._positional
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor) and a.dim():
                mark(a, self._batch_dims.get(positional[i] if i < len(positional) else "", 0))
        for name, a in kwargs.items():
            if isinstance(a, torch.Tensor) and a.dim():
                mark(a, self._batch_dims.get(name, 0))
        if self.graphs.python_random:  # Dynamo would replay a Python random draw wrongly: eager
            self._accounts.note_fallback("python_random", PYTHON_RANDOM)
            return self.module(*args, **kwargs)
        before = self.graphs.served
        _hook_compiles()
        _TRACING.depth += 1
        try:
            out = self.compiled(*args, **kwargs)
        finally:
            _TRACING.depth -= 1
        if self.graphs.served == before:
            self._note_untraced()
        return out

    def _note_untraced(self) -> None:
        """A call no graph of devgraph's served: Dynamo ran it as Python (past its recompile limit,
        or a frame it skips)."""
        self._accounts.note_fallback("dynamo_untraced", _untraced_message(self.module))

    def reset(self) -> None:
        """Drop every capture; Dynamo's traces stay (the next call of each graph captures again)."""
        self.graphs.reset()

    def __repr__(self) -> str:
        return f"<devgraph TracedModule {type(self.module).__name__} on {self.device}>"


def _untraced_message(module: Any) -> str:
    import torch

    reasons: list[str] = []
    failures = getattr(torch._dynamo.eval_frame, "guard_failures", {})
    for code, found in list(failures.items())[-3:]:
        if found:
            reasons.append(f"{getattr(code, 'co_name', code)}: {found[-1]}")
    why = f" (the guard that kept failing: {'; '.join(reasons)})" if reasons else ""
    return (
        f"a call of {type(module).__name__} ran without graphs: Dynamo ran it as Python, past its recompile "
        f"limit or in a frame it skips{why}; a value that changes every call and is read by the forward "
        "makes Dynamo trace again each time"
    )


def _positional_names(model: Any) -> tuple[str, ...]:
    from devgraph.runner import signature_of

    try:
        params = signature_of(model).parameters.values()
    except (TypeError, ValueError):
        return ()
    return tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def wrap_traced(model: Any, device: Any, options: dict[str, Any]) -> TracedModule:
    """``devgraph.wrap(model, device, frontend="dynamo", **options)`` (see ``TracedModule``).

    Raises:
        DevgraphError: ``batch_dims`` naming an argument the forward does not take, or a dim that is
            not an int >= 0; what ``backend_for`` raises.
    """
    from devgraph.runner import RunnerConfig

    options = dict(options)
    batch_dims = dict(RunnerConfig(batch_dims=options.pop("batch_dims", None) or {}).batch_dims)
    graphs = backend_for({**options, "device": device})
    graphs.batch_dims = batch_dims
    try:
        from devgraph.runner import signature_of

        taken = set(signature_of(model).parameters)
    except (TypeError, ValueError):
        taken = set(batch_dims)
    unknown = sorted(set(batch_dims) - taken)
    if unknown:
        raise DevgraphError(
            f"batch_dims names {unknown}, which {type(model).__name__}'s forward does not take; it takes "
            f"{sorted(taken)}"
        )
    bad = {k: v for k, v in batch_dims.items() if not isinstance(v, int) or isinstance(v, bool) or v < 0}
    if bad:
        raise DevgraphError(f"batch_dims must map argument names to dims (ints >= 0), got {bad}")
    return TracedModule(model, graphs, batch_dims)
