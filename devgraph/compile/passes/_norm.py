"""Residual-add + RMSNorm fusions (plain, static int8 quant, dynamic per-token int8 quant).

The pattern, as decoder layers write it (Hugging Face Llama/Qwen, vLLM's ``forward_native``)::

    hidden = residual + hidden            # s; also the next residual (other users kept)
    normed = rms_norm(hidden) * weight    # any form match_rms_norm accepts

becomes ``normed, hidden = devgraph.add_rms_norm(residual, hidden, weight, eps)``. The quant
variants also swallow the int8 quantisation of ``normed`` (only when nothing else reads it):

* static: ``clamp(round(normed / scale), -128, 127).to(int8)`` with a one-element ``scale``;
* dynamic: ``scale = (amax(|normed|, -1, keepdim) / 127).clamp(min=eps_q)``, then as above with
  the per-token ``scale`` (which the fused op also returns).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from devgraph.compile.passes._base import Pass, PassContext
from devgraph.compile.passes._match import (
    RmsMatch,
    add_operands,
    aten,
    fuse,
    is_call,
    is_cast,
    is_one_element,
    last_dim_reduction,
    match_rms_norm,
    meta,
    only_users,
    scalar,
)

__all__ = ["AddRmsNormDynamicQuantFusion", "AddRmsNormFusion", "AddRmsNormQuantFusion"]


def _has_kernel(op: str, ctx: PassContext) -> bool:
    from devgraph.ops import has_kernel

    return has_kernel(op, ctx.dispatch_key)


def _residual_norm(node: fx.Node) -> tuple[RmsMatch, fx.Node, fx.Node, fx.Node] | None:
    """``(rms, sum, a, b)`` when ``node`` is an RMSNorm of a residual sum ``a + b``."""
    rms = match_rms_norm(node)
    if rms is None:
        return None
    pair = add_operands(rms.x)
    if pair is None:
        return None
    return rms, rms.x, pair[0], pair[1]


def _quant_tail(normed: fx.Node) -> tuple[fx.Node, list[fx.Node], Any] | None:
    """``(int8 node, pattern nodes, divisor)`` for ``clamp(round(normed / d), -128, 127).to(int8)``
    where ``normed`` is the only reader chain; the divisor is returned unchecked."""
    users = list(normed.users)
    divs = [u for u in users if is_call(u, aten.div.Tensor) and u.args[0] is normed]
    if len(divs) != 1:
        return None
    div = divs[0]
    if len(div.users) != 1:
        return None
    rnd = next(iter(div.users))
    if not is_call(rnd, aten.round.default) or len(rnd.users) != 1:
        return None
    clamp = next(iter(rnd.users))
    if not is_call(clamp, aten.clamp.default) or len(clamp.users) != 1:
        return None
    lo = scalar(clamp.args[1]) if len(clamp.args) > 1 else scalar(clamp.kwargs.get("min"))
    hi = scalar(clamp.args[2]) if len(clamp.args) > 2 else scalar(clamp.kwargs.get("max"))
    if lo != -128 or hi != 127:
        return None
    cast = next(iter(clamp.users))
    if not is_cast(cast, torch.int8):
        return None
    return cast, [div, rnd, clamp, cast], div.args[1]


class _ResidualNormFusion(Pass):
    """Walks the graph for residual add + RMSNorm; subclasses fuse what follows (``_fuse``)."""

    op_name = ""

    def is_applicable(self, ctx: PassContext) -> bool:
        return _has_kernel(self.op_name, ctx)

    def __call__(self, graph: fx.Graph) -> int:
        count = 0
        for node in list(graph.nodes):
            if node.graph is not graph:  # erased by an earlier rewrite
                continue
            found = _residual_norm(node)
            if found is not None and self._fuse(graph, *found):
                count += 1
        return count

    def _fuse(self, graph: fx.Graph, rms: Any, summed: fx.Node, a: Any, b: Any) -> bool:
        raise NotImplementedError


class AddRmsNormFusion(_ResidualNormFusion):
    """Residual add followed by RMSNorm -> ``devgraph::add_rms_norm``."""

    name = op_name = "add_rms_norm"

    def _fuse(self, graph: fx.Graph, rms: Any, summed: fx.Node, a: Any, b: Any) -> bool:
        op = torch.ops.devgraph.add_rms_norm.default
        return (
            fuse(graph, op, (a, b, rms.weight, rms.eps), (rms.out, summed), {*rms.nodes, summed}) is not None
        )


class AddRmsNormQuantFusion(_ResidualNormFusion):
    """Residual add + RMSNorm + static int8 quantisation -> ``devgraph::add_rms_norm_quant``."""

    name = op_name = "add_rms_norm_quant"

    def _fuse(self, graph: fx.Graph, rms: Any, summed: fx.Node, a: Any, b: Any) -> bool:
        tail = _quant_tail(rms.out)
        if tail is None or len(rms.out.users) != 1:
            return False
        q, nodes, scale = tail
        s = meta(scale)
        if not is_one_element(s) or not s.is_floating_point():
            return False
        internal = {*rms.nodes, *nodes, summed}
        op = torch.ops.devgraph.add_rms_norm_quant.default
        return fuse(graph, op, (a, b, rms.weight, rms.eps, scale), (q, summed), internal) is not None


def _dynamic_scale(normed: fx.Node, divisor: Any) -> list[fx.Node] | None:
    """Pattern nodes of ``divisor = (amax(|normed|, -1, keepdim) / 127).clamp(min=...)``, or None."""
    if not is_call(divisor, aten.clamp.default, aten.clamp_min.default):
        return None
    lo = scalar(divisor.args[1]) if len(divisor.args) > 1 else scalar(divisor.kwargs.get("min"))
    hi = divisor.args[2] if len(divisor.args) > 2 else divisor.kwargs.get("max")
    if lo is None or lo <= 0 or lo > 1e-6 or hi is not None:
        return None
    div: Any = divisor.args[0]
    if not is_call(div, aten.div.Tensor) or scalar(div.args[1]) != 127.0:
        return None
    amax: Any = div.args[0]
    if not is_call(amax, aten.amax.default) or not last_dim_reduction(amax, meta(normed).dim()):
        return None
    absolute: Any = amax.args[0]
    if not is_call(absolute, aten.abs.default) or absolute.args[0] is not normed:
        return None
    nodes = [absolute, amax, div]
    if any(len(n.users) != 1 for n in nodes):
        return None
    return [*nodes, divisor]


class AddRmsNormDynamicQuantFusion(_ResidualNormFusion):
    """Residual add + RMSNorm + per-token int8 quantisation -> ``devgraph::add_rms_norm_dynamic_quant``."""

    name = op_name = "add_rms_norm_dynamic_quant"

    def _fuse(self, graph: fx.Graph, rms: Any, summed: fx.Node, a: Any, b: Any) -> bool:
        tail = _quant_tail(rms.out)
        if tail is None:
            return False
        q, nodes, divisor = tail
        scale_nodes = _dynamic_scale(rms.out, divisor)
        if scale_nodes is None or meta(divisor).dtype != torch.float32:
            return False
        internal = {*rms.nodes, *nodes, *scale_nodes, summed}
        if not only_users(rms.out, internal):
            return False
        op = torch.ops.devgraph.add_rms_norm_dynamic_quant.default
        return fuse(graph, op, (a, b, rms.weight, rms.eps), (q, divisor, summed), internal) is not None
