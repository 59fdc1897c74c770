"""A call served from graphs in grad mode: outputs that require grad as eager's do, backward refused.

A runner replays graphs without autograd, so its outputs carry no autograd graph. Handed back as
they are, they would say ``requires_grad=False`` where eager's say True, and the caller's
``loss.backward()`` would fail with torch's "does not require grad". ``for_grad`` hands them back
through one autograd node tied to a tensor that requires grad (an input or a parameter of the model):
``requires_grad`` is eager's, and a backward reaching that node raises a ``DevgraphError`` saying what
to do. The outputs stay views of graph memory (writable in place, as eager's).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from devgraph._errors import DevgraphError

__all__ = ["SERVED_BACKWARD", "for_grad"]

#: What a backward through an output served from graphs says.
SERVED_BACKWARD = (
    "backward through an output that devgraph served from a captured graph: graphs replay the forward "
    "only and record no autograd graph, so there are no gradients to give. For gradients call the model "
    "itself (graphed.module(...)); for inference call the wrapper under torch.no_grad() or "
    "torch.inference_mode()"
)


class _ServedFromGraph(torch.autograd.Function):
    """Outputs as they are (aliases, not copies), behind a node whose backward refuses by name."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, *outputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(o.detach() for o in outputs)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise DevgraphError(SERVED_BACKWARD)


def _differentiable(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def for_grad(out: Any, anchor: torch.Tensor) -> Any:
    """``out`` with every floating tensor requiring grad through a node tied to ``anchor`` (a tensor
    that requires grad), whose backward raises ``DevgraphError`` (``SERVED_BACKWARD``). Integer
    outputs stay as they are (eager's do not require grad). Call it with grad mode on."""
    if isinstance(out, torch.Tensor):  # the common case, without flattening a tree
        return _ServedFromGraph.apply(anchor, out)[0] if _differentiable(out) else out
    leaves, spec = tree_flatten(out)
    where = [i for i, leaf in enumerate(leaves) if _differentiable(leaf)]
    if not where:
        return out
    for i, t in zip(where, _ServedFromGraph.apply(anchor, *(leaves[i] for i in where))):
        leaves[i] = t
    return tree_unflatten(leaves, spec)
