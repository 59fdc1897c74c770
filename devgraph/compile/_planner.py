"""Capture-size planning within a backend's stream budget.

An Ascend device has about 2,048 hardware streams and ACL graph capture uses one per captured
piece, so a piecewise model of ``L`` attention layers (``L + 1`` pieces) can hold about
``2048 / (L + 1)`` sizes. vllm-ascend keeps that many, spread evenly over the requested list
(first and last kept). ``plan_capture_sizes`` keeps the same number but picks *which* ones by the
padding they save: a call of ``n`` tokens runs in the smallest captured size ``>= n``, wasting the
difference, so the planner minimises the expected waste over the traffic (exactly, by dynamic
programming). Without traffic it takes the requested sizes themselves as the demand. The largest
size is always kept, so every call up to it is still served by a graph.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Mapping, Sequence

import attrs

from devgraph._errors import DevgraphError

__all__ = ["CapturePlan", "padding_cost", "plan_capture_sizes", "spread_evenly"]

logger = logging.getLogger("devgraph.compile")

_MAX_DP_SIZES = 2048


@attrs.frozen
class CapturePlan:
    """Which sizes to capture.

    Attributes:
        sizes: the sizes to capture, ascending.
        dropped: requested sizes left out to stay within the budget, ascending.
        streams_per_size: streams one size costs (one per captured piece).
        budget: the stream budget planned for (None: unlimited).
    """

    sizes: tuple[int, ...]
    dropped: tuple[int, ...]
    streams_per_size: int
    budget: int | None

    @property
    def streams(self) -> int:
        """Streams the captured sizes use."""
        return len(self.sizes) * self.streams_per_size


def _demand(sizes: Sequence[int], traffic: Mapping[int, float] | None) -> list[tuple[int, float]]:
    if traffic is None:
        return [(s, 1.0) for s in sizes]
    return sorted((int(n), float(w)) for n, w in traffic.items() if w > 0)


def padding_cost(kept: Sequence[int], demand: Sequence[tuple[int, float]]) -> float:
    """Tokens of padding ``demand`` (``(size, weight)`` pairs) wastes with ``kept`` captured.

    A size above the largest kept one runs uncaptured and costs nothing here (it is the same for
    every plan that keeps the largest size).
    """
    ordered = sorted(kept)
    total = 0.0
    for n, w in demand:
        i = bisect.bisect_left(ordered, n)
        if i < len(ordered):
            total += w * (ordered[i] - n)
    return total


def spread_evenly(sizes: Sequence[int], count: int) -> tuple[int, ...]:
    """vllm-ascend's rule: ``count`` sizes spread evenly over ``sizes`` (first and last kept)."""
    sizes = sorted(sizes)
    if count >= len(sizes):
        return tuple(sizes)
    if count <= 0:
        return ()
    if count == 1:
        return (sizes[-1],)
    step = (len(sizes) - 1) / (count - 1)
    return tuple(sorted({sizes[round(i * step)] for i in range(count)}))


def _best_subset(sizes: list[int], count: int, demand: list[tuple[int, float]]) -> tuple[int, ...]:
    """The ``count`` sizes (the largest always among them) with the least padding on ``demand``.

    Dynamic programming over "the largest size chosen so far", vectorised over the previous choice:
    ``best[t][j]`` is the least padding of the demand up to ``sizes[j]`` with ``t`` sizes, the
    largest of them ``sizes[j]``.
    """
    import torch

    m = len(sizes)
    points = [(n, w) for n, w in demand if n <= sizes[-1]]
    keys = [n for n, _ in points]
    cum_w, cum_nw = [0.0], [0.0]
    for n, w in points:
        cum_w.append(cum_w[-1] + w)
        cum_nw.append(cum_nw[-1] + w * n)
    # Demand at or below sizes[j] is points[:upto[j]]; "below nothing" is index 0.
    upto = torch.tensor([bisect.bisect_right(keys, s) for s in sizes])
    w_at = torch.tensor(cum_w, dtype=torch.float64)[upto]
    nw_at = torch.tensor(cum_nw, dtype=torch.float64)[upto]
    size = torch.tensor(sizes, dtype=torch.float64)
    # cost[i, j]: padding of demand in (sizes[i], sizes[j]] served by sizes[j] (i < j only).
    cost = size[None, :] * (w_at[None, :] - w_at[:, None]) - (nw_at[None, :] - nw_at[:, None])
    cost = cost.masked_fill(~torch.ones(m, m, dtype=torch.bool).triu(1), float("inf"))
    best = size * w_at - nw_at  # t = 1: sizes[j] serves everything up to it
    back = []
    for _ in range(2, count + 1):
        total = best[:, None] + cost
        best, arg = total.min(dim=0)
        back.append(arg)
    chosen, j = [sizes[-1]], m - 1
    for arg in reversed(back):
        j = int(arg[j])
        chosen.append(sizes[j])
    return tuple(sorted(chosen))


def plan_capture_sizes(
    sizes: Sequence[int],
    pieces: int,
    budget: int | None,
    traffic: Mapping[int, float] | None = None,
) -> CapturePlan:
    """Choose the sizes to capture when each costs ``pieces`` streams out of ``budget``.

    Args:
        sizes: requested capture sizes.
        pieces: captured pieces per size (each uses one stream).
        budget: streams available (None: keep every size).
        traffic: ``{size: weight}`` of the calls expected; None weighs the requested sizes equally.
    Returns:
        a ``CapturePlan``; what it dropped is logged.
    Raises:
        DevgraphError: no sizes, a size below 1, or ``pieces`` below 1.
    """
    ordered = sorted({int(s) for s in sizes})
    if not ordered or ordered[0] < 1:
        raise DevgraphError(f"capture sizes must be positive integers, got {list(sizes)}")
    if pieces < 1:
        raise DevgraphError(f"pieces must be >= 1, got {pieces}")
    if budget is None or len(ordered) * pieces <= budget:
        return CapturePlan(tuple(ordered), (), pieces, budget)
    count = budget // pieces
    if count == 0:
        logger.warning(
            "devgraph: a capture budget of %d streams cannot hold one size of %d pieces; nothing is "
            "captured, every call runs uncaptured (split at fewer ops, or raise the budget)",
            budget,
            pieces,
        )
        return CapturePlan((), tuple(ordered), pieces, budget)
    if len(ordered) <= _MAX_DP_SIZES:
        kept = _best_subset(ordered, count, _demand(ordered, traffic))
    else:  # thousands of sizes: the exact search would need too much memory; spread them instead
        kept = spread_evenly(ordered, count)
    dropped = tuple(s for s in ordered if s not in kept)
    logger.info(
        "devgraph: capture budget %d streams at %d per size: capturing %d of %d sizes; dropped %s "
        "(calls of those sizes are padded to the next captured size)",
        budget,
        pieces,
        len(kept),
        len(ordered),
        list(dropped),
    )
    return CapturePlan(kept, dropped, pieces, budget)
