"""One FX graph from Dynamo, read for devgraph: what ``devgraph.frontend._dynamo``'s backend serves.

``TracedGraph`` reads a graph Dynamo hands over, from the graph itself, not from guesses:

* **the batch.** The size symbols at the batch dimension of the user's inputs (the compiled function's
  arguments: dim 0, or ``batch_dims``), where Dynamo made it dynamic (``devgraph.wrap(...,
  frontend="dynamo")`` marks it so; Dynamo's automatic dynamic does after a second size). Every tensor
  whose shape holds such a symbol is batched along that dimension. A graph whose shapes hold none was
  specialised to one size by Dynamo: it is captured at that size only.
* **what is passed as it is.** A user's tensor without the batch is an argument of the runner,
  matched at every call; the model's own state (parameters, buffers, a global's tensors) is not: Dynamo's
  guards check its shape, strides and dtype, ``TracedGraph.moved`` its address.
* **sizes.** Dynamo passes a graph the sizes it computes with (``s0``): each is derived from the
  tensor dimension it names, so the padded bucket's graph computes at the bucket's size, and a size the
  graph returns is computed from the call's own sizes, never the bucket's.
* **state written in place.** A buffer the graph writes (``self.count.add_(1)``) is held where the
  capture loop restores it after its runs, so it advances once per call, as eagerly.

A graph devgraph cannot serve raises ``Unservable`` (a Python number passed as a tensor read with
``.item()``, a Python random draw, the batch inside an expression of a shape or in two dimensions, a
returned value its inputs' sizes do not determine).
"""

from __future__ import annotations

import linecache
import operator
import re
import weakref
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from devgraph._source import set_generated_meta
from devgraph.runner import tensor_version

__all__ = ["PYTHON_RANDOM", "TracedGraph", "Unservable", "node_meta_at"]

#: Dynamo's graphs devgraph was handed: where a bisect of pieces, which run a graph's generated code
#: (``<eval_with_key>.N``) traced once more, finds the node (and the user's line) of an op
_GRAPHS: weakref.WeakSet[Any] = weakref.WeakSet()


def _code_file(gm: Any) -> str:
    """The file name of ``gm``'s generated code (a lazy graph module's once it ran)."""
    code = getattr(getattr(type(gm), "forward", None), "__code__", None)
    return str(getattr(code, "co_filename", ""))


def node_meta_at(filename: str, line: int) -> dict[str, Any] | None:
    """The meta of the node of a Dynamo graph that line ``line`` of its generated code (``filename``,
    ``<eval_with_key>.N``) computes (``name = op(...)``), or None where no such graph or node is known."""
    gm = next((g for g in list(_GRAPHS) if _code_file(g) == filename), None)
    if gm is None:
        return None
    match = re.match(r"\s*(\w+)\s*=", linecache.getline(filename, line))
    if match is None:
        return None
    node = next((n for n in gm.graph.nodes if n.name == match.group(1)), None)
    return None if node is None else dict(node.meta)


# errors raised while a graph's generated code runs (a capture refused) name the user's line of the op
set_generated_meta(node_meta_at)

PYTHON_RANDOM = (
    "the forward draws Python random numbers (random.random(), a random.Random's methods): Dynamo draws "
    "them before each call of its graph, and for a random.Random instance it repeats the first call's "
    "draw on every later call (torch 2.13; the global random module's draws are right), a wrong value "
    "devgraph cannot see. Every call after the first runs the model eagerly. Draw with torch's "
    "generators on tensors instead, or pass the number in as a tensor"
)


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
    if isinstance(size, torch.SymInt):
        expr = size.node.expr
        return expr if getattr(expr, "is_Symbol", False) else None
    return None


def _is_symbolic(size: Any) -> bool:
    return isinstance(size, torch.SymInt) and not getattr(size.node.expr, "is_Integer", False)


def _argument_name(node: Any, var_keyword: str | None = None) -> str:
    """The compiled function's argument a user input comes from (``x`` for ``L['x']``; ``bias`` for
    ``L['kwargs']['bias']`` where ``kwargs`` is the forward's ``**`` parameter, ``var_keyword``)."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    below = None
    while source is not None and getattr(source, "base", None) is not None:
        source, below = source.base, source
    name = str(getattr(source, "local_name", ""))
    if var_keyword is not None and name == var_keyword and isinstance(getattr(below, "index", None), str):
        return str(below.index)  # type: ignore[union-attr]
    return name


def _source_name(node: Any) -> str:
    """Where Dynamo found a placeholder's value, as a module path (``layers.0.k_cache`` for Dynamo's
    ``L['self']._modules['layers']._modules['0']._buffers['k_cache']``), else its name."""
    name = getattr(getattr(node.meta.get("grapharg"), "source", None), "name", None)
    if not isinstance(name, str):
        return node.name
    path = re.sub(r"\._(?:modules|buffers|parameters)\['([^']*)'\]", r".\1", name)
    return re.sub(r"^L\['self'\]\.?", "", path) or name


def _feeds_tensors(node: Any) -> bool:
    """Whether any tensor the graph computes depends on placeholder ``node``."""
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


#: Python operators Dynamo records for in-place writes (``x += 1``, ``x[i] = v``)
_INPLACE_OPERATORS = {
    operator.iadd,
    operator.isub,
    operator.imul,
    operator.itruediv,
    operator.ifloordiv,
    operator.imod,
    operator.ipow,
    operator.iand,
    operator.ior,
    operator.ixor,
    operator.ilshift,
    operator.irshift,
    operator.imatmul,
    operator.setitem,
}
#: Tensor methods and functions whose result is a view of their first argument (writing it writes that)
_VIEW_NAMES = {
    "view", "view_as", "reshape", "reshape_as", "narrow", "select", "t", "transpose", "permute", "expand",
    "expand_as", "unsqueeze", "squeeze", "flatten", "unflatten", "diagonal", "as_strided", "unbind", "split",
    "chunk", "detach", "movedim", "swapaxes", "swapdims", "mT", "T", "real", "imag", "unfold", "__getitem__",
    "getitem", "contiguous", "_get_data_attr",
}  # fmt: skip


#: Calls Dynamo puts in a graph but cannot trace when it traces that graph again (pieces)
_NOT_RETRACEABLE = {"_get_data_attr"}


def _name(target: Any) -> str:
    return target if isinstance(target, str) else getattr(target, "__name__", "")


def _bases_of(value: Any, bases: dict[Any, set[str]]) -> set[str]:
    """The placeholders the nodes in ``value`` (a node, or lists, tuples and dicts of them) alias."""
    import torch.fx

    found: set[str] = set()

    def note(node: Any) -> Any:
        found.update(bases.get(node, ()))
        return node

    torch.fx.node.map_arg(value, note)
    return found


def written_placeholders(gm: Any) -> set[str]:
    """The placeholders of ``gm`` its graph writes in place, directly or through a view: an in-place
    method (``add_``, ``copy_``), an in-place operator (``+=``, ``x[i] = v``), ``inplace=True`` or
    ``out=``. Read from the graph, not guessed: the tensors devgraph must put back after the capture's
    runs (``TracedGraph.state``)."""
    bases: dict[Any, set[str]] = {}
    written: set[str] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            bases[node] = {node.name}
            continue
        if node.op not in ("call_method", "call_function") or not node.args:
            continue
        first = node.args[0]
        name = _name(node.target)
        inplace = (
            node.target in _INPLACE_OPERATORS
            or (name.endswith("_") and not name.endswith("__"))
            or node.kwargs.get("inplace") is True
        )
        schema = getattr(node.target, "_schema", None)  # an op overload (a custom op's mutates_args)
        if schema is not None:
            for i, arg in enumerate(schema.arguments):
                if arg.alias_info is not None and arg.alias_info.is_write:
                    value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
                    written |= _bases_of(value, bases)
        if inplace:  # the first argument, or each tensor of a list (torch._foreach_add_)
            written |= _bases_of(first, bases)
        written |= _bases_of(node.kwargs.get("out"), bases)
        if inplace or name in _VIEW_NAMES:  # the result aliases the first argument
            if first in bases:
                bases[node] = bases[first]
    return written


class Unservable(Exception):
    """A Dynamo graph devgraph cannot serve from graphs: it runs as traced, eagerly."""

    def __init__(self, category: str, detail: str) -> None:
        super().__init__(detail)
        self.category, self.detail = category, detail


class TracedGraph:
    """One FX graph from Dynamo as a function of named tensors (what a ``GraphRunner`` serves).

    Its arguments are the graph's tensors and the values it takes that are not sizes of them; the
    sizes are derived from the tensors at every run. It returns the graph's tensor outputs; the
    sizes the graph returns are computed by ``assemble`` from the call's own tensors.
    """

    def __init__(
        self,
        gm: Any,
        example_inputs: Sequence[Any],
        user_dims: dict[str, int] | None = None,
        unbatched: frozenset[str] = frozenset(),
        var_keyword: str | None = None,
    ) -> None:
        self.gm = gm
        _GRAPHS.add(gm)
        #: the batch dim of the compiled function's arguments by name (default 0)
        self.user_dims = user_dims or {}
        #: the compiled function's arguments that are never batched (``static_args``): passed as they are
        self.unbatched = unbatched
        #: the name of the forward's ``**kwargs`` parameter: an argument passed through it is named by its key
        self.var_keyword = var_keyword
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
        self._state_index = {s.name: i for i, s in enumerate(self.slots) if s.kind == "state"}
        #: the runner's batched arguments that are a user's argument itself (``x``), by that name: where
        #: the user's ``pad_values`` apply
        self.user_names = {
            n.name: _argument_name(n, var_keyword)
            for n in placeholders
            if n.name in self.batch_dims
            and type(getattr(n.meta.get("grapharg"), "source", None)).__name__ == "LocalSource"
        }
        #: Dynamo's arguments of the call being served (the "call" slots are read from it)
        self.current: Sequence[Any] = ()
        #: run node by node, each op under its FX node's meta (a bisect names the user's line)
        self.interpret = False
        self.where = where
        #: a call in the graph Dynamo cannot trace again (``.data``: ``_get_data_attr``), so its pieces
        #: cannot be made from it; None where there is none
        self.untraceable = next(
            (_name(n.target) for n in gm.graph.nodes if _name(n.target) in _NOT_RETRACEABLE), None
        )
        self.outputs = self._outputs()
        self._only_tensors = all(kind == "tensor" for kind, _ in self.outputs)
        #: positions of the model-state placeholders, their names, and their addresses as captured
        self.state_positions = [i for i, slot in enumerate(self.slots) if slot.kind == "state"]
        self._state_names = [_source_name(placeholders[i]) for i in self.state_positions]
        self.state_addresses: list[int] | None = None
        #: the model-state tensors the graph writes in place (``written_placeholders``: a step
        #: counter, a cache, a parameter's moving average), by module path: the capture loop restores
        #: them after its runs, so they advance once per call. Rebound when they move (``moved``).
        written = written_placeholders(gm)
        self._written = [placeholders[i].name in written for i in self.state_positions]
        self.state: dict[str, Any] = {}
        self._bind_state(example_inputs)

    # -- reading the graph -------------------------------------------------------------------------

    def _user_dim(self, node: Any, fake: Any) -> int | None:
        """The batch dim of a user input (``user_dims`` by argument name, else 0); None: not a user
        input, or a tensor without that dim."""
        name = _argument_name(node, self.var_keyword)
        if not _from_user(node) or not fake.dim() or name in self.unbatched:
            return None
        d = self.user_dims.get(name, 0)
        return d if d < fake.dim() else None

    def _batch_symbols(self, placeholders: list[Any], fakes: list[Any]) -> frozenset[Any]:
        """The symbols that are a batch size: each user input's batch dimension (``user_dims``, else
        the first), where Dynamo made it dynamic. Two inputs may carry two symbols (nothing in the
        forward tied them): both are padded to the bucket; a call whose two sizes differ runs eagerly
        (counted)."""
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
                # a dim of a runner argument, or of the model's state (a dim Dynamo made dynamic after
                # seeing two shapes of it: a KV cache another wrapper of the same class allocated)
                source = named[s.name] if s.name in named else call[self._state_index[s.name]]
                full.append(source.shape[s.dim])
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
        self.state.clear()
        for name, i, written in zip(self._state_names, self.state_positions, self._written):
            if written:
                self.state[name] = args[i]

    def parameters(self) -> list[torch.Tensor]:
        """The model's parameters among the graph's state, as of the call being served."""
        call = self.current
        return [call[i] for i in self.state_positions if isinstance(call[i], torch.nn.Parameter)]

    def unwritten_versions(self, args: Sequence[Any]) -> list[int | None]:
        """The version counters of the model-state tensors the graph does not write (``state``
        holds those it does): a capture that changed one wrote where the graph says it does not."""
        return [tensor_version(args[i]) for i, w in zip(self.state_positions, self._written) if not w]

    def changed_unwritten(self, args: Sequence[Any], before: list[int | None]) -> list[str]:
        """The names of the unwritten state tensors whose version moved since ``before``."""
        names = [n for n, w in zip(self._state_names, self._written) if not w]
        return [n for n, v, b in zip(names, self.unwritten_versions(args), before) if v != b]

    def assemble(self, args: Sequence[Any], tensors: Sequence[Any]) -> tuple[Any, ...]:
        """The graph's outputs: the served tensors, and each size it returns computed from the call's
        own ``args`` (Dynamo's, every placeholder), never from the bucket's."""
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
        named.update((name, args[i]) for name, i in self._state_index.items())  # a dim of the state
        sizes = {
            symbol: sympy.Integer(int(named[name].shape[dim])) for symbol, (name, dim) in self.where.items()
        }
        sizes.update((symbol, sympy.Integer(int(args[i]))) for symbol, i in self.values.items())
        return sizes
