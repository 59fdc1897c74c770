"""Qwen3-style attention prologue fusion: split of a fused QKV projection, per-head RMSNorm of q
and k, neox rotary embedding -> ``devgraph::split_qkv_rms_norm_rope``.

The pattern is vLLM's ``Qwen3Attention.forward`` with ``RotaryEmbedding.forward_native``::

    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q_norm(q.view(*q.shape[:-1], q.shape[-1] // head_dim, head_dim)).view(q.shape)
    k = ...same with k_norm...
    cos_sin = cos_sin_cache.index_select(0, positions); cos, sin = cos_sin.chunk(2, dim=-1)
    per q and k: x = x.view(T, -1, head_dim); rot, pass = x[..., :rotary_dim], x[..., rotary_dim:]
                 x1, x2 = rot.chunk(2, dim=-1)
                 rot = cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
                 x = cat((rot, pass), dim=-1).reshape(shape)

Head counts, head size and rotary size are read from the graph (split sizes, view shapes, the
cache's width); nothing is assumed about the model.
"""

from __future__ import annotations

import operator
from typing import Any

import attrs
import torch
from torch import fx

from devgraph.compile.passes._base import Pass, PassContext
from devgraph.compile.passes._match import (
    VIEW_OPS,
    RmsMatch,
    aten,
    fuse,
    is_call,
    is_cast,
    match_rms_norm,
    meta,
    operands,
)

__all__ = ["SplitQkvRmsNormRopeFusion"]

_BIG = 2**62


def _follow_views(node: fx.Node, nodes: list[fx.Node]) -> fx.Node:
    """Follow single-user view ops forward from ``node`` (appending them to ``nodes``)."""
    while len(node.users) == 1:
        user = next(iter(node.users))
        if not is_call(user, *VIEW_OPS):
            break
        node = user
        nodes.append(node)
    return node


def _getitems(node: fx.Node) -> dict[Any, fx.Node] | None:
    items = {}
    for user in node.users:
        if not (user.op == "call_function" and user.target is operator.getitem):
            return None
        items[user.args[1]] = user
    return items


def _rms_from_input(x: fx.Node) -> RmsMatch | None:
    """The RMSNorm whose input is ``x`` (searching forward from its ``pow``)."""
    starts = [x] + [u for u in x.users if is_cast(u, torch.float32)]
    for start in starts:
        for square in start.users:
            if not is_call(square, aten.pow.Tensor_Scalar):
                continue
            node = square
            for _ in range(6):  # mean, add, rsqrt, mul, [cast], mul by weight
                if len(node.users) != 1:
                    break
                node = next(iter(node.users))
                found = match_rms_norm(node)
                if found is not None and found.x is x:
                    return found
    return None


@attrs.frozen
class _Rope:
    out: fx.Node  # [T, H, D] after rotation (the last cat)
    nodes: tuple[fx.Node, ...]
    cos_sin: fx.Node  # index_select(cache, 0, positions)
    shared: tuple[fx.Node, ...]  # cos/sin nodes shared by q and k
    rotary_dim: int


def _unsqueezed(node: Any) -> tuple[Any, list[Any]] | None:
    """``(source, nodes)`` of ``source.unsqueeze(-2)[.to(dtype)]`` (either order of the two)."""
    nodes: list[Any] = []
    if is_cast(node):
        nodes.append(node)
        node = node.args[0]
    if not is_call(node, aten.unsqueeze.default) or node.args[1] not in (-2, 1):
        return None
    nodes.append(node)
    node = node.args[0]
    if is_cast(node):
        nodes.append(node)
        node = node.args[0]
    return node, nodes


def _cos_sin(cos_node: Any, sin_node: Any, half: int) -> tuple[Any, list[Any]] | None:
    """The ``index_select(cache, 0, positions)`` both come from via ``chunk(2, -1)``, and the nodes."""
    cos, cn = _unsqueezed(cos_node) or (None, [])
    sin, sn = _unsqueezed(sin_node) or (None, [])
    if cos is None or sin is None:
        return None
    for item, index in ((cos, 0), (sin, 1)):
        if not (item.op == "call_function" and item.target is operator.getitem and item.args[1] == index):
            return None
    chunk = cos.args[0]
    if sin.args[0] is not chunk or not is_call(chunk, aten.split.Tensor) or chunk.args[1] != half:
        return None
    dim = chunk.args[2] if len(chunk.args) > 2 else chunk.kwargs.get("dim", 0)
    if dim not in (-1, 1):
        return None
    table = chunk.args[0]
    if not is_call(table, aten.index_select.default) or table.args[1] != 0:
        return None
    cache = meta(table.args[0])
    if cache is None or cache.dim() != 2 or cache.shape[1] != 2 * half:
        return None
    return table, [*cn, *sn, cos, sin, chunk]


def _last_dim(node: fx.Node, index: int = 1) -> bool:
    """The ``dim`` argument (positional ``index``) of ``node`` is its input's last dim."""
    dim = node.args[index] if len(node.args) > index else node.kwargs.get("dim", 0)
    return dim in (-1, meta(node.args[0]).dim() - 1)


def _match_rope(heads: fx.Node) -> _Rope | None:
    """Neox rotary of ``heads`` ``[T, H, D]`` as vLLM's ``forward_native`` writes it."""
    val = meta(heads)
    if val is None or val.dim() != 3:
        return None
    head_dim = val.shape[-1]
    slices = [u for u in heads.users if is_call(u, aten.slice.Tensor) and _last_dim(u)]
    splits = [u for u in heads.users if is_call(u, aten.split.Tensor)]
    rot_node, pass_node, rot = None, None, head_dim
    for s in slices:
        start = s.args[2] if len(s.args) > 2 else 0
        end = s.args[3] if len(s.args) > 3 else _BIG
        if start == 0 and isinstance(end, int):
            rot_node, rot = s, min(end, head_dim)
    aliases = [u for u in heads.users if is_call(u, aten.alias.default)]
    if rot_node is None and len(aliases) == 1:
        rot_node = aliases[0]  # x[..., :head_dim] under tracing: an alias of the whole
    if rot_node is None and splits:
        rot_node = heads
    for s in slices:
        start = s.args[2] if len(s.args) > 2 else 0
        end = s.args[3] if len(s.args) > 3 else _BIG
        if start == rot and isinstance(end, int) and end >= head_dim:
            pass_node = s
    if rot_node is None or not isinstance(rot, int) or rot % 2 or len(heads.users) > 2:
        return None
    half = rot // 2
    chunks = [
        u for u in rot_node.users if is_call(u, aten.split.Tensor) and u.args[1] == half and _last_dim(u, 2)
    ]
    if len(chunks) != 1:
        return None
    items = _getitems(chunks[0])
    if items is None or set(items) != {0, 1}:
        return None
    x1, x2 = items[0], items[1]
    # o1 = x1 * cos - x2 * sin ; o2 = x2 * cos + x1 * sin ; out = cat((cat((o1, o2)), pass))
    cats = [u for u in x1.users for u in u.users for u in u.users if is_call(u, aten.cat.default)]
    if not cats:
        return None
    inner = cats[0]
    parts: Any = inner.args[0]
    if len(parts) != 2 or not is_call(parts[0], aten.sub.Tensor) or not is_call(parts[1], aten.add.Tensor):
        return None
    o1, o2 = parts

    def product(node: Any, x: fx.Node) -> Any:
        """The factor multiplying ``x`` in ``node = x * factor`` (either order), else None."""
        if not is_call(node, aten.mul.Tensor):
            return None
        for a, b in operands(node):
            if a is x:
                return b
        return None

    cos_a, sin_a = product(o1.args[0], x1), product(o1.args[1], x2)
    found = None
    for a, b in operands(o2):
        cos_b, sin_b = product(a, x2), product(b, x1)
        if cos_b is not None and sin_b is not None:
            found = (a, b, cos_b, sin_b)
    if cos_a is None or sin_a is None or found is None or found[2] is not cos_a or found[3] is not sin_a:
        return None
    table = _cos_sin(cos_a, sin_a, half)
    if table is None:
        return None
    cos_sin, shared = table
    nodes: list[Any] = [
        rot_node,
        chunks[0],
        x1,
        x2,
        o1.args[0],
        o1.args[1],
        found[0],
        found[1],
        o1,
        o2,
        inner,
    ]
    if rot_node is heads:
        nodes.remove(heads)
    out = inner
    if pass_node is not None:
        outer = [u for u in inner.users if is_call(u, aten.cat.default)]
        outer_parts: Any = outer[0].args[0] if len(outer) == 1 else ()
        if list(outer_parts) != [inner, pass_node]:
            return None
        out = outer[0]
        nodes += [pass_node, out]
    elif rot != head_dim:
        return None
    return _Rope(out, tuple(nodes), cos_sin, tuple(shared), rot)


@attrs.frozen
class _Side:
    """q's (or k's) chain: split output -> heads view -> RMSNorm -> views -> rotary."""

    heads: int
    head_dim: int
    rms: RmsMatch
    rope: _Rope
    nodes: tuple[fx.Node, ...]


def _match_side(item: fx.Node) -> _Side | None:
    nodes = [item]
    x = _follow_views(item, nodes)
    val = meta(x)
    if (
        val is None
        or val.dim() != 3
        or not isinstance(val.shape[-1], int)
        or not isinstance(val.shape[-2], int)
    ):
        return None
    rms = _rms_from_input(x)
    if rms is None:
        return None
    nodes += rms.nodes
    rotated = _follow_views(rms.out, nodes)
    if meta(rotated) is None or meta(rotated).dim() != 3:
        return None
    rope = _match_rope(rotated)
    if rope is None:
        return None
    nodes += rope.nodes
    return _Side(int(val.shape[-2]), int(val.shape[-1]), rms, rope, tuple(dict.fromkeys(nodes)))


class SplitQkvRmsNormRopeFusion(Pass):
    """Split of a fused QKV projection + per-head q/k RMSNorm + neox RoPE ->
    ``devgraph::split_qkv_rms_norm_rope`` (Qwen3-style attention)."""

    name = "split_qkv_rms_norm_rope"

    def is_applicable(self, ctx: PassContext) -> bool:
        from devgraph.ops import has_kernel

        return has_kernel("split_qkv_rms_norm_rope", ctx.dispatch_key)

    def __call__(self, graph: fx.Graph) -> int:
        count = 0
        for node in list(graph.nodes):
            if node.graph is not graph or not is_call(node, aten.split_with_sizes.default):
                continue
            if self._rewrite(graph, node):
                count += 1
        return count

    def _rewrite(self, graph: fx.Graph, split: fx.Node) -> bool:
        qkv: Any = split.args[0]
        sizes: Any = split.args[1]
        dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
        val = meta(qkv)
        if val is None or val.dim() != 2 or dim not in (-1, 1) or len(sizes) != 3:
            return False
        if not all(isinstance(s, int) for s in sizes) or sizes[1] != sizes[2]:
            return False
        items = _getitems(split)
        if items is None or not {0, 1} <= set(items):
            return False
        q, k = _match_side(items[0]), _match_side(items[1])
        if q is None or k is None:
            return False
        if q.head_dim != k.head_dim or q.rms.eps != k.rms.eps or q.rope.cos_sin is not k.rope.cos_sin:
            return False
        d = q.head_dim
        if sizes[0] != q.heads * d or sizes[1] != k.heads * d or q.rope.rotary_dim > d:
            return False
        cache, positions = q.rope.cos_sin.args[0], q.rope.cos_sin.args[2]
        pos = meta(positions)
        if pos is None or pos.dim() != 1 or pos.dtype not in (torch.int32, torch.int64):
            return False
        tokens = val.shape[0]

        def heads_view(heads: int) -> Any:
            def adapt(g: fx.Graph, item: fx.Node) -> fx.Node:
                t = (
                    g.call_function(aten.sym_size.int, (qkv, 0))
                    if isinstance(tokens, torch.SymInt)
                    else tokens
                )
                return g.call_function(aten.view.default, (item, [t, heads, d]))

            return adapt

        internal = {split, *q.nodes, *k.nodes, *items.values()}
        op = torch.ops.devgraph.split_qkv_rms_norm_rope.default
        args = (qkv, q.rms.weight, k.rms.weight, cache, positions, q.heads, k.heads, d, q.rms.eps)
        outputs = (q.rope.out, k.rope.out, items.get(2))
        adapters = (heads_view(q.heads), heads_view(k.heads), None)
        if fuse(graph, op, args, outputs, internal, adapters) is None:
            return False
        order = {n: i for i, n in enumerate(graph.nodes)}
        for n in sorted(
            {*q.rope.shared, *k.rope.shared, q.rope.cos_sin}, key=order.__getitem__, reverse=True
        ):
            if not n.users:
                graph.erase_node(n)  # the cos/sin lookup, now unused
        return True
