"""GraphSet and SharedPool: graphs by key in one shared pool, weak outputs, the pool renewed once retired."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import devgraph
from devgraph.graph import GraphSet, SharedPool


@pytest.fixture
def dev() -> devgraph.Device:
    return devgraph.device("cpu")


def _double(x: torch.Tensor):
    return lambda graph: x * 2


def test_replay_returns_the_captured_output_refilled_from_the_static_input(dev):
    graphs: GraphSet[int] = GraphSet(dev)
    x = torch.ones(4)
    out = graphs.capture(4, _double(x))
    x.copy_(torch.arange(4.0))
    again = graphs.replay(4)
    torch.testing.assert_close(again, torch.arange(4.0) * 2)
    assert again.data_ptr() == out.data_ptr()  # replays write the capture-time output memory


def test_outputs_are_held_weakly(dev):
    graphs: GraphSet[int] = GraphSet(dev)
    x = torch.ones(4)
    out = graphs.capture(4, _double(x))
    ref = weakref.ref(out)
    del out
    gc.collect()
    assert ref() is None  # the set kept a non-owning view, not the tensor
    assert graphs.output(4).shape == (4,)


def _two_sets_sharing_a_pool(dev):
    """A pool, two graph sets over it each holding a capture of size 1 (a doubling), and its input."""
    shared = SharedPool(dev)
    a: GraphSet[int] = GraphSet(dev, shared)
    b: GraphSet[int] = GraphSet(dev, shared)
    x = torch.ones(2)
    a.capture(1, _double(x))
    b.capture(1, _double(x))
    return shared, a, b, x


def test_graph_sets_sharing_a_pool_capture_into_the_same_pool(dev):
    shared, a, b, _x = _two_sets_sharing_a_pool(dev)
    assert a.graph(1).pool() is b.graph(1).pool() is shared.pool
    assert shared.pool.in_use == 2


def test_pool_is_renewed_only_once_every_graph_in_it_was_reset(dev):
    shared, a, b, x = _two_sets_sharing_a_pool(dev)
    first = shared.pool
    a.reset()
    assert shared.pool is first and not first.retired  # b's graph still lives in it
    b.reset()
    assert first.retired and first.in_use == 0
    b.capture(1, _double(x))  # a retired pool is never captured into again: a fresh one
    assert shared.pool is not first and b.graph(1).pool() is shared.pool


def test_a_retired_pool_is_refused_by_the_graph_itself(dev):
    pool = dev.pool()
    graph = dev.graph()
    with graph.capture(pool=pool):
        torch.ones(2) * 2
    graph.reset()
    assert pool.retired
    with pytest.raises(devgraph.DevgraphError, match="fresh pool"):
        with dev.graph().capture(pool=pool):
            pass


def test_a_failed_capture_keeps_nothing_and_lets_go_of_the_pool(dev):
    shared = SharedPool(dev)
    graphs: GraphSet[int] = GraphSet(dev, shared)
    x = torch.ones(2)

    def syncs(graph):
        return (x * 2).sum().item()  # a host sync: refused while capturing

    with pytest.raises(devgraph.CaptureError):
        graphs.capture(2, syncs)
    assert 2 not in graphs and len(graphs) == 0
    assert shared.current is not None and shared.current.in_use == 0


def test_capturing_a_key_twice_is_refused_by_name(dev):
    graphs: GraphSet[str] = GraphSet(dev)
    x = torch.ones(2)
    graphs.capture("decode", _double(x))
    with pytest.raises(devgraph.DevgraphError, match="'decode' is captured already"):
        graphs.capture("decode", _double(x))
    graphs.discard("decode")
    graphs.capture("decode", _double(x))
    assert list(graphs) == ["decode"]


def test_unknown_key_names_what_is_captured(dev):
    graphs: GraphSet[int] = GraphSet(dev)
    graphs.capture(8, _double(torch.ones(8)))
    with pytest.raises(devgraph.DevgraphError, match=r"no graph for 3; captured: \['8'\]"):
        graphs.graph(3)


def test_adopting_a_pool_of_another_device_is_refused(dev):
    class Other:
        name = "npu"

    other_pool = type("P", (), {"device": Other()})()
    with pytest.raises(devgraph.DevgraphError, match="belongs to"):
        SharedPool(dev).adopt(other_pool)  # type: ignore[arg-type]


def test_replay_with_host_args_updates_the_tasks(dev):
    import devgraph.ops as ops

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 8, generator=g)
    k, v = torch.randn(16, 4, 2, 8, generator=g), torch.randn(16, 4, 2, 8, generator=g)
    table = torch.arange(1, 7, dtype=torch.int32).view(2, 3)
    seq = torch.tensor([5, 9], dtype=torch.int32)
    graphs: GraphSet[int] = GraphSet(dev)
    graphs.capture(2, lambda graph: ops.paged_decode_attention(q, k, v, table, seq, [5, 9]))
    assert graphs.graph(2).tasks  # the CPU reference updates this op's host arguments
    seq.copy_(torch.tensor([3, 11], dtype=torch.int32))
    replayed = graphs.replay(2, {"seq_lens_host": [3, 11]})
    expected = ops.paged_decode_attention(q, k, v, table, seq, [3, 11])
    torch.testing.assert_close(replayed, expected)
