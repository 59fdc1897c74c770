"""NCCL collectives inside CUDA graphs (``-m cuda``; one rank per visible GPU, at most two).

A single-GPU machine runs world size 1: NCCL still issues (and the graph still captures) the
collective kernel, so capture and replay of the NCCL path are exercised even where the sum is the
identity.
"""

from __future__ import annotations

import pytest
import torch

from devgraph.testing.distributed import run_ranks

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        not (torch.distributed.is_available() and torch.distributed.is_nccl_available()),
        reason="needs NCCL",
    ),
]


def _world() -> int:
    return max(1, min(2, torch.cuda.device_count()))


def _nccl_all_reduce_in_a_graph(rank, world_size):
    import torch
    import torch.distributed as dist

    import devgraph

    torch.cuda.set_device(rank)
    dev = devgraph.device("cuda")

    def body(x):
        y = x * 2 + rank
        dist.all_reduce(y)
        return y.relu()

    static = torch.randn(64, 32, device="cuda")
    body(static)  # an eager collective first: NCCL creates its communicator outside the capture
    torch.cuda.synchronize()
    graph = dev.graph()
    with graph.capture():
        out = body(static)
    same = []
    for step in range(3):
        new = torch.randn(
            64, 32, device="cuda", generator=torch.Generator("cuda").manual_seed(step + 10 * rank)
        )
        static.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        same.append(bool(torch.equal(out, body(new))))
    return same


def test_nccl_all_reduce_captured_in_a_cuda_graph_replays_equal_to_eager():
    results = run_ranks(_nccl_all_reduce_in_a_graph, _world(), backend="nccl", timeout=300, pg_timeout=120)
    assert results == [[True, True, True]] * _world()


def _wrapped_row_parallel(rank, world_size):
    import torch
    import torch.distributed as dist

    import devgraph

    torch.cuda.set_device(rank)
    weight = torch.randn(16, 8, device="cuda", generator=torch.Generator("cuda").manual_seed(rank))

    def row_parallel(x):
        y = x @ weight
        dist.all_reduce(y)
        return y

    # check_ranks="every_call" exchanges sizes with NCCL (CUDA tensors) before every replay too.
    graphed = devgraph.wrap(row_parallel, device="cuda", max_batch_size=8, check_ranks="every_call")
    same = []
    for step, batch in enumerate([3, 8, 1]):
        x = torch.randn(batch, 16, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        same.append(bool(torch.allclose(graphed(x).clone(), row_parallel(x))))
    return same, graphed.stats.replays


def test_wrap_of_a_row_parallel_layer_with_nccl_replays_equal_to_eager():
    results = run_ranks(_wrapped_row_parallel, _world(), backend="nccl", timeout=300, pg_timeout=120)
    assert results == [([True, True, True], 3)] * _world()
