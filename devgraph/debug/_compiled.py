"""Inside ``torch.compile``'d code: which op's compiled value first departs from eager.

A compiled graph's kernels are fused: the op-by-op probe sees one call (``COMPILED``, recorded whole,
as the capture records it) and no op inside it. When a bisect finds a compiled graph where the
difference starts, it descends:

1. **Trace.** The call runs once more with every ``torch.compile``'d function it reaches compiled by
   a backend that only keeps each graph Dynamo hands it and the graph's real inputs, then runs it
   eagerly (``torch.compiler.set_stance(force_backend=...)``): the graphs are the call's compiled
   regions, op by op, with the user's source line and module path of each op (``stack_trace``,
   ``nn_module_stack``); what the call runs eagerly stays out of them.
2. **Cut.** For a cut after op ``k`` the graph's prefix up to ``k``, with every value the rest of
   the graph still reads as an output, is compiled by inductor (the mode given) and run eagerly, both
   on copies of the graph's inputs (so each value is as it is at the cut, in-place writes included);
   ``P(k)``: some output differs between the two beyond the noise floor (the prefix run eagerly
   twice). ``P`` of the whole graph is true when its output differs.
3. **Bisect.** Binary search between a cut that agrees and one that differs, a handful of compiles:
   it ends at an op ``k`` where ``P`` turns true, the cut before it agreeing and the cut after it
   differing: a place where a difference *starts*. Inductor fuses each cut on its own, and a
   difference can die out (rounded back, or never read), so it is the first such place only for a
   difference that, once made, reaches the graph's later values (the usual case).

Each region is compiled afresh with the mode given (``BisectOptions.compile_mode``): give the mode
the code was compiled with. Nothing in torch is patched; the backend is an ordinary one.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import torch
import torch.fx

from devgraph.debug._compare import diff_tensors
from devgraph.debug._probe import COMPILED, meta_module, meta_source
from devgraph.debug._report import OpDifference

__all__ = ["COMPILED", "descend", "truly_eager"]

logger = logging.getLogger("devgraph.debug")


@contextlib.contextmanager
def truly_eager() -> Iterator[None]:
    """Run ``torch.compile``'d functions as their original code (``set_stance("force_eager")``): the
    eager side of a comparison must not run compiled code, or it compares compiled with compiled."""
    with torch.compiler.set_stance("force_eager"):
        yield


def _copies(inputs: Sequence[Any]) -> list[Any]:
    """A graph's inputs with every tensor but a parameter copied (a graph may write its inputs)."""
    return [
        x.detach().clone() if isinstance(x, torch.Tensor) and not isinstance(x, torch.nn.Parameter) else x
        for x in inputs
    ]


#: where the graph-keeping backend puts what it sees: set by trace_graphs for its call, per thread
#: and task (a bisect on another thread keeps its own)
_SINK: contextvars.ContextVar[list[tuple[Any, list[Any]]] | None] = contextvars.ContextVar(
    "devgraph_descent_sink", default=None
)


def _keeping_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    """A Dynamo backend that runs each graph eagerly and, while ``trace_graphs`` listens, keeps the
    graph and copies of its real inputs at every call. One backend for the process: Dynamo compiles a
    function for it once, not once per bisect (its recompile limit would end the descent)."""

    def run(*inputs: Any) -> Any:
        sink = _SINK.get()
        if sink is not None:
            sink.append((gm, _copies(inputs)))
        return gm.forward(*inputs)

    return run


def trace_graphs(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[tuple[Any, list[Any]]]:
    """Dynamo's graphs of the compiled code ``fn(*args, **kwargs)`` runs, one entry per call of a
    compiled graph in the order the call ran them (the probe's compiled records' order), each with
    copies of its real inputs; code the call runs eagerly is not in them."""
    graphs: list[tuple[Any, list[Any]]] = []
    token = _SINK.set(graphs)
    try:
        # Every torch.compile'd function the call reaches runs as compiled for the keeping backend
        # instead of its own (compiled once per function and shape; the call's own compiled code is
        # left as it is).
        with torch.no_grad(), torch.compiler.set_stance("default", force_backend=_keeping_backend):
            fn(*args, **kwargs)
    finally:
        _SINK.reset(token)
    return graphs


_COMPUTES = ("call_function", "call_method", "call_module")


def _op_name(node: torch.fx.Node) -> str:
    target = node.target
    if node.op == "call_method":
        return f"Tensor.{target}"
    if node.op == "call_module":
        return str(target)
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name + ("" if target._overloadname == "default" else "." + target._overloadname)
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__name__", str(target))
    if module.startswith("torch._C._nn") or module == "torch.nn.functional":
        return f"torch.nn.functional.{name}"
    if module.startswith("torch") and not module.startswith("torch._"):
        return f"{module}.{name}"
    if module in ("_operator", "operator"):
        return f"operator.{name}"
    return f"torch.{name}" if module.startswith("torch._C") else f"{module}.{name}".lstrip(".")


class _Cuts:
    """One Dynamo graph: its eager values, and inductor's value of any prefix of it."""

    def __init__(self, gm: torch.fx.GraphModule, inputs: list[Any], mode: str | None) -> None:
        self.gm, self.inputs, self.mode = gm, inputs, mode
        self.nodes = list(gm.graph.nodes)
        self.computing = [i for i, n in enumerate(self.nodes) if n.op in _COMPUTES]
        self.tensors = self._tensor_nodes()
        self.compiles = 0
        #: per cut: inductor's values, eager's values of the same prefix, eager's noise on each
        self._cuts: dict[int, tuple[dict[Any, Any], dict[Any, Any], dict[Any, float]]] = {}

    def _fresh_inputs(self) -> list[Any]:
        return _copies(self.inputs)

    def _tensor_nodes(self) -> set[torch.fx.Node]:
        interpreter = torch.fx.Interpreter(self.gm, garbage_collect_values=False)
        with torch.no_grad():
            interpreter.run(*self._fresh_inputs())
        return {n for n, v in interpreter.env.items() if isinstance(v, torch.Tensor)}

    def live(self, position: int) -> list[torch.fx.Node]:
        """The tensor values after op ``position`` (an index into ``nodes``) that the rest still reads."""
        kept = set(self.nodes[: position + 1])
        out = []
        for node in self.nodes[: position + 1]:
            if node not in self.tensors or node.op == "placeholder":
                continue
            if node is self.nodes[position] or any(u not in kept for u in node.users):
                out.append(node)
        return out

    def cut(self, position: int) -> tuple[dict[Any, Any], dict[Any, Any], dict[Any, float]]:
        """The prefix up to ``position`` with ``live(position)`` as its outputs: inductor's values, the
        same prefix's eager values (each value as it is at the cut, in-place writes before it
        included), and the difference of two eager runs per value (the noise floor). Each cut is
        built once: the search reads the one it found again."""
        if position not in self._cuts:
            self._cuts[position] = self._cut(position)
        return self._cuts[position]

    def _cut(self, position: int) -> tuple[dict[Any, Any], dict[Any, Any], dict[Any, float]]:
        outputs = self.live(position)
        if not outputs:
            return {}, {}, {}
        graph = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        for node in self.nodes[: position + 1]:
            env[node] = graph.node_copy(node, lambda n: env[n])
        graph.output(tuple(env[n] for n in outputs))
        prefix = torch.fx.GraphModule(self.gm, graph)
        with torch.no_grad():
            eager = [prefix(*self._fresh_inputs()) for _ in range(2)]
        mode = None if self.mode in (None, "default") else self.mode
        run = torch.compile(prefix, backend="inductor", dynamic=False, fullgraph=True, mode=mode)
        self.compiles += 1
        with torch.no_grad():
            values = run(*self._fresh_inputs())
        noise = {}
        for node, a, b in zip(outputs, eager[0], eager[1]):
            d = diff_tensors(a, b)
            noise[node] = d.max_abs if d.comparable else 0.0
        return dict(zip(outputs, values)), dict(zip(outputs, eager[0])), noise

    def differing(self, position: int, atol: float, rtol: float) -> list[tuple[torch.fx.Node, Any]]:
        """The values of the cut after ``position`` whose compiled value differs from eager's."""
        values, eager, noise = self.cut(position)
        found = []
        for node, value in values.items():
            d = diff_tensors(value, eager[node])
            if d.comparable and d.max_abs > noise[node] + atol + rtol * d.scale:
                found.append((node, d))
        return found


def _search(cuts: _Cuts, atol: float, rtol: float) -> OpDifference | None:
    positions = cuts.computing
    if not positions or not cuts.differing(positions[-1], atol, rtol):
        return None  # this graph compiled as a whole agrees with eager
    lo, hi = -1, len(positions) - 1  # cut lo agrees (-1: nothing computed), cut hi differs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if cuts.differing(positions[mid], atol, rtol):
            hi = mid
        else:
            lo = mid
    position = positions[hi]
    node = cuts.nodes[position]
    found = dict(cuts.differing(position, atol, rtol))
    named = node if node in found else next(iter(found))  # the cut's own op, else a value it changed
    d = found[named]
    values, eager, noise = cuts.cut(position)
    shown = (
        named.args[0]
        if named.target is operator.getitem and isinstance(named.args[0], torch.fx.Node)
        else named
    )
    return OpDifference(
        index=0,  # the caller places it in the graph run
        op=_op_name(shown),  # a tuple's item: its producer is the op
        source=meta_source(shown.meta),
        module=meta_module(shown.meta),
        max_abs=d.max_abs,
        max_rel=d.max_rel,
        noise_floor=noise[named],
        against="the call",
        where=d.where,
        graph_value=values[named].detach().clone(),
        eager_value=eager[named],
        inside=(
            f"the cut after op {hi + 1} of {len(positions)} of the compiled graph, compiled by inductor "
            f"(mode {cuts.mode or 'default'}), differs from the same ops run eagerly, the cut before it "
            f"agrees ({cuts.compiles} compiles)"
        ),
    )


def descend(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    mode: str | None = None,
    atol: float = 0.0,
    rtol: float = 0.0,
) -> tuple[int, OpDifference] | None:
    """The op inside compiled code where a difference from eager starts, and which of the call's
    compiled graphs holds it (0: the first the call ran); None when each graph agrees with eager.
    The difference's ``inside`` says how it was found; ``graph_value`` is inductor's value.

    ``fn(*args, **kwargs)`` is the call (its tensors are not changed: each run gets copies);
    ``mode`` the inductor mode to compile with (None: torch's default)."""
    graphs = trace_graphs(fn, args, kwargs)
    for index, (gm, inputs) in enumerate(graphs):
        cuts = _Cuts(gm, inputs, mode)
        found = _search(cuts, atol, rtol)
        if found is not None:
            if len(graphs) > 1:
                where = f"compiled graph {index + 1} of {len(graphs)} the call ran: {found.inside}"
                found = attrs.evolve(found, inside=where)
            logger.info("devgraph: inside compiled code: %s at %s (%s)", found.op, found.source, found.inside)
            return index, found
    return None
