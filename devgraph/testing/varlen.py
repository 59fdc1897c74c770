"""A tiny prefill model whose attention reads per-call host lengths: the torchtitan #3685 shape.

``varlen_attention`` (``devgraph_testing::varlen_attention``) is causal attention over packed
sequences whose boundaries come as a host list ``cu_seqlens`` (``[0, 3, 7, ...]``), like a varlen
FlashAttention call whose ``cu_seqlens``/``max_seqlen`` the caller computes per step. The packed
token count is fixed by the capture size; how it splits into sequences changes every call. A
graph that captures the op freezes the split of capture time and silently computes the wrong
attention at replay (torchtitan's RL generator produced NaN logprobs and random tokens that way):
a breakable capture must run it as a break, and refuses it when it is not marked as one.

``VarlenDecoder`` is a pre-norm decoder of ``num_layers`` blocks around it (dense weights,
deterministic from a seed). ``packed_batch`` builds its inputs.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["VARLEN_ATTENTION", "VarlenDecoder", "packed_batch", "varlen_attention"]

#: The op's qualified name.
VARLEN_ATTENTION = "devgraph_testing::varlen_attention"


def _check(q: torch.Tensor, cu_seqlens: Sequence[int]) -> None:
    if len(cu_seqlens) < 2 or cu_seqlens[0] != 0 or cu_seqlens[-1] != q.shape[0]:
        raise ValueError(
            f"varlen_attention: cu_seqlens must run from 0 to the {q.shape[0]} packed tokens, got {list(cu_seqlens)}"
        )


@torch.library.custom_op(VARLEN_ATTENTION, mutates_args=())
def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list[int]
) -> torch.Tensor:
    """Causal attention within each packed sequence: ``q, k, v [T, H, D]``, boundaries ``cu_seqlens``."""
    _check(q, cu_seqlens)
    out = torch.empty_like(q)
    for start, end in itertools.pairwise(cu_seqlens):
        if end > start:
            qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))
            out[start:end] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1)
    return out


@varlen_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
    return torch.empty_like(q)


class _Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.RMSNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.norm2 = nn.RMSNorm(hidden)
        self.up = nn.Linear(hidden, 2 * hidden, bias=False)
        self.down = nn.Linear(2 * hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
        tokens, hidden = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(tokens, 3, self.heads, hidden // self.heads).unbind(1)
        x = x + self.o(varlen_attention(q, k, v, cu_seqlens).reshape(tokens, hidden))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class VarlenDecoder(nn.Module):
    """Embedding, ``num_layers`` blocks around ``varlen_attention``, a final norm and logits.

    ``forward(input_ids [T], cu_seqlens)`` returns logits ``[T, vocab]`` of a packed prefill.
    """

    def __init__(
        self, num_layers: int = 2, hidden: int = 32, heads: int = 4, vocab: int = 64, seed: int = 0
    ) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(_Block(hidden, heads) for _ in range(num_layers))
        self.norm = nn.RMSNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(
                    torch.randn(p.shape, generator=generator) * (p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1)
                    + (1.0 if p.dim() == 1 else 0.0)
                )
        self.requires_grad_(False).eval()

    @staticmethod
    def devgraph_options() -> dict[str, Any]:
        return {"host_args": ("cu_seqlens",)}

    def forward(self, input_ids: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, cu_seqlens)
        return self.head(self.norm(x))


def packed_batch(lengths: Sequence[int], vocab: int = 64, seed: int = 0) -> dict[str, Any]:
    """Forward kwargs of a packed prefill of sequences of ``lengths`` tokens (random ids from ``seed``)."""
    generator = torch.Generator().manual_seed(seed)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + int(n))
    return {"input_ids": torch.randint(0, vocab, (cu[-1],), generator=generator), "cu_seqlens": cu}
