"""Matching helpers for the fusion passes: aten-graph predicates, the RMSNorm matcher, ``fuse``.

Patterns are matched by walking the graph from an anchor node, as written by Hugging Face and
vLLM models, with every size read from the nodes' ``meta['val']`` (never hard-coded). Commutative
operands are tried both ways; optional dtype casts (``x.to(float32)`` ... ``.to(input_dtype)``)
are accepted where models put them.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import torch
from torch import fx

from devgraph.graph import is_view, written_arguments

__all__ = [
    "RmsMatch",
    "aten",
    "fuse",
    "is_call",
    "is_one_element",
    "match_rms_norm",
    "meta",
    "only_users",
    "same_shape",
    "same_size",
]

aten = torch.ops.aten

VIEW_OPS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.alias.default}
SHAPE_OPS = {aten.sym_size.int, aten.sym_numel.default}


def meta(node: Any) -> Any:
    """The fake value of ``node`` (``None`` for non-nodes or nodes without one)."""
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def is_call(node: Any, *targets: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def only_users(node: fx.Node, allowed: set[fx.Node]) -> bool:
    """Every user of ``node`` is in ``allowed``."""
    return all(u in allowed for u in node.users)


def is_cast(node: Any, dtype: torch.dtype | None = None) -> bool:
    """An ``x.to(dtype)`` on the same device (``aten._to_copy`` with a dtype only)."""
    if not is_call(node, aten._to_copy.default):
        return False
    extra = set(node.kwargs) - {"dtype", "memory_format", "layout", "device", "pin_memory"}
    src, dst = meta(node.args[0]), meta(node)
    if extra or src is None or dst is None or src.device != dst.device:
        return False
    return dtype is None or dst.dtype == dtype


def operands(node: fx.Node) -> Iterator[tuple[Any, Any]]:
    """``(a, b)`` then ``(b, a)`` for a binary node."""
    a, b = node.args[0], node.args[1]
    yield a, b
    yield b, a


def same_size(a: Any, b: Any) -> bool:
    """Sizes equal without asking the shape environment (which would add a guard)."""
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        ea = a.node.expr if isinstance(a, torch.SymInt) else a
        eb = b.node.expr if isinstance(b, torch.SymInt) else b
        return bool(ea == eb)
    return a == b


def same_shape(a: Sequence[Any], b: Sequence[Any]) -> bool:
    return len(a) == len(b) and all(same_size(x, y) for x, y in zip(a, b))


def is_one_element(value: Any) -> bool:
    """A tensor of exactly one element, known statically."""
    return value is not None and all(isinstance(d, int) and d == 1 for d in value.shape)


def scalar(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def last_dim_reduction(node: fx.Node, ndim: int) -> bool:
    """``node`` reduces over the last dim only, keeping it (``mean(-1, keepdim=True)``)."""
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    return isinstance(dims, (list, tuple)) and len(dims) == 1 and dims[0] in (-1, ndim - 1) and bool(keep)


@attrs.frozen
class RmsMatch:
    """An RMSNorm ``weight * (x * rsqrt(mean(x**2, -1) + eps))`` found in the graph.

    ``x`` is the normalised value before any float32 cast; ``nodes`` are the pattern's own nodes
    (to erase when fused), ``out`` the last of them.
    """

    x: fx.Node
    weight: fx.Node
    eps: float
    out: fx.Node
    nodes: tuple[fx.Node, ...]


def match_rms_norm(out: fx.Node) -> RmsMatch | None:
    """The RMSNorm whose result is ``out`` (a ``mul`` by the weight), or None.

    Accepts Hugging Face's ``LlamaRMSNorm`` / ``Qwen3RMSNorm`` and vLLM's ``forward_native`` shapes,
    with or without the float32 round trip.
    """
    if not is_call(out, aten.mul.Tensor):
        return None
    out_val = meta(out)
    if out_val is None or out_val.dim() < 1:
        return None
    hidden = out_val.shape[-1]
    for weight, normed in operands(out):
        w = meta(weight)
        if not isinstance(normed, fx.Node) or w is None or w.dim() != 1 or not same_size(w.shape[0], hidden):
            continue
        nodes = [out]
        back = None
        if is_cast(normed):
            back, normed = normed, normed.args[0]
            nodes.append(back)
        if not is_call(normed, aten.mul.Tensor):
            continue
        for x32, inv in operands(normed):
            if not is_call(inv, aten.rsqrt.default) or not isinstance(x32, fx.Node):
                continue
            shifted = inv.args[0]
            if not is_call(shifted, aten.add.Tensor, aten.add.Scalar):
                continue
            mean, eps = shifted.args[0], scalar(shifted.args[1])
            if eps is None:
                mean, eps = shifted.args[1], scalar(shifted.args[0])
            if eps is None or not is_call(mean, aten.mean.dim):
                continue
            square = mean.args[0]
            if not (
                is_call(square, aten.pow.Tensor_Scalar) and square.args[0] is x32 and square.args[1] == 2
            ):
                continue
            x_val = meta(x32)
            if x_val is None or not last_dim_reduction(mean, x_val.dim()):
                continue
            pattern = [*nodes, normed, inv, shifted, mean, square]
            x: Any = x32
            if is_cast(x32, torch.float32):
                x = x32.args[0]
                pattern.append(x32)
                if not only_users(x32, {square, normed}):
                    continue
            inner = set(pattern)
            if any(not only_users(n, inner) for n in pattern if n is not out):
                continue
            if meta(x) is None or meta(x).dtype != out_val.dtype:
                continue  # a norm that changes dtype is not what the fused ops compute
            return RmsMatch(x, weight, eps, out, tuple(pattern))
    return None


def _arg_nodes(args: Sequence[Any]) -> Iterator[fx.Node]:
    for a in args:
        if isinstance(a, fx.Node):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from _arg_nodes(a)


def _is_view(node: fx.Node) -> bool:
    """A call whose result aliases its first argument without writing it (``view``, ``slice``...)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    return is_view(node.target._schema)


def _alias_root(node: fx.Node) -> fx.Node:
    """The node whose memory ``node`` views (itself when it is not a view).

    Steps through views and through ``getitem`` of list-returning views (``split``, ``chunk``,
    ``unbind``: ``Tensor(a)[]``).
    """
    while True:
        if (
            node.op == "call_function"
            and node.target is operator.getitem
            and isinstance(node.args[0], fx.Node)
        ):
            node = node.args[0]
        elif _is_view(node) and node.args and isinstance(node.args[0], fx.Node):
            node = node.args[0]
        else:
            return node


def _written(node: fx.Node) -> Iterator[fx.Node]:
    """The nodes whose memory ``node`` writes in place (``Tensor(a!)`` arguments of its schema)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return
    yield from _arg_nodes(written_arguments(node.target._schema, node.args, dict(node.kwargs)))


def _written_between(start: fx.Node, stop: fx.Node, skip: set[fx.Node], inputs: set[fx.Node]) -> bool:
    """Whether a node after ``start`` and before ``stop`` (``skip`` aside) writes memory of ``inputs``
    or of the pattern's own nodes (``skip``), through any view of them."""
    roots = {_alias_root(n) for n in inputs | skip}
    node = start.next
    while node is not stop and node.op != "root":
        if node not in skip and any(_alias_root(w) in roots for w in _written(node)):
            return True
        node = node.next
    return False


def fuse(
    graph: fx.Graph,
    target: Any,
    args: Sequence[Any],
    outputs: Sequence[fx.Node | None],
    internal: set[fx.Node],
    adapters: Sequence[Callable[[fx.Graph, fx.Node], fx.Node] | None] = (),
) -> fx.Node | None:
    """Replace a matched pattern by one call ``target(*args)``.

    ``outputs[i]`` (a pattern node, or None when unused) is replaced by output ``i`` of the call for
    every user outside ``internal`` (the pattern's own nodes, erased afterwards); ``adapters[i]``,
    when given, builds the replacement from that output (a reshape, say). The call goes right
    before the first such user; weights defined later (``get_attr``) are moved up. Returns the call,
    or None (graph untouched) when the pattern leaks an intermediate, an input comes too late, or
    an op between the pattern's first node and where the call would go writes one of its inputs in
    place (the graph is not functionalized: ``s = a + b; a.add_(1); rms_norm(s)`` must keep reading
    ``a`` before the write).
    """
    outs = [o for o in outputs if o is not None]
    for n in internal:
        if n not in outs and not only_users(n, internal):
            return None
    order = {n: i for i, n in enumerate(graph.nodes)}
    users = [u for o in outs for u in o.users if u not in internal]
    if users:
        anchor = min(users, key=order.__getitem__)
    else:
        anchor = max(internal, key=order.__getitem__).next
    inputs = {a for n in internal for a in n.all_input_nodes if a not in internal}
    inputs.update(_arg_nodes(args))
    earliest = min(internal, key=order.__getitem__)
    stop = max([anchor, *internal], key=lambda n: order.get(n, len(order)))
    if _written_between(earliest, stop, internal, inputs):
        return None
    late = [a for a in _arg_nodes(args) if order[a] >= order[anchor]]
    for a in late:
        movable = a.op == "get_attr" or (
            is_call(a, *VIEW_OPS, *SHAPE_OPS) and all(order[i] < order[anchor] for i in a.all_input_nodes)
        )
        if not movable:
            return None
    for a in late:
        anchor.prepend(a)  # a weight fetched (or a view taken) late: do it before the fused op
    with graph.inserting_before(anchor):
        call = graph.call_function(target, tuple(args))
        items = []
        for i, out in enumerate(outputs):
            if out is None:
                continue
            item = graph.call_function(operator.getitem, (call, i))
            adapt = adapters[i] if i < len(adapters) else None
            if adapt is not None:
                item = adapt(graph, item)
            item.meta["val"] = meta(out)
            items.append((out, item))
    call.meta["val"] = tuple(meta(o) for o in outputs)
    for out, item in items:
        out.replace_all_uses_with(item, delete_user_cb=lambda user: user not in internal)
    for n in sorted(internal, key=order.__getitem__, reverse=True):
        if not n.users:
            graph.erase_node(n)
    return call


def add_operands(node: Any) -> tuple[fx.Node, fx.Node] | None:
    """``(a, b)`` of a plain residual add ``a + b`` (same shape and dtype, alpha 1), else None."""
    if not is_call(node, aten.add.Tensor) or node.kwargs.get("alpha", 1) != 1 or len(node.args) != 2:
        return None
    a, b = node.args
    va, vb, vs = meta(a), meta(b), meta(node)
    if va is None or vb is None or vs is None:
        return None
    if not same_shape(va.shape, vs.shape) or not same_shape(vb.shape, vs.shape):
        return None
    if va.dtype != vs.dtype or vb.dtype != vs.dtype:
        return None
    return a, b
