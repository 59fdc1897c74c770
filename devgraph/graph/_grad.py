"""Backward through what a graph captured: refused by name.

A graph replays the forward work it recorded, nothing of autograd. Tensors autograd saved while a
graph captured in grad mode are the capture's (on CUDA and NPU never even computed: capture records
kernels without running them), not the replay's: a backward after the capture would read them and
give gradients of some other call. ``refuse_backward`` packs every tensor saved during the capture so
that reading it once the capture has ended raises a ``DevgraphError`` that says so, while a backward
inside the capture block (a whole training step captured) reads them as usual. Backward through ops
that save nothing (their gradient does not depend on values) is left alone: it is exact.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from devgraph._errors import DevgraphError

__all__ = ["BACKWARD_REFUSED", "refuse_backward"]

#: What a backward through a captured graph's output says (the runner's outputs say it too).
BACKWARD_REFUSED = (
    "backward through the output of a captured graph: a graph replays its forward work only, and what "
    "autograd saved at capture is not the replay's (on CUDA and NPU it was never computed). Capture "
    "under torch.no_grad() / torch.inference_mode() for inference; for gradients run the model eagerly, "
    "or capture the backward in the same capture block"
)


@contextlib.contextmanager
def refuse_backward() -> Iterator[None]:
    """While the block captures in grad mode, saved tensors are packed so that a backward after the
    block raises ``DevgraphError`` (``BACKWARD_REFUSED``); without grad mode (or where torch has
    saved-tensor hooks disabled, inside a functorch transform) the block runs as it is."""
    import torch

    hooks_enabled = getattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled", lambda: True)
    if not torch.is_grad_enabled() or not hooks_enabled():
        yield
        return
    capturing = [True]

    from torch.utils._python_dispatch import _disable_current_modes

    def pack(t: torch.Tensor) -> Any:
        # Detached: a saved output packed as itself keeps its grad_fn alive, a leak gc never frees.
        # Outside the dispatch modes: the detach is no work of the capture's to record.
        with _disable_current_modes():
            return t.detach()

    def unpack(t: torch.Tensor) -> torch.Tensor:
        if capturing[0]:
            return t  # a backward inside the capture block: captured with the forward
        raise DevgraphError(BACKWARD_REFUSED)

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
    finally:
        capturing[0] = False
