"""Tiny models written the way real ones are, for the fusion-pass tests.

* ``TinyLlama``: a Hugging Face-style Llama (``LlamaRMSNorm`` verbatim, residual add before each
  norm, separate q/k/v projections, ``rotate_half`` RoPE, causal SDPA). ``quant="static"`` or
  ``"dynamic"`` adds W8A8-style int8 quantisation of every norm output that feeds a projection
  (static per-tensor scale, or per-token dynamic scale), written as quantisation kernels' reference
  code writes it.
* ``TinyQwen3``: a vLLM-style Qwen3 (fused QKV projection split in three, per-head q/k RMSNorm,
  neox RoPE from a ``cos_sin_cache`` as ``RotaryEmbedding.forward_native`` does it, causal SDPA).

Both take the tokens of one sequence as rows: ``forward(input_ids[T]) -> logits[T, vocab]`` (and
``positions[T]`` for Qwen3). Expected pass matches for ``L`` layers: ``add_rms_norm`` 2L (the
post-attention norm of every layer, the input norm of layers 1.., the final norm) on both; with
quantisation ``2L - 1`` quant fusions and 1 plain one (the final norm is not quantised);
``split_qkv_rms_norm_rope`` L on Qwen3.
"""

from __future__ import annotations

import attrs
import torch
from torch import nn
from torch.nn import functional as F

from devgraph.testing.models import init_weights

__all__ = ["FusionConfig", "HFRMSNorm", "TinyLlama", "TinyQwen3", "make_tiny_llama", "make_tiny_qwen3"]


@attrs.frozen
class FusionConfig:
    """Sizes of the tiny models (``head_dim`` explicit, as in Qwen3; ``rotary_dim`` < head_dim allowed)."""

    vocab_size: int = 64
    hidden_size: int = 32
    intermediate_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 8
    rotary_dim: int | None = None
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_positions: int = 128
    quant: str | None = None  # None, "static" or "dynamic"
    dtype: torch.dtype = torch.float32

    @property
    def rot(self) -> int:
        return self.rotary_dim or self.head_dim


class HFRMSNorm(nn.Module):
    """``transformers``' ``LlamaRMSNorm`` / ``Qwen3RMSNorm``, verbatim."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class _Quant(nn.Module):
    """int8 activation quantisation + dequantisation before a projection (fake-quant W8A8)."""

    scale: torch.Tensor

    def __init__(self, mode: str | None) -> None:
        super().__init__()
        self.mode = mode
        self.register_buffer("scale", torch.tensor([0.02]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode is None:
            return x
        if self.mode == "static":
            q = torch.clamp(torch.round(x / self.scale), -128, 127).to(torch.int8)
            return q.to(x.dtype) * self.scale
        scale = (x.abs().amax(dim=-1, keepdim=True) / 127.0).clamp(min=1e-10)
        q = torch.clamp(torch.round(x / scale), -128, 127).to(torch.int8)
        return q.to(x.dtype) * scale


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_kv_heads: int
) -> torch.Tensor:
    """Causal attention of one sequence: ``q[T, Hq, D]``, ``k/v[T, Hkv, D]`` -> ``[T, Hq * D]``."""
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    )
    return out.transpose(0, 1).reshape(q.shape[0], -1)


class _MLP(nn.Module):
    def __init__(self, c: FusionConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _LlamaLayer(nn.Module):
    def __init__(self, c: FusionConfig) -> None:
        super().__init__()
        self.c = c
        self.input_layernorm = HFRMSNorm(c.hidden_size, c.rms_eps)
        self.input_quant = _Quant(c.quant)
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.post_attention_layernorm = HFRMSNorm(c.hidden_size, c.rms_eps)
        self.post_quant = _Quant(c.quant)
        self.mlp = _MLP(c)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c = self.c
        residual = hidden
        hidden = self.input_quant(self.input_layernorm(hidden))
        q = self.q_proj(hidden).view(-1, c.num_heads, c.head_dim)
        k = self.k_proj(hidden).view(-1, c.num_kv_heads, c.head_dim)
        v = self.v_proj(hidden).view(-1, c.num_kv_heads, c.head_dim)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        hidden = self.o_proj(_attend(q, k, v, c.num_heads, c.num_kv_heads))
        hidden = residual + hidden
        residual = hidden
        hidden = self.post_quant(self.post_attention_layernorm(hidden))
        return residual + self.mlp(hidden)


class TinyLlama(nn.Module):
    """A Hugging Face-style Llama over the tokens of one sequence (see the module docstring)."""

    inv_freq: torch.Tensor

    def __init__(self, config: FusionConfig | None = None) -> None:
        super().__init__()
        self.config = c = config or FusionConfig()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(_LlamaLayer(c) for _ in range(c.num_layers))
        self.norm = HFRMSNorm(c.hidden_size, c.rms_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        positions = torch.arange(input_ids.shape[0], device=input_ids.device, dtype=torch.float32)
        freqs = torch.outer(positions, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().unsqueeze(1).to(hidden.dtype), emb.sin().unsqueeze(1).to(hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin)
        return self.lm_head(self.norm(hidden))


class _RotaryEmbedding(nn.Module):
    """vLLM's neox ``RotaryEmbedding`` (``forward_native``), with a ``cos_sin_cache[max_pos, rot]``."""

    cos_sin_cache: torch.Tensor

    def __init__(self, head_size: int, rotary_dim: int, max_positions: int, base: float) -> None:
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
        freqs = torch.einsum("i,j -> ij", torch.arange(max_positions, dtype=torch.float), inv_freq)
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1), persistent=False)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cos = cos.unsqueeze(-2).to(x.dtype)
        sin = sin.unsqueeze(-2).to(x.dtype)
        x1, x2 = torch.chunk(x, 2, dim=-1)
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        return torch.cat((o1, o2), dim=-1)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        positions = positions.flatten()
        num_tokens = positions.shape[0]
        cos_sin = self.cos_sin_cache.index_select(0, positions)
        cos, sin = cos_sin.chunk(2, dim=-1)
        query_shape = query.shape
        query = query.view(num_tokens, -1, self.head_size)
        query_rot = query[..., : self.rotary_dim]
        query_pass = query[..., self.rotary_dim :]
        query_rot = self._rotate(query_rot, cos, sin)
        query = torch.cat((query_rot, query_pass), dim=-1).reshape(query_shape)
        key_shape = key.shape
        key = key.view(num_tokens, -1, self.head_size)
        key_rot = key[..., : self.rotary_dim]
        key_pass = key[..., self.rotary_dim :]
        key_rot = self._rotate(key_rot, cos, sin)
        key = torch.cat((key_rot, key_pass), dim=-1).reshape(key_shape)
        return query, key


class _Qwen3Attention(nn.Module):
    """vLLM's ``Qwen3Attention.forward`` up to the attention op (dense causal SDPA here)."""

    def __init__(self, c: FusionConfig) -> None:
        super().__init__()
        self.c = c
        self.head_dim = c.head_dim
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.qkv_proj = nn.Linear(c.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, c.hidden_size, bias=False)
        self.q_norm = HFRMSNorm(c.head_dim, c.rms_eps)
        self.k_norm = HFRMSNorm(c.head_dim, c.rms_eps)
        self.rotary_emb = _RotaryEmbedding(c.head_dim, c.rot, c.max_positions, c.rope_theta)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        c = self.c
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q_by_head = q.view(*q.shape[:-1], q.shape[-1] // self.head_dim, self.head_dim)
        q_by_head = self.q_norm(q_by_head)
        q = q_by_head.view(q.shape)
        k_by_head = k.view(*k.shape[:-1], k.shape[-1] // self.head_dim, self.head_dim)
        k_by_head = self.k_norm(k_by_head)
        k = k_by_head.view(k.shape)
        q, k = self.rotary_emb(positions, q, k)
        heads = (-1, c.num_heads, c.head_dim)
        kv_heads = (-1, c.num_kv_heads, c.head_dim)
        out = _attend(q.view(heads), k.view(kv_heads), v.view(kv_heads), c.num_heads, c.num_kv_heads)
        return self.o_proj(out)


class _Qwen3Layer(nn.Module):
    def __init__(self, c: FusionConfig) -> None:
        super().__init__()
        self.input_layernorm = HFRMSNorm(c.hidden_size, c.rms_eps)
        self.self_attn = _Qwen3Attention(c)
        self.post_attention_layernorm = HFRMSNorm(c.hidden_size, c.rms_eps)
        self.mlp = _MLP(c)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        residual = hidden
        hidden = self.self_attn(positions, self.input_layernorm(hidden))
        hidden = residual + hidden
        residual = hidden
        return residual + self.mlp(self.post_attention_layernorm(hidden))


class TinyQwen3(nn.Module):
    """A vLLM-style Qwen3 over the tokens of one sequence (see the module docstring)."""

    def __init__(self, config: FusionConfig | None = None) -> None:
        super().__init__()
        self.config = c = config or FusionConfig()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(_Qwen3Layer(c) for _ in range(c.num_layers))
        self.norm = HFRMSNorm(c.hidden_size, c.rms_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(positions, hidden)
        return self.lm_head(self.norm(hidden))


def make_tiny_llama(config: FusionConfig | None = None, seed: int = 0) -> TinyLlama:
    """A ``TinyLlama`` with deterministic random weights (norm weights ``1 + noise``)."""
    config = config or FusionConfig()
    return init_weights(TinyLlama(config), seed).to(config.dtype)


def make_tiny_qwen3(config: FusionConfig | None = None, seed: int = 0) -> TinyQwen3:
    """A ``TinyQwen3`` with deterministic random weights (norm weights ``1 + noise``)."""
    config = config or FusionConfig()
    return init_weights(TinyQwen3(config), seed).to(config.dtype)
