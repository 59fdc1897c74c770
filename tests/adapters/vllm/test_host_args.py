"""Where a FULL graph's attention host arguments come from at replay (runs without vLLM).

The wrapper replays a graph holding updatable attention tasks with the host arguments the step's
attention metadata carries (``devgraph_host_args``); without them it must refuse, never replay
the capture-time lengths.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import devgraph
import devgraph.ops
from devgraph._errors import DevgraphError
from devgraph.adapters.vllm._host_args import step_host_args

OP = "devgraph::paged_decode_attention"


def _attention_graph(lens: list[int]):
    """A CPU-reference graph whose one task is paged decode attention over ``lens`` (frozen)."""
    g = torch.Generator().manual_seed(0)
    batch, block_size, heads, kv_heads, dim = len(lens), 4, 4, 2, 8
    q = torch.randn(batch, heads, dim, generator=g)
    k = torch.randn(16, block_size, kv_heads, dim, generator=g)
    v = torch.randn(16, block_size, kv_heads, dim, generator=g)
    table = torch.arange(1, 1 + batch * 3, dtype=torch.int32).view(batch, 3)
    seq = torch.tensor(lens, dtype=torch.int32)
    out = torch.empty_like(q)
    graph = devgraph.device("cpu").graph()
    with torch.inference_mode(), graph.capture(auto_update_ops=[OP]):
        devgraph.ops.paged_decode_attention(q, k, v, table, seq, lens, 0.3, out)
    return graph, (q, k, v, table, seq, out)


def _step(*metadata) -> SimpleNamespace:
    # vLLM's ForwardContext as the wrapper reads it: {layer name: attention metadata}.
    return SimpleNamespace(attn_metadata={f"layer{i}": m for i, m in enumerate(metadata)})


def test_replay_uses_the_host_lengths_of_the_steps_attention_metadata():
    graph, (q, k, v, table, seq, out) = _attention_graph([5, 9])
    meta = SimpleNamespace(devgraph_host_args={"seq_lens_host": [7, 3]})
    with torch.inference_mode():
        graph.replay(host_args=step_host_args(_step(meta, meta), graph))
        expected = torch.empty_like(out)
        devgraph.ops.paged_decode_attention(q, k, v, table, seq, [7, 3], 0.3, expected)
    torch.testing.assert_close(out, expected)


def test_graph_with_attention_tasks_refuses_a_step_without_host_args():
    graph, _ = _attention_graph([5, 9])
    with pytest.raises(DevgraphError, match=r"paged_decode_attention.*no devgraph_host_args"):
        step_host_args(_step(SimpleNamespace()), graph)


def test_layers_disagreeing_on_host_args_refuse():
    graph, _ = _attention_graph([5, 9])
    a = SimpleNamespace(devgraph_host_args={"seq_lens_host": [7, 3]})
    b = SimpleNamespace(devgraph_host_args={"seq_lens_host": [7, 4]})
    with pytest.raises(DevgraphError, match="different devgraph_host_args"):
        step_host_args(_step(a, b), graph)
