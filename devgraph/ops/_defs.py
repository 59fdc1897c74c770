"""Schemas, argument checks and fake impls of the devgraph ops.

A check runs before every kernel (in the registry's trampoline) and inside every fake impl, so bad
arguments fail the same way eagerly, under ``torch.compile`` and under ``make_fx``: a ``ValueError``
that names the argument and the shape it should have. Checks read only metadata (shapes, dtypes,
devices), never tensor values, so they are safe inside graph capture.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from devgraph.ops._registry import define

__all__ = ["SCHEMAS", "define_all"]

#: The schema of every devgraph op, by name.
SCHEMAS = {
    "rms_norm": "rms_norm(Tensor x, Tensor weight, float eps) -> Tensor",
    "add_rms_norm": "add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)",
    "add_rms_norm_quant": (
        "add_rms_norm_quant(Tensor x, Tensor residual, Tensor weight, float eps, Tensor scale) "
        "-> (Tensor, Tensor)"
    ),
    "add_rms_norm_dynamic_quant": (
        "add_rms_norm_dynamic_quant(Tensor x, Tensor residual, Tensor weight, float eps) "
        "-> (Tensor, Tensor, Tensor)"
    ),
    "split_qkv_rms_norm_rope": (
        "split_qkv_rms_norm_rope(Tensor qkv, Tensor q_weight, Tensor k_weight, Tensor cos_sin_cache, "
        "Tensor positions, int num_heads, int num_kv_heads, int head_dim, float eps) "
        "-> (Tensor, Tensor, Tensor)"
    ),
    # `out` is written in place (Tensor(a!)); the op returns nothing. seq_lens is the device tensor
    # (CUDA reads it), seq_lens_host the host list (CPU reference and NPU read it; frozen at capture).
    # sliding_window 0 and logits_soft_cap 0.0 mean none (plain causal attention).
    "paged_decode_attention": (
        "paged_decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table, "
        "Tensor seq_lens, int[] seq_lens_host, float scale, Tensor(a!) out, int sliding_window=0, "
        "float logits_soft_cap=0.0) -> ()"
    ),
}

_INDEX_DTYPES = (torch.int32, torch.int64)


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _fail(op: str, arg: str, expected: str, got: str) -> None:
    raise ValueError(f"devgraph.{op}: {arg} must be {expected}, got {got}")


def _tensor(op: str, arg: str, value: Any, expected: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        _fail(op, arg, f"a tensor {expected}", type(value).__name__)
    return value


def _floating(op: str, arg: str, t: torch.Tensor, expected: str) -> None:
    if not t.is_floating_point():
        _fail(op, arg, f"a floating-point tensor {expected}", f"{t.dtype} {_shape(t)}")


def _same_device(op: str, first: str, ref: torch.Tensor, **others: torch.Tensor) -> None:
    for arg, t in others.items():
        if t.device != ref.device:
            _fail(op, arg, f"on {first}'s device {ref.device}", str(t.device))


def _floating_tensor(op: str, arg: str, value: Any, expected: str, *, dims: int, last: int) -> torch.Tensor:
    """A floating-point tensor ``expected``: ``dims`` dims, the last of size ``last``."""
    t = _tensor(op, arg, value, expected)
    if t.dim() != dims or t.shape[-1] != last:
        _fail(op, arg, expected, _shape(t))
    _floating(op, arg, t, expected)
    return t


def _like(op: str, arg: str, value: Any, first: str, ref: torch.Tensor, note: str) -> torch.Tensor:
    """A tensor of ``ref``'s shape and dtype (``ref`` is argument ``first``; ``note`` says so)."""
    t = _tensor(op, arg, value, f"shaped like {first} {_shape(ref)}")
    if t.shape != ref.shape or t.dtype != ref.dtype:
        _fail(op, arg, f"{ref.dtype} {_shape(ref)} ({note})", f"{t.dtype} {_shape(t)}")
    return t


def _per_sequence(op: str, arg: str, value: Any, dims: int, batch: int, expected: str) -> torch.Tensor:
    """An int32 (or int64) index tensor of ``dims`` dims, one row per sequence (``batch``)."""
    t = _tensor(op, arg, value, expected)
    if t.dim() != dims or t.shape[0] != batch or t.dtype not in _INDEX_DTYPES:
        _fail(op, arg, expected, f"{t.dtype} {_shape(t)}")
    return t


def _check_norm_args(op: str, x: Any, weight: Any, residual: Any = None) -> None:
    x = _tensor(op, "x", x, "[..., H]")
    if x.dim() < 1:
        _fail(op, "x", "a tensor [..., H] with at least one dim", "a 0-d tensor")
    _floating(op, "x", x, "[..., H]")
    hidden = x.shape[-1]
    if residual is not None:
        residual = _like(op, "residual", residual, "x", x, "x's shape and dtype")
        _same_device(op, "x", x, residual=residual)
    weight = _tensor(op, "weight", weight, f"[H] = [{hidden}]")
    if weight.dim() != 1 or weight.shape[0] != hidden:
        _fail(op, "weight", f"[H] = [{hidden}] (x's last dim)", _shape(weight))
    _floating(op, "weight", weight, f"[{hidden}]")
    _same_device(op, "x", x, weight=weight)


def check_rms_norm(x: Any, weight: Any, eps: float) -> None:
    _check_norm_args("rms_norm", x, weight)


def check_add_rms_norm(x: Any, residual: Any, weight: Any, eps: float) -> None:
    _check_norm_args("add_rms_norm", x, weight, residual)


def check_add_rms_norm_quant(x: Any, residual: Any, weight: Any, eps: float, scale: Any) -> None:
    op = "add_rms_norm_quant"
    _check_norm_args(op, x, weight, residual)
    scale = _tensor(op, "scale", scale, "of one float32 element (shape [] or [1])")
    if scale.numel() != 1 or not scale.is_floating_point():
        _fail(op, "scale", "a one-element float32 tensor (shape [] or [1])", f"{scale.dtype} {_shape(scale)}")
    _same_device(op, "x", x, scale=scale)


def check_add_rms_norm_dynamic_quant(x: Any, residual: Any, weight: Any, eps: float) -> None:
    _check_norm_args("add_rms_norm_dynamic_quant", x, weight, residual)


def check_split_qkv_rms_norm_rope(
    qkv: Any,
    q_weight: Any,
    k_weight: Any,
    cos_sin_cache: Any,
    positions: Any,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    eps: float,
) -> None:
    op = "split_qkv_rms_norm_rope"
    if num_heads <= 0 or num_kv_heads <= 0 or head_dim <= 0:
        _fail(
            op, "num_heads, num_kv_heads and head_dim", "positive", f"{num_heads}, {num_kv_heads}, {head_dim}"
        )
    width = (num_heads + 2 * num_kv_heads) * head_dim
    expected = f"[T, (num_heads + 2 * num_kv_heads) * head_dim] = [T, {width}]"
    qkv = _floating_tensor(op, "qkv", qkv, expected, dims=2, last=width)
    tokens = qkv.shape[0]
    for arg, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        w = _tensor(op, arg, w, f"[head_dim] = [{head_dim}]")
        if w.dim() != 1 or w.shape[0] != head_dim:
            _fail(op, arg, f"[head_dim] = [{head_dim}]", _shape(w))
        _floating(op, arg, w, f"[{head_dim}]")
    expected = f"[max_positions, rotary_dim] with an even rotary_dim <= head_dim = {head_dim}"
    cache = _tensor(op, "cos_sin_cache", cos_sin_cache, expected)
    if cache.dim() != 2 or cache.shape[1] % 2 != 0 or cache.shape[1] > head_dim or cache.shape[1] == 0:
        _fail(op, "cos_sin_cache", expected, _shape(cache))
    _floating(op, "cos_sin_cache", cache, expected)
    pos = _tensor(op, "positions", positions, f"int64 [T] = [{tokens}]")
    if pos.dim() != 1 or pos.shape[0] != tokens or pos.dtype not in _INDEX_DTYPES:
        _fail(op, "positions", f"int64 (or int32) [T] = [{tokens}]", f"{pos.dtype} {_shape(pos)}")
    _same_device(op, "qkv", qkv, q_weight=q_weight, k_weight=k_weight, cos_sin_cache=cache, positions=pos)


def check_paged_decode_attention(
    query: Any,
    key_cache: Any,
    value_cache: Any,
    block_table: Any,
    seq_lens: Any,
    seq_lens_host: Sequence[int],
    scale: float,
    out: Any,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
) -> None:
    op = "paged_decode_attention"
    if sliding_window < 0:
        _fail(op, "sliding_window", "a window of at least 1 token, or 0 for none", str(sliding_window))
    if not logits_soft_cap >= 0 or logits_soft_cap == float("inf"):
        _fail(op, "logits_soft_cap", "a finite cap > 0, or 0.0 for none", str(logits_soft_cap))
    query = _tensor(op, "query", query, "[B, Hq, D]")
    if query.dim() != 3:
        _fail(op, "query", "[B, Hq, D] (one decode token per sequence)", _shape(query))
    _floating(op, "query", query, "[B, Hq, D]")
    batch, hq, dim = query.shape
    expected = f"[num_blocks, block_size, Hkv, D = {dim}]"
    key_cache = _floating_tensor(op, "key_cache", key_cache, expected, dims=4, last=dim)
    hkv = key_cache.shape[2]
    if hkv == 0 or hq % hkv != 0:
        _fail(op, "key_cache", f"with Hkv dividing Hq = {hq} (GQA), in {expected}", _shape(key_cache))
    value_cache = _like(op, "value_cache", value_cache, "key_cache", key_cache, "like key_cache")
    block_table = _per_sequence(
        op, "block_table", block_table, 2, batch, f"int32 [B = {batch}, max_blocks_per_seq]"
    )
    seq_lens = _per_sequence(op, "seq_lens", seq_lens, 1, batch, f"int32 [B] = [{batch}]")
    # Empty is allowed: kernels that read the device lengths (CUDA) do not need host ones.
    if len(seq_lens_host) not in (0, batch):
        _fail(
            op,
            "seq_lens_host",
            f"a host list of B = {batch} ints (or empty where unused)",
            f"{len(seq_lens_host)} items",
        )
    out = _tensor(op, "out", out, f"[B, Hq, D] = {_shape(query)}")
    if out.shape != query.shape:
        _fail(op, "out", f"[B, Hq, D] = {_shape(query)} (query's shape)", _shape(out))
    _floating(op, "out", out, _shape(query))
    _same_device(
        op,
        "query",
        query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_table=block_table,
        seq_lens=seq_lens,
        out=out,
    )


# Fake impls: the outputs' metadata only (the shapes and dtypes the reference kernels produce).


def _fake_rms_norm(x, weight, eps):
    check_rms_norm(x, weight, eps)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _fake_add_rms_norm(x, residual, weight, eps):
    check_add_rms_norm(x, residual, weight, eps)
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(
        x, memory_format=torch.contiguous_format
    )


def _fake_add_rms_norm_quant(x, residual, weight, eps, scale):
    check_add_rms_norm_quant(x, residual, weight, eps, scale)
    q = torch.empty_like(x, dtype=torch.int8, memory_format=torch.contiguous_format)
    return q, torch.empty_like(x, memory_format=torch.contiguous_format)


def _fake_add_rms_norm_dynamic_quant(x, residual, weight, eps):
    check_add_rms_norm_dynamic_quant(x, residual, weight, eps)
    q = torch.empty_like(x, dtype=torch.int8, memory_format=torch.contiguous_format)
    scale = x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)
    return q, scale, torch.empty_like(x, memory_format=torch.contiguous_format)


def _fake_split_qkv_rms_norm_rope(
    qkv, q_weight, k_weight, cos_sin_cache, positions, num_heads, num_kv_heads, head_dim, eps
):
    check_split_qkv_rms_norm_rope(
        qkv, q_weight, k_weight, cos_sin_cache, positions, num_heads, num_kv_heads, head_dim, eps
    )
    tokens = qkv.shape[0]
    return (
        qkv.new_empty((tokens, num_heads * head_dim)),
        qkv.new_empty((tokens, num_kv_heads * head_dim)),
        qkv.new_empty((tokens, num_kv_heads * head_dim)),
    )


_FAKES: dict[str, tuple[Callable[..., Any], Callable[..., None]]] = {
    "rms_norm": (_fake_rms_norm, check_rms_norm),
    "add_rms_norm": (_fake_add_rms_norm, check_add_rms_norm),
    "add_rms_norm_quant": (_fake_add_rms_norm_quant, check_add_rms_norm_quant),
    "add_rms_norm_dynamic_quant": (_fake_add_rms_norm_dynamic_quant, check_add_rms_norm_dynamic_quant),
    "split_qkv_rms_norm_rope": (_fake_split_qkv_rms_norm_rope, check_split_qkv_rms_norm_rope),
    # It writes ``out`` in place and returns nothing: its check is all its fake impl has to do.
    "paged_decode_attention": (check_paged_decode_attention, check_paged_decode_attention),
}


def define_all() -> None:
    """Define every devgraph op (idempotent; see ``_registry.define``)."""
    for name, schema in SCHEMAS.items():
        fake, check = _FAKES[name]
        define(name, schema, fake=fake, check=check)
