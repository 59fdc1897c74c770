"""BreakableGraphs: breakable mode's per-size part (one BreakableGraph per capture size, one pool)."""

from __future__ import annotations

import pytest
import torch

from devgraph import DevgraphError
from devgraph.runner._breakable import BreakableGraphs
from devgraph.testing.models import DecoderConfig, KVBlockManager, make_decoder


def test_every_size_shares_the_pool_and_replays_equal_to_eager(any_device):
    dtype = torch.bfloat16 if any_device.name == "npu" else torch.float32
    config = DecoderConfig(num_layers=2, dtype=dtype)
    model = make_decoder(config)
    blocks = KVBlockManager(config)
    largest = blocks.decode_batch(list(range(4)), [1, 2, 3, 4])
    static = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in largest.items()}
    part = BreakableGraphs(any_device)
    pool, stream = any_device.pool(), any_device.stream()
    with torch.no_grad():
        for size in (4, 2):  # largest first
            args = {k: v[:size] for k, v in static.items()}
            part.capture(
                size, lambda a=args: model(**a), pool, stream, {"seq_lens_host": args["seq_lens_host"]}
            )
        assert part.sizes == [2, 4] and part.graph_count == 6 and part.break_count == 2
        assert all(g.pool() is pool for g in part.segment_graphs())
        assert part.takes("seq_lens_host") and not part.takes("cu_seqlens")
        step = blocks.decode_batch([0, 1], [9, 10])
        eager = model(**step)
        for name, value in step.items():
            if isinstance(value, torch.Tensor):
                static[name][:2].copy_(value)
        out = part.replay(2, {"seq_lens_host": step["seq_lens_host"]})
        torch.testing.assert_close(out, eager)
    with pytest.raises(DevgraphError, match=r"no breakable graph for size 3; captured: \[2, 4\]"):
        part.replay(3)
    with pytest.raises(DevgraphError, match="captured already"):
        part.capture(2, lambda: None, pool, stream)
    part.reset()
    assert part.sizes == [] and part.graph_count == 0
