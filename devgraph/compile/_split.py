"""Cut an aten-level FX graph at its splitting ops (after vLLM's ``split_graph``).

Every splitting-op call becomes a submodule of its own (run eagerly), everything between two of
them one *piece* (compiled and captured per size). ``split_module(..., keep_original_order=True)``
keeps the nodes in their original order, so in-place writes (a KV-cache ``index_copy_``) happen
before the ops that read them, exactly as in the model.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch
from torch import fx
from torch.fx.passes.split_module import split_module

from devgraph.compile._splitting_ops import SYM_OPS, is_getitem, is_host_arg_node, is_splitting_node

__all__ = ["Piece", "SplitGraph", "split_graph"]

# Ops that do no device work: a piece made only of these is not worth a captured graph.
_NO_WORK = SYM_OPS | {
    torch.ops.aten.view.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.t.default,
    torch.ops.aten.unsqueeze.default,
    torch.ops.aten.squeeze.dim,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.select.int,
    torch.ops.aten.expand.default,
    torch.ops.aten.permute.default,
    torch.ops.aten.transpose.int,
}


@attrs.frozen
class Piece:
    """One submodule of the split graph, in execution order.

    Attributes:
        name: its attribute name on the split module (``submod_<n>``).
        graph_module: the submodule.
        is_splitting_op: True for a splitting op's own submodule (run eagerly).
        ops: for a splitting submodule, the op it calls; for a piece, its device-work node count.
        does_work: False for a piece of views and shape arithmetic only (run eagerly, not captured).
    """

    name: str
    graph_module: fx.GraphModule
    is_splitting_op: bool
    ops: str
    does_work: bool


@attrs.frozen
class SplitGraph:
    """The split module (runs the submodules in order) and its submodules as ``Piece`` objects."""

    module: fx.GraphModule
    pieces: tuple[Piece, ...]

    @property
    def captured(self) -> tuple[Piece, ...]:
        """The pieces that get a captured graph per size."""
        return tuple(p for p in self.pieces if not p.is_splitting_op and p.does_work)


def _does_work(gm: fx.GraphModule) -> bool:
    for node in gm.graph.nodes:
        if node.op != "call_function" or is_getitem(node) or is_host_arg_node(node):
            continue
        if node.target in _NO_WORK or not isinstance(node.target, torch._ops.OpOverload):
            continue
        return True
    return False


def split_graph(gm: fx.GraphModule, splitting_ops: Sequence[str]) -> SplitGraph:
    """Split ``gm`` at every call of an op in ``splitting_ops`` (canonical names).

    ``getitem`` of a splitting op's result and the ``host_arg`` feeding it go with the op, so a
    piece never receives a tuple or a host list from it.
    """
    partition: dict[fx.Node, int] = {}
    split_ids: set[int] = set()
    current = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_splitting_node(node, splitting_ops):
            current += 1
            partition[node] = current
            split_ids.add(current)
            current += 1
        elif (
            is_getitem(node)
            and isinstance(node.args[0], fx.Node)
            and partition.get(node.args[0]) in split_ids
        ):
            partition[node] = partition[node.args[0]]
        else:
            partition[node] = current
    for node in gm.graph.nodes:
        if is_host_arg_node(node) and node.users:
            partition[node] = partition[next(iter(node.users))]
    split = split_module(gm, gm, lambda node: partition[node], keep_original_order=True)

    pieces = []
    for node in split.graph.nodes:
        if node.op != "call_module":
            continue
        sub = getattr(split, node.target)
        index = int(node.target.rsplit("_", 1)[1])
        if index in split_ids:
            calls = [n for n in sub.graph.nodes if is_splitting_node(n, splitting_ops)]
            label = str(calls[0].target) if calls else "?"
            pieces.append(Piece(node.target, sub, True, label, False))
        else:
            work = _does_work(sub)
            count = sum(1 for n in sub.graph.nodes if n.op == "call_function")
            pieces.append(Piece(node.target, sub, False, f"{count} nodes", work))
    return SplitGraph(split, tuple(pieces))
