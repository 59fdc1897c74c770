"""The paged-attention case the NPU backend's tests run on the simulator, and the output it must give."""

from __future__ import annotations

import torch

from devgraph.backends import _reference

SCALE = 0.5
DTYPE = torch.bfloat16  # npu_fused_infer_attention_score takes float16/bfloat16 (not float32)


def attention_case(batch=2, heads=4, kv_heads=2, dim=8, block_size=16, blocks=8, max_blocks=2, seed=0):
    """Random ``q, k_cache, v_cache, block_table`` (bf16, int32 table) drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, dim, generator=g).to(DTYPE)
    k = torch.randn(blocks, block_size, kv_heads, dim, generator=g).to(DTYPE)
    v = torch.randn(blocks, block_size, kv_heads, dim, generator=g).to(DTYPE)
    table = torch.randperm(blocks, generator=g)[: batch * max_blocks].view(batch, max_blocks).to(torch.int32)
    return q, k, v, table


def expected_attention(q, k, v, table, lens):
    """The reference's paged decode attention of the case at scale ``SCALE``, host lengths ``lens``."""
    out = torch.empty_like(q)
    _reference.paged_decode_attention_host_lens(q, k, v, table, lens, SCALE, out)
    return out
