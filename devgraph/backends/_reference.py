"""Reference math of every devgraph op, written with plain torch ops (runs on any device).

The CPU and CUDA backends register these functions (or thin wrappers) as their kernels, and the
tests compare them with float64 arithmetic. Two rules keep them usable inside graph capture:

* nothing reads a device value on the host (no ``.item()``, ``.tolist()``, ``bool(tensor)``), and
* output shapes depend only on input shapes and host arguments, never on tensor contents.

``paged_decode_attention_host_lens`` breaks neither rule but takes its lengths from a *host list*,
which a captured graph freezes (the NPU semantics). ``paged_decode_attention_device_lens`` reads a
*device tensor* of lengths and masks over the whole block table (the CUDA semantics), so it replays
correctly with new lengths written into that tensor; the CUDA backend computes the same over the
blocks in use only (``devgraph.backends.cuda._paged_attention``), and tests and the benchmark
compare the two.

Precision: reductions and softmax run in float32 whatever the input dtype; results are cast back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

__all__ = [
    "add_rms_norm",
    "add_rms_norm_dynamic_quant",
    "add_rms_norm_quant",
    "PagedAttentionArgs",
    "gather_block_table",
    "paged_decode_attention_device_lens",
    "paged_decode_attention_host_lens",
    "quantize_int8_dynamic",
    "quantize_int8_static",
    "rms_norm",
    "rope_neox",
    "rotary_neox",
    "split_qkv_rms_norm_rope",
]

#: Smallest per-token scale of dynamic quantisation, so an all-zero row gives q = 0, not NaN.
MIN_DYNAMIC_SCALE = 1e-10


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x**2, -1) + eps) * weight`` over the last dim, in ``x``'s dtype."""
    xf = x.float()
    inv = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    # Contiguous whatever x's strides: the fake impl promises contiguous outputs.
    return (xf * inv * weight.float()).to(x.dtype).contiguous()


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``: the residual add then RMSNorm of a decoder layer.

    The sum is taken in float32 and normalised before rounding (as vLLM's fused kernel does); the
    returned residual is that sum cast to ``x``'s dtype.
    """
    summed = (x.float() + residual.float()).contiguous()
    inv = torch.rsqrt(summed.pow(2).mean(dim=-1, keepdim=True) + eps)
    normed = (summed * inv * weight.float()).to(x.dtype)
    return normed, summed.to(x.dtype)


def quantize_int8_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per-tensor int8: ``clamp(round(x / scale), -128, 127)`` (round half to even), in float32."""
    return torch.clamp(torch.round(x.float() / scale.float()), -128, 127).to(torch.int8)


def quantize_int8_dynamic(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token int8: ``scale = amax(|x|, -1) / 127`` (shape ``[..., 1]``, float32) and ``q``."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / 127.0).clamp(min=MIN_DYNAMIC_SCALE)
    q = torch.clamp(torch.round(xf / scale), -128, 127).to(torch.int8)
    return q, scale


def add_rms_norm_quant(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(quantize_int8_static(normed, scale), x + residual)`` with ``normed, _ = add_rms_norm(...)``.

    ``normed`` is rounded to ``x``'s dtype before quantising, so the fused op equals the unfused
    chain ``add_rms_norm`` -> static quant bit for bit (what a fusion pass needs).
    """
    normed, summed = add_rms_norm(x, residual, weight, eps)
    return quantize_int8_static(normed, scale), summed


def add_rms_norm_dynamic_quant(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, per-token scale [..., 1] float32, x + residual)``; see ``add_rms_norm_quant``."""
    normed, summed = add_rms_norm(x, residual, weight, eps)
    q, scale = quantize_int8_dynamic(normed)
    return q, scale, summed


def rotary_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotary embedding of ``x[T, H, D]`` with ``cos``/``sin`` of shape ``[T, R/2]``.

    The first ``R`` dims of every head rotate (``rotate_half``: pairs ``(i, i + R/2)``); the rest,
    when ``R < D`` (partial rotary), pass through. Computed in float32, returned in ``x``'s dtype.
    """
    half = cos.shape[-1]
    rot = 2 * half
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:rot]
    c = cos.float().unsqueeze(-2)  # [T, 1, R/2]: the same angle for every head
    s = sin.float().unsqueeze(-2)
    out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, xf[..., rot:]], dim=-1)
    return out.to(x.dtype)


def rope_neox(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotary_neox`` of ``q[T, Hq, D]`` and of ``k[T, Hkv, D]`` with the same angles."""
    return rotary_neox(q, cos, sin), rotary_neox(k, cos, sin)


def split_qkv_rms_norm_rope(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    eps: float,
    *,
    norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] = rms_norm,
    rope: Callable[..., tuple[torch.Tensor, torch.Tensor]] = rope_neox,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split ``qkv[T, (Hq + 2 Hkv) * D]``, RMSNorm q and k per head, then neox rotary on q and k.

    ``cos_sin_cache[max_pos, R]`` holds ``cos`` in its first half and ``sin`` in its second
    (``R == D`` normally, ``R < D`` for partial rotary). Returns contiguous
    ``(q[T, Hq * D], k[T, Hkv * D], v[T, Hkv * D])`` in ``qkv``'s dtype. ``norm`` (``rms_norm``'s
    arguments) and ``rope`` (``rope_neox``'s) are the steps a backend's kernel may do its own way
    (NPU: torch_npu's ops); the split, the gather of the angles and the layout stay these.
    """
    tokens = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = norm(q.reshape(tokens, num_heads, head_dim), q_weight, eps)
    k = norm(k.reshape(tokens, num_kv_heads, head_dim), k_weight, eps)
    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)  # [T, R / 2]
    q, k = rope(q, k, cos, sin)
    return (
        q.reshape(tokens, num_heads * head_dim),
        k.reshape(tokens, num_kv_heads * head_dim),
        v.clone(memory_format=torch.contiguous_format),  # never an alias of qkv
    )


class PagedAttentionArgs(NamedTuple):
    """The arguments of ``devgraph::paged_decode_attention`` as every backend's kernel receives them.

    The op's schema order (``devgraph.ops._defs.SCHEMAS``): a kernel takes ``*args, **kwargs`` and
    reads them through this, so the one argument list is written once. ``seq_lens`` is the device
    tensor of lengths (CUDA reads it), ``seq_lens_host`` the host list (the CPU reference and NPU
    read it); ``sliding_window`` 0 and ``logits_soft_cap`` 0.0 mean none.
    """

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_host: Sequence[int]
    scale: float
    out: torch.Tensor
    sliding_window: int = 0
    logits_soft_cap: float = 0.0


def _attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None,
    logits_soft_cap: float = 0.0,
):
    """Decode attention of ``query[..., Hq, D]`` over ``keys/values[..., S, Hkv, D]`` (GQA), float32.

    ``mask[..., S]`` (True = attend) may be None. A query with nothing to attend to gets zeros.
    ``logits_soft_cap`` > 0 caps the scaled scores, ``cap * tanh(score / cap)``, before masking and
    softmax (Gemma2's attention soft-capping, as vLLM's attention backends apply it).
    """
    hq, d = query.shape[-2], query.shape[-1]
    hkv = keys.shape[-2]
    q = query.float().reshape(*query.shape[:-2], hkv, hq // hkv, d)  # [..., Hkv, G, D]
    scores = torch.einsum("...hgd,...shd->...hgs", q, keys.float()) * scale
    if logits_soft_cap > 0:
        scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
    if mask is not None:
        allowed = mask[..., None, None, :]  # broadcast over Hkv and G
        scores = scores.masked_fill(~allowed, float("-inf"))
        # A row with every position masked softmaxes to NaN; zero it (the masked_fill covers it).
        probs = torch.softmax(scores, dim=-1).masked_fill(~allowed, 0.0)
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("...hgs,...shd->...hgd", probs, values.float())
    return out.reshape(*query.shape[:-2], hq, d)


def paged_decode_attention_host_lens(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens_host: Sequence[int],
    scale: float,
    out: torch.Tensor,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
) -> None:
    """Paged decode attention reading the lengths from a host list (NPU semantics); writes ``out``.

    Only the blocks each sequence uses are gathered. Inside a captured graph the list is frozen,
    so replays keep the capture-time lengths unless the task is updated (DESIGN.md, point 3).
    ``sliding_window`` > 0: the query (the token at position ``length - 1``) attends to the last
    ``sliding_window`` tokens only, itself included (vLLM's and Hugging Face's convention); blocks
    wholly before the window are not read (an engine may have freed them). ``logits_soft_cap``: see
    ``_attend``.
    """
    block_size = key_cache.shape[1]
    capacity = block_table.shape[1] * block_size
    for b, length in enumerate(seq_lens_host):
        length = int(length)
        if length > capacity:
            raise ValueError(
                f"seq_lens_host[{b}] = {length} exceeds the block table's capacity "
                f"(max_blocks_per_seq * block_size = {capacity}); widen block_table"
            )
        if length <= 0:
            out[b].zero_()
            continue
        start = max(0, length - sliding_window) if sliding_window > 0 else 0
        first = start // block_size
        blocks = block_table[b, first : -(-length // block_size)]
        keys = key_cache.index_select(0, blocks).flatten(0, 1)  # [positions first * block_size.., Hkv, D]
        values = value_cache.index_select(0, blocks).flatten(0, 1)
        lo, hi = start - first * block_size, length - first * block_size
        out[b].copy_(_attend(query[b], keys[lo:hi], values[lo:hi], scale, None, logits_soft_cap))


def gather_block_table(
    key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every block of every sequence's table, gathered: keys and values ``[B, max_blocks * block_size, Hkv, D]``.

    Table entries past a sequence's blocks may hold any value (padding): they are clamped into
    range, and the caller masks the positions they give.
    """
    batch, max_blocks = block_table.shape
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
    ids = block_table.clamp(0, num_blocks - 1).reshape(-1).to(torch.int64)
    span = max_blocks * block_size
    keys = key_cache.index_select(0, ids).reshape(batch, span, *key_cache.shape[2:])
    values = value_cache.index_select(0, ids).reshape(batch, span, *value_cache.shape[2:])
    return keys, values


def paged_decode_attention_device_lens(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
) -> None:
    """Paged decode attention reading the lengths from a device tensor (CUDA semantics); writes ``out``.

    Gathers every block of the table (``max_blocks * block_size`` positions per sequence) and masks
    positions at or beyond ``seq_lens[b]``: fixed shapes, no host reads, so it is capture-safe and a
    replay sees whatever lengths were last copied into ``seq_lens``. Table entries past a sequence's
    length may hold any value (padding); they are clamped into range and masked. ``sliding_window``
    and ``logits_soft_cap`` as in ``paged_decode_attention_host_lens`` (the window masks positions
    before ``seq_lens[b] - sliding_window``; those must hold finite values, as padding does).
    """
    keys, values = gather_block_table(key_cache, value_cache, block_table)
    positions = torch.arange(keys.shape[1], device=seq_lens.device)
    lengths = seq_lens.to(torch.int64)[:, None]
    mask = positions[None, :] < lengths  # [B, S]
    if sliding_window > 0:
        mask = mask & (positions[None, :] >= lengths - sliding_window)
    out.copy_(_attend(query, keys, values, scale, mask, logits_soft_cap))


#: Ops whose reference math serves as a kernel unchanged on any torch device (the CPU and CUDA
#: backends register these; attention differs per backend in where it reads the lengths).
DEVICE_AGNOSTIC_KERNELS: dict[str, Callable[..., Any]] = {
    "rms_norm": rms_norm,
    "add_rms_norm": add_rms_norm,
    "add_rms_norm_quant": add_rms_norm_quant,
    "add_rms_norm_dynamic_quant": add_rms_norm_dynamic_quant,
    "split_qkv_rms_norm_rope": split_qkv_rms_norm_rope,
}
