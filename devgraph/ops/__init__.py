"""devgraph's custom ops: one ``torch.library`` definition each, kernels per backend, fake impls.

Importing this package defines the ops under ``torch.ops.devgraph`` and collects kernels from the
backends (``load()``); ``import devgraph`` alone does not import it. The functions here are the
functional forms; ``torch.ops.devgraph.<op>`` is the raw op (what graphs and passes see).

Kernels per dispatch key: ``CPU`` (the reference backend), ``CUDA``, ``PrivateUse1`` (NPU). Paged
attention reads its lengths differently per backend, on purpose: the CPU reference and NPU kernels
read the host list ``seq_lens_host`` (frozen in a captured graph unless its task is updated), the
CUDA kernel reads the device tensor ``seq_lens``. Pass both.

``route(CPU="PrivateUse1")`` runs CPU-tensor calls with the NPU kernels (the torch_npu
simulator's seam; see ``devgraph.ops._registry``).

Every op checks its arguments before running and while tracing: a bad shape or dtype raises
``ValueError`` naming the argument and the shape expected.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from devgraph.ops._load import load
from devgraph.ops._registry import has_kernel, kernel_for, op_names, route

__all__ = [
    "add_rms_norm",
    "add_rms_norm_dynamic_quant",
    "add_rms_norm_quant",
    "has_kernel",
    "kernel_for",
    "load",
    "op_names",
    "paged_decode_attention",
    "rms_norm",
    "route",
    "split_qkv_rms_norm_rope",
    "unsupported_arguments",
]


def unsupported_arguments(op: str, key: str) -> tuple[str, ...]:
    """Arguments of ``op`` that the kernel registered for dispatch key ``key`` refuses when set.

    Empty when the kernel implements every argument. A kernel declares its gaps in its
    ``unsupported_arguments`` attribute (the NPU attention kernel: ``sliding_window`` and
    ``logits_soft_cap``), so an engine adapter can refuse a model at start rather than at its
    first forward. Raises ``DevgraphError`` where no kernel is registered for ``key``.
    """
    return tuple(getattr(kernel_for(op, key), "unsupported_arguments", ()))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: ``x / sqrt(mean(x**2) + eps) * weight`` (``x[..., H]``, ``weight[H]``)."""
    return torch.ops.devgraph.rms_norm.default(x, weight, float(eps))


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm: returns ``(rms_norm(x + residual), x + residual)``."""
    return torch.ops.devgraph.add_rms_norm.default(x, residual, weight, float(eps))


def add_rms_norm_quant(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_rms_norm`` then static per-tensor int8 quantisation of the normed output.

    Returns ``(q, x + residual)`` with ``q = clamp(round(normed / scale), -128, 127)`` (int8);
    ``scale`` is a one-element float32 tensor. ``normed`` is rounded to ``x``'s dtype first, so
    this equals ``add_rms_norm`` followed by the quantisation bit for bit.
    """
    return torch.ops.devgraph.add_rms_norm_quant.default(x, residual, weight, float(eps), scale)


def add_rms_norm_dynamic_quant(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``add_rms_norm`` then per-token int8 quantisation: returns ``(q, scale[..., 1] fp32, x + residual)``.

    ``scale = amax(|normed|, -1) / 127`` (at least 1e-10, so an all-zero row gives q = 0).
    """
    return torch.ops.devgraph.add_rms_norm_dynamic_quant.default(x, residual, weight, float(eps))


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split ``qkv[T, (Hq + 2 Hkv) * D]``, RMSNorm q and k per head, apply neox rotary to q and k.

    ``cos_sin_cache[max_pos, D]`` holds cos in its first half and sin in its second;
    ``positions[T]`` (int64) index it. Returns ``(q[T, Hq * D], k[T, Hkv * D], v[T, Hkv * D])``.
    """
    return torch.ops.devgraph.split_qkv_rms_norm_rope.default(
        qkv,
        q_weight,
        k_weight,
        cos_sin_cache,
        positions,
        int(num_heads),
        int(num_kv_heads),
        int(head_dim),
        float(eps),
    )


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_host: Sequence[int] | None,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Decode attention of one query token per sequence over a paged KV cache; returns ``out``.

    Args:
        query: ``[B, Hq, D]``.
        key_cache, value_cache: ``[num_blocks, block_size, Hkv, D]``; ``Hq`` a multiple of ``Hkv``.
            Token ``t`` of sequence ``b`` is at block ``block_table[b, t // block_size]``, offset
            ``t % block_size``.
        block_table: ``[B, max_blocks_per_seq]`` int32.
        seq_lens: ``[B]`` int32 on the device: the lengths the CUDA kernel reads.
        seq_lens_host: the same lengths as a host list: what the CPU reference and NPU kernels read.
            In a captured graph it is frozen; update the task to change it. ``None`` (or ``[]``) only
            where the kernel reads ``seq_lens`` (CUDA).
        scale: softmax scale, ``D ** -0.5`` by default.
        out: ``[B, Hq, D]`` written in place; allocated like ``query`` when None.
        sliding_window: attend to the last ``sliding_window`` tokens only, the query's own included
            (sequence ``b`` sees positions ``seq_lens[b] - sliding_window .. seq_lens[b] - 1``: the
            convention of vLLM's attention and of Hugging Face's ``sliding_window``). None or 0: the
            whole sequence.
        logits_soft_cap: cap the scaled scores ``s`` to ``cap * tanh(s / cap)`` before the softmax
            (Gemma2's ``attn_logit_softcapping``). None or 0.0: no cap.

    Raises:
        ValueError: an argument has the wrong shape or dtype (the message names it), or the
            device's kernel does not implement a window or a soft cap (NPU: it says so).
    """
    if isinstance(seq_lens_host, torch.Tensor):
        raise ValueError(
            "devgraph.paged_decode_attention: seq_lens_host must be a host list of ints, got a tensor; "
            "compute it before capture (seq_lens.tolist() outside the captured region)"
        )
    if scale is None:
        scale = query.shape[-1] ** -0.5
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    torch.ops.devgraph.paged_decode_attention.default(
        query,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        [] if seq_lens_host is None else list(seq_lens_host),
        float(scale),
        out,
        int(sliding_window or 0),
        float(logits_soft_cap or 0.0),
    )
    return out


load()
