"""The spawned-ranks harness (devgraph.testing.distributed): results, errors and timeouts."""

from __future__ import annotations

import time

import pytest

from devgraph.testing.distributed import RanksFailed, RanksTimedOut, run_ranks


def _sum_ranks(rank, world_size, base):
    import torch
    import torch.distributed as dist

    x = torch.tensor([float(rank + base)])
    dist.all_reduce(x)
    return (rank, dist.get_world_size(), x.item())


def _rank1_raises(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def _rank1_sleeps(rank, world_size):
    if rank == 1:
        time.sleep(600)
    return rank


def test_run_ranks_returns_each_rank_result_in_rank_order():
    assert run_ranks(_sum_ranks, 2, args=(10,), timeout=120) == [(0, 2, 21.0), (1, 2, 21.0)]


def test_a_rank_that_raises_is_reported_with_its_rank_and_message():
    with pytest.raises(RanksFailed, match="rank 1 raised ValueError: boom on rank 1") as info:
        run_ranks(_rank1_raises, 2, timeout=120)
    assert set(info.value.errors) == {1}


def test_a_rank_that_hangs_is_killed_at_the_timeout():
    # Rank 0 returns at once; under load it may still be starting when the timeout strikes, so the
    # test asks only that the sleeping rank is named and killed.
    with pytest.raises(RanksTimedOut, match=r"ranks \[(0, )?1\] of 2 still running"):
        run_ranks(_rank1_sleeps, 2, timeout=30)
