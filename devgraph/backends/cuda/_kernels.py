"""CUDA kernels of the devgraph ops, written to be CUDA-graph-capture safe.

They are plain torch ops (no custom CUDA code): fixed output shapes, no host reads of device values.
The norms and RoPE are the reference math. Paged decode attention is flex attention over the cache
blocks each sequence uses (``_paged_attention``; an SDPA over the block table where flex does not
apply), reading its lengths from the *device* tensor ``seq_lens`` and ignoring ``seq_lens_host``:
a captured graph then replays with whatever lengths were last copied into ``seq_lens``, so on CUDA
the task update of attention is a no-op. A faster kernel (FlashInfer, flash-attn) can replace one
through the same hook: the last ``register`` of a key wins, so a plugin doing that marks its
hookimpl ``trylast=True`` (pluggy calls it last).

Nothing here touches ``torch.cuda`` at import or registration, so registering these kernels works
on a CPU-only torch build too (the dispatcher accepts a ``CUDA`` kernel without a CUDA runtime).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from devgraph.backends import _reference
from devgraph.backends.cuda import _paged_attention

__all__ = ["paged_decode_attention", "register_all"]

KEY = "CUDA"


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
    """The CUDA kernel: attends over ``seq_lens`` (device) tokens per sequence; the host list is unused.

    Device-agnostic torch code, so tests run it on CPU tensors too (flex eagerly there; see
    ``_paged_attention`` for the paths and their cost). With a sliding window or a soft cap it
    runs the reference device-length math (whole block table, float32, masked: capture-safe, not
    tuned for speed).
    """
    if sliding_window > 0 or logits_soft_cap > 0:
        _reference.paged_decode_attention_device_lens(
            query, key_cache, value_cache, block_table, seq_lens, scale, out, sliding_window, logits_soft_cap
        )
        return
    _paged_attention.paged_decode_attention(query, key_cache, value_cache, block_table, seq_lens, scale, out)


def register_all(register: Callable[[str, str, Callable[..., Any]], None]) -> None:
    """Register every CUDA kernel: ``register(op_name, "CUDA", kernel)``."""
    for name, kernel in _reference.DEVICE_AGNOSTIC_KERNELS.items():
        register(name, KEY, kernel)
    register("paged_decode_attention", KEY, paged_decode_attention)
