"""Collectives as breaks: a functional all-reduce marked as a break runs eagerly between segments
on every rank (2 spawned gloo ranks, the CPU reference)."""

from __future__ import annotations

from devgraph.testing.distributed import run_ranks


def _rank(rank: int, world: int) -> list[float]:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc

    import devgraph

    device = devgraph.device("cpu")
    w = torch.arange(16.0).reshape(4, 4) / 10 + rank

    def step(x: torch.Tensor) -> torch.Tensor:  # a row-parallel linear: partial sums all-reduced
        return torch.relu(fc.all_reduce(x @ w, "sum", dist.group.WORLD)) * 2

    x = torch.ones(2, 4) * (rank + 1)
    bg = devgraph.BreakableGraph(device, breaks=["_c10d_functional::all_reduce"])
    with bg.capture():
        out = step(x)
    assert [b.op for b in bg.captured_breaks] == ["_c10d_functional::all_reduce"], bg.captured_breaks
    errors = []
    for i in range(3):
        x.copy_(torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * i + rank)))
        bg.replay()
        errors.append(float((out - step(x)).abs().max()))
    return errors


def test_a_functional_all_reduce_marked_as_a_break_replays_eagerly_on_every_rank():
    for errors in run_ranks(_rank, 2):
        assert errors == [0.0, 0.0, 0.0]
