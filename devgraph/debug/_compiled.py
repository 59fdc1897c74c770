"""Inside ``torch.compile``'d code: which op's compiled value first departs from eager.

A compiled graph's kernels are fused: the op-by-op probe sees one call (``COMPILED``, recorded whole,
as the capture records it) and no op inside it. When a bisect finds a compiled graph where the
difference starts, it descends:

1. **Trace.** The call runs once more with every ``torch.compile``'d function it reaches compiled by
   a backend that only keeps each graph Dynamo hands it and the graph's real inputs, then runs it
   eagerly (``torch.compiler.set_stance(force_backend=...)``): the graphs are the call's compiled
   regions, op by op, with the user's source line and module path of each op (``stack_trace``,
   ``nn_module_stack``); what the call runs eagerly stays out of them.
2. **Cut.** For a cut after op ``k`` the graph's prefix up to ``k`` is compiled by inductor (the
   mode given), with every value the rest of the graph still reads as an output, and run on the
   graph's inputs; ``P(k)``: some output differs from the same values computed eagerly beyond the
   noise floor (eager run twice). ``P`` of the whole graph is true when its output differs.
3. **Bisect.** Binary search between a cut that agrees and one that differs, a handful of compiles:
   the op ``k`` where ``P`` turns true is the op whose compiled value departs from eager with
   everything before it compiled alike. It is an op where a difference *starts* (the cut before it
   agrees), the first one for a difference that, once made, reaches the graph's later values.

Each region is compiled afresh with the mode given (``BisectOptions.compile_mode``): give the mode
the code was compiled with. Nothing in torch is patched; the backend is an ordinary one.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import torch
import torch.fx
from torch.utils._pytree import tree_flatten

from devgraph.debug._compare import diff_tensors
from devgraph.debug._probe import COMPILED
from devgraph.debug._report import OpDifference

__all__ = ["COMPILED", "descend", "truly_eager"]

logger = logging.getLogger("devgraph.debug")


@contextlib.contextmanager
def truly_eager() -> Iterator[None]:
    """Run ``torch.compile``'d functions as their original code (``set_stance("force_eager")``): the
    eager side of a comparison must not run compiled code, or it compares compiled with compiled."""
    with torch.compiler.set_stance("force_eager"):
        yield


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def trace_graphs(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[tuple[Any, list[Any]]]:
    """Dynamo's graphs of ``fn(*args, **kwargs)`` in call order, each with copies of its real inputs."""
    graphs: list[tuple[Any, list[Any]]] = []

    def keep(gm: torch.fx.GraphModule, inputs: Sequence[Any]) -> Callable[..., Any]:
        kept = [
            x.detach().clone() if isinstance(x, torch.Tensor) and not isinstance(x, torch.nn.Parameter) else x
            for x in inputs
        ]
        graphs.append((gm, kept))
        return gm.forward

    # Every torch.compile'd function the call reaches compiles with `keep` instead of its own backend
    # (a new backend: Dynamo compiles afresh, and the call's own compiled code is left as it is).
    with torch.no_grad(), torch.compiler.set_stance("default", force_backend=keep):
        fn(*args, **kwargs)
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


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in [^\n]*\n\s*([^\n]*)')


def _source(node: torch.fx.Node) -> str | None:
    """``file:LINE: code`` of the innermost frame of the node's stack trace (the op's own line)."""
    trace = node.meta.get("stack_trace") or ""
    frames = _FRAME.findall(trace)
    if not frames:
        return None
    path, line, code = frames[-1]
    return f"{path}:{line}: {code.strip()}"


def _module(node: torch.fx.Node) -> str | None:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return None
    path, cls = list(stack.values())[-1]
    # Dynamo names modules by how it reached them (L['self'].layers[0], G['model']._orig_mod.x):
    # keep the attribute path under the traced root.
    path = re.sub(r"^[LG]\['[^']*'\]", "", str(path))
    path = path.replace("._orig_mod", "").lstrip(".")
    return re.sub(r"\[(\d+)\]", r".\1", path).lstrip(".") or getattr(cls, "__name__", None)


class _Cuts:
    """One Dynamo graph: its eager values, and inductor's value of any prefix of it."""

    def __init__(self, gm: torch.fx.GraphModule, inputs: list[Any], mode: str | None) -> None:
        self.gm, self.inputs, self.mode = gm, inputs, mode
        self.nodes = list(gm.graph.nodes)
        self.computing = [i for i, n in enumerate(self.nodes) if n.op in _COMPUTES]
        runs = [self._eager_values() for _ in range(2)]
        self.eager = runs[0]
        self.noise = {}
        for node, value in runs[0].items():
            other = runs[1].get(node)
            if isinstance(value, torch.Tensor) and isinstance(other, torch.Tensor):
                d = diff_tensors(value, other)
                self.noise[node] = d.max_abs if d.comparable else 0.0
        self.compiles = 0
        self._compiled: dict[int, dict[torch.fx.Node, torch.Tensor]] = {}

    def _fresh_inputs(self) -> list[Any]:
        return [
            x.clone() if isinstance(x, torch.Tensor) and not isinstance(x, torch.nn.Parameter) else x
            for x in self.inputs
        ]

    def _eager_values(self) -> dict[torch.fx.Node, Any]:
        interpreter = torch.fx.Interpreter(self.gm, garbage_collect_values=False)
        with torch.no_grad():
            interpreter.run(*self._fresh_inputs())
        return {
            n: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for n, v in interpreter.env.items()
        }

    def live(self, position: int) -> list[torch.fx.Node]:
        """The tensor values after op ``position`` (an index into ``nodes``) that the rest still reads."""
        kept = set(self.nodes[: position + 1])
        out = []
        for node in self.nodes[: position + 1]:
            if not isinstance(self.eager.get(node), torch.Tensor) or node.op == "placeholder":
                continue
            if node is self.nodes[position] or any(u not in kept for u in node.users):
                out.append(node)
        return out

    def compiled(self, position: int) -> dict[torch.fx.Node, torch.Tensor]:
        """Inductor's values of ``live(position)``, the prefix up to ``position`` compiled as one
        (each cut compiled once: the search reads the one it found again)."""
        if position not in self._compiled:
            self._compiled[position] = self._compile(position)
        return self._compiled[position]

    def _compile(self, position: int) -> dict[torch.fx.Node, torch.Tensor]:
        outputs = self.live(position)
        if not outputs:
            return {}
        graph = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        for node in self.nodes[: position + 1]:
            env[node] = graph.node_copy(node, lambda n: env[n])
        graph.output(tuple(env[n] for n in outputs))
        prefix = torch.fx.GraphModule(self.gm, graph)
        mode = None if self.mode in (None, "default") else self.mode
        run = torch.compile(prefix, backend="inductor", dynamic=False, fullgraph=True, mode=mode)
        self.compiles += 1
        with torch.no_grad():
            values = run(*self._fresh_inputs())
        return dict(zip(outputs, values))

    def differing(
        self, values: dict[torch.fx.Node, torch.Tensor], atol: float, rtol: float
    ) -> list[tuple[torch.fx.Node, Any]]:
        found = []
        for node, value in values.items():
            d = diff_tensors(value, self.eager[node])
            if d.comparable and d.max_abs > self.noise.get(node, 0.0) + atol + rtol * d.scale:
                found.append((node, d))
        return found


def _search(cuts: _Cuts, atol: float, rtol: float) -> OpDifference | None:
    positions = cuts.computing
    if not positions:
        return None
    last = positions[-1]
    if not cuts.differing(cuts.compiled(last), atol, rtol):
        return None  # this graph compiled as a whole agrees with eager
    lo, hi = -1, len(positions) - 1  # cut lo agrees (-1: nothing computed), cut hi differs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if cuts.differing(cuts.compiled(positions[mid]), atol, rtol):
            hi = mid
        else:
            lo = mid
    position = positions[hi]
    node = cuts.nodes[position]
    values = cuts.compiled(position)
    found = dict(cuts.differing(values, atol, rtol))
    named = node if node in found else next(iter(found), node)
    d = found[named] if named in found else diff_tensors(values[named], cuts.eager[named])
    shown = (
        named.args[0]
        if named.target is operator.getitem and isinstance(named.args[0], torch.fx.Node)
        else named
    )
    return OpDifference(
        index=0,  # the caller places it in the graph run
        op=_op_name(shown),  # a tuple's item: its producer is the op
        source=_source(shown),
        module=_module(shown),
        max_abs=d.max_abs,
        max_rel=d.max_rel,
        noise_floor=cuts.noise.get(named, 0.0),
        against="the call",
        where=d.where,
        graph_value=values[named].detach().clone(),
        eager_value=cuts.eager[named],
        inside=(
            f"op {cuts.computing.index(position) + 1} of {len(cuts.computing)} of the compiled graph; "
            f"the graph cut after it and compiled by inductor (mode {cuts.mode or 'default'}) differs from "
            f"eager, cut before it agrees ({cuts.compiles} compiles)"
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
