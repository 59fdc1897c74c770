"""plan_capture_sizes: which sizes fit a backend's stream budget (property tests)."""

from __future__ import annotations

import itertools
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from devgraph import DevgraphError
from devgraph.compile import padding_cost, plan_capture_sizes, spread_evenly

sizes_st = st.lists(st.integers(1, 512), min_size=1, max_size=24, unique=True)
traffic_st = st.dictionaries(st.integers(1, 600), st.floats(0.0, 100.0, allow_nan=False), max_size=20)


@given(sizes=sizes_st, pieces=st.integers(1, 60), budget=st.integers(1, 400))
def test_plan_stays_within_budget_and_partitions_the_sizes(sizes, pieces, budget):
    plan = plan_capture_sizes(sizes, pieces, budget)
    assert plan.streams <= budget
    assert sorted(plan.sizes + plan.dropped) == sorted(sizes)
    assert set(plan.sizes).isdisjoint(plan.dropped)
    assert list(plan.sizes) == sorted(plan.sizes)


@given(sizes=sizes_st, pieces=st.integers(1, 60), budget=st.integers(1, 400))
def test_plan_keeps_as_many_sizes_as_the_budget_holds_and_always_the_largest(sizes, pieces, budget):
    plan = plan_capture_sizes(sizes, pieces, budget)
    assert len(plan.sizes) == min(len(sizes), budget // pieces)
    if plan.sizes:
        assert plan.sizes[-1] == max(sizes)


@given(sizes=sizes_st, pieces=st.integers(1, 8))
def test_no_budget_or_a_large_one_keeps_every_size(sizes, pieces):
    assert plan_capture_sizes(sizes, pieces, None).sizes == tuple(sorted(sizes))
    assert plan_capture_sizes(sizes, pieces, pieces * len(sizes)).dropped == ()


@settings(max_examples=60)
@given(sizes=sizes_st, pieces=st.integers(1, 20), budget=st.integers(1, 200), traffic=traffic_st)
def test_plan_wastes_no_more_padding_than_vllm_ascends_even_spread(sizes, pieces, budget, traffic):
    demand = sorted(traffic.items()) if traffic else [(s, 1.0) for s in sizes]
    plan = plan_capture_sizes(sizes, pieces, budget, traffic or None)
    baseline = spread_evenly(sizes, budget // pieces)
    assert padding_cost(plan.sizes, demand) <= padding_cost(baseline, demand) + 1e-6


@settings(max_examples=40)
@given(
    sizes=st.lists(st.integers(1, 64), min_size=2, max_size=9, unique=True),
    count=st.integers(1, 8),
    traffic=traffic_st,
)
def test_plan_is_the_least_padding_subset_that_keeps_the_largest(sizes, count, traffic):
    demand = sorted(traffic.items()) if traffic else [(s, 1.0) for s in sizes]
    plan = plan_capture_sizes(sizes, 1, count, traffic or None)
    if count >= len(sizes):
        assert plan.dropped == ()
        return
    largest = max(sizes)
    others = sorted(set(sizes) - {largest})
    best = min(padding_cost((*c, largest), demand) for c in itertools.combinations(others, count - 1))
    assert padding_cost(plan.sizes, demand) == pytest.approx(best)


def test_traffic_decides_which_sizes_survive():
    sizes = [1, 2, 4, 8, 16, 32, 64]
    # Traffic is all 3- and 30-token calls: keep the sizes just above them.
    plan = plan_capture_sizes(sizes, pieces=10, budget=30, traffic={3: 50, 30: 50})
    assert plan.sizes == (4, 32, 64)


def test_vllm_ascend_rule_is_the_stream_count_reference():
    # 2048 streams, 48 layers -> 49 pieces -> 41 sizes (vllm-ascend: streams // (layers + 1)).
    sizes = list(range(1, 513))
    plan = plan_capture_sizes(sizes, pieces=49, budget=2048)
    assert len(plan.sizes) == 2048 // 49 == 41


def test_planner_logs_what_it_dropped(caplog):
    with caplog.at_level(logging.INFO, logger="devgraph.compile"):
        plan = plan_capture_sizes([1, 2, 4, 8], pieces=3, budget=6)
    assert plan.dropped and "dropped" in caplog.text and str(list(plan.dropped)) in caplog.text


def test_a_budget_below_one_size_captures_nothing_and_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="devgraph.compile"):
        plan = plan_capture_sizes([4, 8], pieces=10, budget=5)
    assert plan.sizes == () and plan.dropped == (4, 8)
    assert "cannot hold one size" in caplog.text


@pytest.mark.parametrize("sizes, pieces", [([], 1), ([0, 4], 1), ([4], 0)])
def test_bad_arguments_are_clear_errors(sizes, pieces):
    with pytest.raises(DevgraphError):
        plan_capture_sizes(sizes, pieces, 10)


def _plain_recurrence(sizes, count, demand):
    """The O(count * m**2) dynamic programme the planner used to run (the reference)."""
    import bisect

    import torch

    m = len(sizes)
    points = [(n, w) for n, w in demand if n <= sizes[-1]]
    keys = [n for n, _ in points]
    cum_w, cum_nw = [0.0], [0.0]
    for n, w in points:
        cum_w.append(cum_w[-1] + w)
        cum_nw.append(cum_nw[-1] + w * n)
    upto = torch.tensor([bisect.bisect_right(keys, s) for s in sizes])
    w_at = torch.tensor(cum_w, dtype=torch.float64)[upto]
    nw_at = torch.tensor(cum_nw, dtype=torch.float64)[upto]
    size = torch.tensor(sizes, dtype=torch.float64)
    cost = size[None, :] * (w_at[None, :] - w_at[:, None]) - (nw_at[None, :] - nw_at[:, None])
    cost = cost.masked_fill(~torch.ones(m, m, dtype=torch.bool).triu(1), float("inf"))
    best = size * w_at - nw_at
    for _ in range(2, count + 1):
        best = (best[:, None] + cost).min(dim=0).values
    return float(best[-1])


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 400), min_size=2, max_size=80, unique=True),
    data=st.data(),
    traffic=traffic_st,
)
def test_fast_planner_finds_the_plain_recurrences_optimum(sizes, data, traffic):
    from devgraph.compile._planner import _best_subset, _demand

    ordered = sorted(sizes)
    count = data.draw(st.integers(1, len(ordered) - 1))
    demand = _demand(ordered, traffic or None)
    kept, _ = _best_subset(ordered, count, demand)
    assert len(kept) == count and kept[-1] == ordered[-1] and set(kept) <= set(ordered)
    assert padding_cost(kept, demand) == pytest.approx(_plain_recurrence(ordered, count, demand), abs=1e-6)


@pytest.mark.parametrize(
    "traffic",
    [None, {2048: 1.0}, {n: float(n % 7 == 0) for n in range(1, 2049)}, {n: 1.0 / n for n in range(1, 2049)}],
    ids=["requested", "all-at-the-top", "sparse", "decaying"],
)
def test_a_2048_size_plan_evaluates_a_small_fraction_of_the_pairs(traffic):
    # 1..2048 keeping 1,024 (2 pieces, 2,048 streams): the plain recurrence evaluates
    # count * m**2 / 2 = 2.1e9 (previous size, next size) pairs (104 s); the planner must stay
    # under 2% of that whatever the traffic.
    from devgraph.compile._planner import _best_subset, _demand

    sizes = list(range(1, 2049))
    count = 2048 // 2
    kept, evaluations = _best_subset(sizes, count, _demand(sizes, traffic))
    assert len(kept) == count and kept[-1] == 2048
    assert evaluations < 0.02 * count * len(sizes) ** 2 / 2
    demand = _demand(sizes, traffic)
    assert padding_cost(kept, demand) <= padding_cost(spread_evenly(sizes, count), demand) + 1e-6


# -- the per-stack cap on capture sizes (Device.max_capture_sizes) ---------------------------------------


@settings(deadline=None, max_examples=60)
@given(
    sizes=st.lists(st.integers(1, 512), min_size=1, max_size=40, unique=True),
    pieces=st.integers(1, 50),
    budget=st.one_of(st.none(), st.integers(1, 2048)),
    cap=st.one_of(st.none(), st.integers(1, 40)),
)
def test_the_plan_keeps_the_fewer_of_the_stack_cap_and_the_stream_rule(sizes, pieces, budget, cap):
    plan = plan_capture_sizes(sizes, pieces, budget, max_sizes=cap)
    limits = [n for n in (None if budget is None else budget // pieces, cap) if n is not None]
    assert len(plan.sizes) == min([len(sizes), *limits])
    assert plan.max_sizes == cap
    if plan.sizes:
        assert plan.sizes[-1] == max(sizes)  # the largest size is always kept
    # A pure function of its arguments (ranks agree by planning from the same options).
    assert plan == plan_capture_sizes(list(reversed(sizes)), pieces, budget, max_sizes=cap)


def test_an_ascend_950_cap_beats_the_old_stream_rule():
    # 2048 / (27 + 1) = 73 sizes by the old rule; the 950's stack holds 4.
    sizes = list(range(8, 520, 8))
    plan = plan_capture_sizes(sizes, pieces=28, budget=2048, max_sizes=4)
    assert len(plan.sizes) == 4 and plan.sizes[-1] == 512
    # Without a declared cap the old rule is the fallback.
    assert len(plan_capture_sizes(sizes, pieces=28, budget=2048).sizes) == min(len(sizes), 2048 // 28)


def test_a_cap_below_one_is_a_clear_error():
    with pytest.raises(DevgraphError, match="max_sizes"):
        plan_capture_sizes([1, 2], 1, None, max_sizes=0)
