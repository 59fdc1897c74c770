"""Mixture-of-experts layers in the piecewise prefill: the experts run as eager runs them.

transformers' default experts implementation (``grouped_mm``) sorts each token's chosen experts and
runs one grouped matmul over per-expert offsets. Eager calls ``torch._grouped_mm`` (the offsets stay
on the device); under ``torch.compile`` with weights other than bf16 it calls its own custom op
``transformers::grouped_mm_fallback`` instead, whose Python body reads the offsets on the host
(``offs.tolist()``) and slices the tokens per expert. Inside a captured piece that read happens once,
at capture: every replay would route the tokens as the capture's did (prefill logits 0.01-0.1 off,
other tokens generated, no error). ``GroupedMmRouting`` rewrites the traced graph back to the op eager
runs (``torch._grouped_mm``, behind ``devgraph_hf::grouped_mm``: torch's fake kernel of
``_grouped_mm`` accepts bf16 only, its CPU and CUDA kernels every float type), so the routing is
computed on the device at every replay, bitwise as eager computes it; where eager would not use
``torch._grouped_mm`` either, it refuses the trace, naming the op.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from devgraph._errors import DevgraphError
from devgraph.compile.passes import Pass

__all__ = ["GroupedMmRouting", "eager_uses_grouped_mm"]

#: The custom op transformers traces in place of ``torch._grouped_mm`` (same arguments, same result).
FALLBACK_OP = "transformers::grouped_mm_fallback"


def eager_uses_grouped_mm(model: Any) -> bool:
    """Whether ``model``'s experts, run eagerly on its device and dtype, call ``torch._grouped_mm``.

    Asks transformers' own rule (``_can_use_grouped_mm``, outside any compile); False when this
    transformers has no such rule (the fallback op is then refused, never rewritten).
    """
    try:
        from transformers.integrations.moe import _can_use_grouped_mm
    except ImportError:
        return False
    weight = next(model.parameters())
    dtype = weight.dtype if weight.is_floating_point() else torch.float32
    x = torch.zeros(2, 16, dtype=dtype, device=weight.device)
    w = torch.zeros(2, 16, 16, dtype=dtype, device=weight.device)
    offs = torch.tensor([1, 2], dtype=torch.int32, device=weight.device)
    try:
        return bool(_can_use_grouped_mm(x, w, offs))
    except Exception:  # a rule that needs what this probe lacks: do not guess
        return False


_OP: Any = None


def grouped_mm_op() -> Any:
    """``devgraph_hf::grouped_mm(x, w, offs)``: ``torch._grouped_mm(x, w, offs=offs)`` with a fake kernel
    for every dtype (registered on first use)."""
    global _OP
    if _OP is None:

        @torch.library.custom_op("devgraph_hf::grouped_mm", mutates_args=())
        def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
            return torch._grouped_mm(x, w, offs=offs)

        @grouped_mm.register_fake
        def _(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
            return x.new_empty(x.shape[0], w.shape[-1])

        _OP = torch.ops.devgraph_hf.grouped_mm.default
    return _OP


def _op_name(target: Any) -> str | None:
    """``ns::name`` of a custom op an FX node calls: an overload (an aten-level graph, the pieces') or
    the packet (a Dynamo graph, the decode step's)."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return None


class GroupedMmRouting(Pass):
    """Replace ``transformers::grouped_mm_fallback(x, w, offs)`` by ``torch._grouped_mm(x, w, offs=offs)``.

    Args:
        eager_grouped_mm: whether eager runs ``torch._grouped_mm`` here (``eager_uses_grouped_mm``);
            when it does not, a graph holding the fallback op is refused (``DevgraphError``).
    """

    name = "hf_grouped_mm_routing"
    version = 1

    def __init__(self, eager_grouped_mm: bool) -> None:
        self.eager_grouped_mm = eager_grouped_mm

    def __call__(self, graph: fx.Graph) -> int:
        count = 0
        for node in list(graph.nodes):
            if node.op != "call_function" or _op_name(node.target) != FALLBACK_OP:
                continue
            if not self.eager_grouped_mm:
                raise DevgraphError(
                    f"devgraph cannot capture {FALLBACK_OP} (the mixture-of-experts layers' grouped "
                    "matmul as transformers traces it): its Python body reads the expert offsets on the host "
                    "(offs.tolist()), so a graph would replay the routing of capture time, and eager "
                    "on this device and dtype does not run torch._grouped_mm, which devgraph would use "
                    "instead. Use bf16 weights, or model.config._experts_implementation = 'batched_mm'"
                )
            x, w, offs = [*node.args, node.kwargs.get("offs")][:3]
            node.target = grouped_mm_op()
            node.args = (x, w, offs)
            node.kwargs = {}
            count += 1
        return count
