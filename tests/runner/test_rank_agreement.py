"""Ranks that agree: capture sizes exchanged at capture, per-call sizes with check_ranks="every_call".

Every test spawns its ranks (gloo on CPU, devgraph.testing.distributed.run_ranks) with a bounded
process-group timeout and an outer timeout, so a disagreement fails instead of hanging.
"""

from __future__ import annotations

import pytest

from devgraph.testing.distributed import run_ranks

WORLD = 2

#: what test_capture_context_is_entered_around_every_capture_and_warm_up saw, in order
_EVENTS: list[str] = []


def _row_parallel(rank):
    import torch
    import torch.distributed as dist

    class RowParallel(torch.nn.Module):
        """Each rank holds its slice of the weight; the partial products are summed across ranks."""

        def __init__(self) -> None:
            super().__init__()
            g = torch.Generator().manual_seed(rank)
            self.weight = torch.nn.Parameter(torch.randn(6, 5, generator=g), requires_grad=False)

        def forward(self, x):
            y = x @ self.weight
            dist.all_reduce(y)
            return torch.relu(y) + 1

    return RowParallel()


def _capture_sizes_differ(rank, world_size):
    import torch

    import devgraph

    model = _row_parallel(rank)
    graphed = devgraph.wrap(model, device="cpu", max_batch_size=8 if rank == 0 else 4)
    try:
        graphed(torch.randn(3, 6))
    except devgraph.RankMismatchError as e:
        return ("raised", str(e), e.sizes)
    return ("no error", "", {})


def test_ranks_with_different_capture_sizes_raise_naming_the_rank_and_size():
    results = run_ranks(_capture_sizes_differ, WORLD, timeout=180)
    for status, message, sizes in results:
        assert status == "raised"
        assert "rank 1 of 2 captures batch sizes [1, 2, 4] but rank 0 captures [1, 2, 4, 8]" in message
        assert "size 8 differs" in message and "max_batch_size" in message
        assert sizes == {0: [8, 4, 2, 1], 1: [4, 2, 1]}
    assert results[0][1] == results[1][1]  # every rank says the same thing


def _agreeing_ranks_replay(rank, world_size, check_ranks):
    import torch

    import devgraph

    model = _row_parallel(rank)
    graphed = devgraph.wrap(model, device="cpu", max_batch_size=8, check_ranks=check_ranks)
    same = []
    for step, batch in enumerate([3, 8, 1, 5]):
        x = torch.randn(batch, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        out = graphed(x).clone()
        same.append(bool(torch.equal(out, model(x))))
    return same, graphed.stats.replays, graphed.stats.eager_calls


@pytest.mark.parametrize("check_ranks", ["capture", "every_call"])
def test_agreeing_ranks_replay_equal_to_eager(check_ranks):
    for same, replays, eager in run_ranks(_agreeing_ranks_replay, WORLD, args=(check_ranks,), timeout=180):
        assert same == [True, True, True, True]
        assert (replays, eager) == (4, 0)


def _calls_in_different_buckets(rank, world_size):
    import torch

    import devgraph

    model = _row_parallel(rank)
    graphed = devgraph.wrap(model, device="cpu", max_batch_size=8, check_ranks="every_call")
    graphed(torch.randn(2, 6))  # capture, and a call that agrees
    try:
        graphed(torch.randn(3 if rank == 0 else 7, 6))  # buckets 4 and 8
    except devgraph.RankMismatchError as e:
        return ("raised", str(e))
    return ("no error", "")


def test_every_call_check_refuses_ranks_replaying_different_sizes():
    for status, message in run_ranks(_calls_in_different_buckets, WORLD, timeout=180):
        assert status == "raised"
        assert "rank 0: batch size 4, rank 1: batch size 8" in message


def _no_group_means_no_exchange(rank, world_size):
    import torch

    import devgraph

    # No collectives in this model, so ranks may capture what they like when told not to check.
    graphed = devgraph.wrap(torch.nn.Linear(4, 4), device="cpu", max_batch_size=2 + rank, process_group=None)
    # 2 rows: Dynamo keeps a 1-row call's trace to 1 row (its graph captures that size alone)
    graphed(torch.randn(2, 4))
    return graphed.stats.captured_sizes


def test_process_group_none_turns_the_checks_off():
    assert run_ranks(_no_group_means_no_exchange, WORLD, timeout=180) == [(1, 2), (1, 2, 3)]


def test_bad_check_ranks_value_is_refused():
    import devgraph
    from devgraph.runner import RunnerConfig

    with pytest.raises(devgraph.DevgraphError, match="check_ranks must be 'capture' or 'every_call'"):
        RunnerConfig(check_ranks="always")
    with pytest.raises(devgraph.DevgraphError, match="process_group must be"):
        RunnerConfig(process_group="world")


def test_without_torch_distributed_initialised_there_is_no_group():
    from devgraph.runner._ranks import resolve_group

    assert resolve_group("auto") is None
    assert resolve_group(None) is None


def test_capture_context_is_entered_around_every_capture_and_warm_up():
    import contextlib

    import torch

    import devgraph
    from devgraph.graph import _contract

    events = _EVENTS  # a global, not the model's state (which capture would refuse to change)
    events.clear()
    model = torch.nn.Linear(4, 4)

    def forward(x):
        _EVENTS.append("capture" if _contract.current_graph() is not None else "warm-up")
        return model(x)

    @contextlib.contextmanager
    def engine_context():
        events.append("enter")
        yield
        events.append("exit")

    # frontend='raw': the forward itself runs in the capture loop (through Dynamo it runs as traced
    # Python, and Dynamo replays its list append after the graph)
    with pytest.warns(UserWarning, match="untraced"):
        graphed = devgraph.wrap(
            forward,
            device="cpu",
            batch_sizes=[1, 2],
            warmup_iters=1,
            capture_context=engine_context,
            frontend="raw",
        )
    graphed(torch.randn(2, 4))
    assert events == ["enter", "warm-up", "capture", "warm-up", "capture", "exit"]
    graphed(torch.randn(1, 4))
    assert events[-1] == "exit"  # replays run outside it

    events.clear()  # through Dynamo: entered once around the capture of the graph Dynamo handed over
    traced = devgraph.wrap(
        model, device="cpu", batch_sizes=[1, 2], warmup_iters=1, capture_context=engine_context
    )
    with torch.no_grad():
        traced(torch.randn(2, 4))
        assert events == ["enter", "exit"] and traced.stats.captured_sizes == (1, 2)
        traced(torch.randn(2, 4))  # (1 row would be another trace: Dynamo specialises size 1)
    assert events == ["enter", "exit"] and traced.stats.replays == 2  # replays run outside it


def test_capture_context_must_be_callable():
    import devgraph

    with pytest.raises(devgraph.DevgraphError, match="capture_context must be a callable"):
        devgraph.wrap(lambda x: x, device="cpu", capture_context=42)


def _piecewise_plans_differ(rank, world_size):
    import torch

    import devgraph

    model = _row_parallel(rank)
    # The capture-budget planner is a pure function of its options: ranks given different traffic
    # plan different sizes, and the capture-time exchange catches it before anything is captured.
    traffic = {1: 10.0, 2: 1.0, 8: 1.0} if rank == 0 else {4: 10.0, 2: 1.0, 8: 1.0}
    graphed = devgraph.wrap(
        model,
        device="cpu",
        mode="piecewise",
        compile_backend="eager",
        capture_sizes=[1, 2, 4, 8],
        capture_budget=2,
        traffic=traffic,
    )
    try:
        graphed(torch.randn(3, 6))
    except devgraph.RankMismatchError as e:
        return ("raised", str(e), e.sizes)
    return ("no error", graphed.stats.captured_sizes, {})


def test_piecewise_ranks_planning_different_sizes_raise():
    results = run_ranks(_piecewise_plans_differ, WORLD, timeout=240)
    for status, message, sizes in results:
        assert status == "raised", message
        assert "rank 1 of 2 captures capture sizes (tokens)" in message and "traffic" in message
        assert sizes[0] != sizes[1]
