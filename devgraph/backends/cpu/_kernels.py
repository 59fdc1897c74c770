"""CPU kernels of the devgraph ops: the reference math of ``devgraph.backends._reference``.

Paged decode attention reads its lengths from the host list ``seq_lens_host``, not from the device
tensor ``seq_lens``, deliberately: that is what the NPU kernel does, so on the CPU reference backend
a captured graph keeps the capture-time lengths until its task is updated, exactly as on an Ascend
device (DESIGN.md, graph contract point 3). Forgetting the update gives stale results here too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from devgraph.backends import _reference

__all__ = ["paged_decode_attention", "register_all"]

KEY = "CPU"


def paged_decode_attention(*args: Any, **kwargs: Any) -> None:
    """The CPU kernel (arguments: ``_reference.PagedAttentionArgs``): attends over ``seq_lens_host``
    tokens per sequence (the last ``sliding_window`` of them where that is > 0), scores soft-capped
    where ``logits_soft_cap`` > 0; ``seq_lens`` is not read."""
    call = _reference.PagedAttentionArgs(*args, **kwargs)
    if len(call.seq_lens_host) != call.query.shape[0]:
        raise ValueError(
            f"devgraph.paged_decode_attention: seq_lens_host must list B = {call.query.shape[0]} lengths on "
            f"the CPU reference backend (it reads the host lengths, like NPU), got {len(call.seq_lens_host)}"
        )
    _reference.paged_decode_attention_host_lens(
        *call[:4], call.seq_lens_host, call.scale, call.out, call.sliding_window, call.logits_soft_cap
    )


def register_all(register: Callable[[str, str, Callable[..., Any]], None]) -> None:
    """Register every CPU kernel: ``register(op_name, "CPU", kernel)``."""
    for name, kernel in _reference.DEVICE_AGNOSTIC_KERNELS.items():
        register(name, KEY, kernel)
    register("paged_decode_attention", KEY, paged_decode_attention)
