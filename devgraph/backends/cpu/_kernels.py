"""CPU kernels of the devgraph ops: the reference math of ``devgraph.backends._reference``.

Paged decode attention reads its lengths from the host list ``seq_lens_host``, not from the device
tensor ``seq_lens``, deliberately: that is what the NPU kernel does, so on the CPU reference backend
a captured graph keeps the capture-time lengths until its task is updated, exactly as on an Ascend
device (DESIGN.md, graph contract point 3). Forgetting the update gives stale results here too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from devgraph.backends import _reference

__all__ = ["paged_decode_attention", "register_all"]

KEY = "CPU"


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_host: Sequence[int],
    scale: float,
    out: torch.Tensor,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
) -> None:
    """The CPU kernel: attends over ``seq_lens_host`` tokens per sequence (the last ``sliding_window``
    of them where that is > 0), scores soft-capped where ``logits_soft_cap`` > 0; ``seq_lens`` is not
    read."""
    if len(seq_lens_host) != query.shape[0]:
        raise ValueError(
            f"devgraph.paged_decode_attention: seq_lens_host must list B = {query.shape[0]} lengths on "
            f"the CPU reference backend (it reads the host lengths, like NPU), got {len(seq_lens_host)}"
        )
    _reference.paged_decode_attention_host_lens(
        query, key_cache, value_cache, block_table, seq_lens_host, scale, out, sliding_window, logits_soft_cap
    )


def register_all(register: Callable[[str, str, Callable[..., Any]], None]) -> None:
    """Register every CPU kernel: ``register(op_name, "CPU", kernel)``."""
    for name, kernel in _reference.DEVICE_AGNOSTIC_KERNELS.items():
        register(name, KEY, kernel)
    register("paged_decode_attention", KEY, paged_decode_attention)
