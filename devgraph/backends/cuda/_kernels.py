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

from collections.abc import Callable
from typing import Any

from devgraph.backends import _reference
from devgraph.backends.cuda import _paged_attention

__all__ = ["paged_decode_attention", "register_all"]

KEY = "CUDA"


def paged_decode_attention(*args: Any, **kwargs: Any) -> None:
    """The CUDA kernel (arguments: ``_reference.PagedAttentionArgs``): attends over ``seq_lens``
    (device) tokens per sequence; the host list is unused.

    Device-agnostic torch code, so tests run it on CPU tensors too: compiled flex on CUDA where
    ``_paged_attention.flex_supported``, eager flex elsewhere (CPU tests of the same block mask),
    the SDPA window otherwise (see ``_paged_attention`` for the paths and their cost). With a
    sliding window or a soft cap it runs the reference device-length math (whole block table,
    float32, masked: capture-safe, not tuned for speed).
    """
    call = _reference.PagedAttentionArgs(*args, **kwargs)
    if call.sliding_window > 0 or call.logits_soft_cap > 0:
        _reference.paged_decode_attention_device_lens(
            *call[:5], call.scale, call.out, call.sliding_window, call.logits_soft_cap
        )
    elif _paged_attention.flex_supported(call.query, call.key_cache):
        _paged_attention.flex_decode(call, compiled=call.query.device.type == "cuda")
    else:
        _paged_attention.window_decode(call)


def register_all(register: Callable[[str, str, Callable[..., Any]], None]) -> None:
    """Register every CUDA kernel: ``register(op_name, "CUDA", kernel)``."""
    for name, kernel in _reference.DEVICE_AGNOSTIC_KERNELS.items():
        register(name, KEY, kernel)
    register("paged_decode_attention", KEY, paged_decode_attention)
