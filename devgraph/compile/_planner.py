"""Capture-size planning within a backend's capture budget.

How many sizes a device can hold is a value its backend declares, per stack:

* ``Device.max_capture_sizes``: sizes the stack can capture, probed or configured by the backend (the
  NPU backend: ``DEVGRAPH_NPU_MAX_CAPTURE_SIZES``, or 4 on an Ascend 950, which vllm-ascend caps at 4
  until its driver update). None: the stack declares no cap.
* ``Device.capture_stream_budget``: hardware streams captured pieces may use, one per piece, so
  ``budget // pieces`` sizes. This is the old Ascend rule, ``2048 / (layers + 1)`` for ``L``
  attention layers (``L + 1`` pieces); newer CANN stacks capture far more graphs, which is why
  vllm-ascend dropped it. devgraph keeps it only as the fallback for a stack that declares no cap
  (``DEVGRAPH_NPU_STREAMS`` overrides the 2,048).

The plan keeps the fewer of the two counts. Which sizes: vllm-ascend spreads them evenly over the
requested list (first and last kept). ``plan_capture_sizes`` keeps the same number but picks *which*
ones by the padding they save: a call of ``n`` tokens runs in the smallest captured size ``>= n``,
wasting the difference, so the planner minimises the expected waste over the traffic (exactly, by
dynamic programming). Without traffic it takes the requested sizes themselves as the demand. The
largest size is always kept, so every call up to it is still served by a graph. The plan is a pure
function of its arguments: ranks given the same options plan the same sizes.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from devgraph._errors import DevgraphError

__all__ = ["CapturePlan", "padding_cost", "plan_capture_sizes", "spread_evenly"]

logger = logging.getLogger("devgraph.compile")

# Above this many requested sizes the planner spreads the kept ones evenly (vllm-ascend's rule)
# instead of searching: the exact search keeps count * (m - count) back pointers and takes ~0.5 s
# at 2048.
_MAX_DP_SIZES = 2048
_FANOUT = 8  # pivots per interval and round in _layer's divide and conquer
_DENSE_FACTOR = 64  # _layer solves a layer in one step when that takes <= this many candidates per target


@attrs.frozen
class CapturePlan:
    """Which sizes to capture.

    Attributes:
        sizes: the sizes to capture, ascending.
        dropped: requested sizes left out to stay within the budget, ascending.
        streams_per_size: streams one size costs (one per captured piece).
        budget: the stream budget planned for (None: unlimited).
        max_sizes: the stack's cap on capture sizes planned for (None: none declared).
    """

    sizes: tuple[int, ...]
    dropped: tuple[int, ...]
    streams_per_size: int
    budget: int | None
    max_sizes: int | None = None

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


def _best_subset(
    sizes: list[int], count: int, demand: list[tuple[int, float]]
) -> tuple[tuple[int, ...], int]:
    """The ``count`` sizes (the largest always among them) with the least padding on ``demand``,
    and how many (previous size, next size) pairs the search evaluated.

    Dynamic programming over "the largest size chosen so far": ``best[t][j]`` is the least padding
    of the demand up to ``sizes[j]`` with ``t`` sizes chosen, the largest of them ``sizes[j]``;
    ``best[t + 1][j] = min over i < j of best[t][i] + cost(i, j)``, where ``cost(i, j)`` is the
    padding of the demand in ``(sizes[i], sizes[j]]`` served by ``sizes[j]``.

    ``cost`` is a Monge array: for ``i < i' < j < j'``, ``cost(i, j') + cost(i', j) - cost(i, j) -
    cost(i', j') = (sizes[j'] - sizes[j]) * (W(i') - W(i)) >= 0`` (``W``: cumulative demand weight).
    So the best ``i`` never decreases as ``j`` grows, nor from one layer to the next (Knuth's bound
    ``opt[t][j] <= opt[t + 1][j]``), and each layer is searched between those bounds (``_layer``).
    Layer ``t`` also only needs ``j`` in ``[t - 1, m - 1 - (count - t)]`` (room for the sizes still
    to choose), a window of ``w = m - count + 1``. The plain recurrence evaluates ``count * m**2 / 2``
    pairs (2e9 for 1..2048 keeping half); this evaluates ``O(count * w * log w)`` at worst and about
    ``m`` per layer on typical traffic.
    """
    import torch

    m = len(sizes)
    if count >= m:
        return tuple(sizes), 0
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
    width = m - count + 1
    # Layer 1: sizes[j] is the smallest chosen and serves everything up to it.
    best = (size * w_at - nw_at)[:width]
    lower = torch.zeros(width, dtype=torch.long)
    back: list[torch.Tensor] = []
    evaluations = 0
    for t in range(1, count):
        # best[k] is layer t at j = t - 1 + k; compute layer t + 1 at j = t + k' (i < j: k <= k').
        targets = (width - 1, width - 1) if t == count - 1 else (0, width - 1)
        best, arg, n = _layer(
            best, lower, size[t:], w_at[t:], nw_at[t:], w_at[t - 1 :], nw_at[t - 1 :], targets
        )
        back.append(arg)
        evaluations += n
        # Knuth's bound for the next layer: its i at j is at least this layer's i at j. This layer
        # chose i = t - 1 + arg[k'] for j = t + k'; the next one's target k' is j = t + 1 + k', its
        # candidate k is i = t + k, so k >= arg[k' + 1] - 1 (its last target lies beyond this
        # window: bounded through its neighbour, k >= arg[-1] - 1).
        lower = (torch.cat([arg[1:], arg[-1:]]) - 1).clamp(min=0)
    chosen, k = [sizes[-1]], width - 1
    for t in range(count - 1, 0, -1):
        k = int(back[t - 1][k])
        chosen.append(sizes[t - 1 + k])
    return tuple(sorted(chosen)), evaluations


def _layer(
    prev: Any,
    lower: Any,
    size_j: Any,
    w_j: Any,
    nw_j: Any,
    w_i: Any,
    nw_i: Any,
    targets: tuple[int, int],
) -> tuple[Any, Any, int]:
    """One DP layer: ``out[k'] = min over lower[k'] <= k <= k' of prev[k] + cost(k, k')`` for ``k'``
    in ``targets``; returns ``(out, argmin, evaluations)``. ``size_j``, ``w_j``, ``nw_j`` are
    indexed by ``k'``, ``w_i``, ``nw_i`` by ``k``; the argmin is the largest minimiser.

    When the bounds leave few candidates (typical traffic) every target is solved in one step.
    Otherwise divide and conquer with ``_FANOUT`` pivots per interval: solve the pivots, then each
    gap between two pivots searches only between their argmins (monotone in ``k'``); every round is
    one vectorised step over all intervals, ``log(width) / log(_FANOUT + 1)`` rounds in all.
    """
    import torch

    width = prev.numel()
    out = torch.full((width,), float("inf"), dtype=torch.float64)
    arg = torch.zeros(width, dtype=torch.long)
    a, b = targets
    pivot = torch.arange(a, b + 1)
    first = torch.minimum(lower[a : b + 1], pivot)
    span = pivot - first + 1
    widest = int(span.max())
    if pivot.numel() * widest <= _DENSE_FACTOR * width:
        # Few candidates per target: all targets at once, as a (target, candidate) matrix.
        k = first[:, None] + torch.arange(widest)
        outside = k > pivot[:, None]
        k = torch.minimum(k, pivot[:, None])
        values = prev[k] + size_j[pivot, None] * (w_j[pivot, None] - w_i[k]) - (nw_j[pivot, None] - nw_i[k])
        values = values.masked_fill(outside, float("inf"))
        least, flipped = values.flip(1).min(1)  # min() returns the first minimiser: the largest k
        out[a : b + 1] = least
        arg[a : b + 1] = first + (widest - 1 - flipped)
        return out, arg, pivot.numel() * widest
    lo, hi = torch.tensor([a]), torch.tensor([b])
    opt_lo, opt_hi = torch.tensor([0]), torch.tensor([width - 1])
    evaluations = 0
    while lo.numel():
        # Pivots: up to _FANOUT per interval, spread evenly (all of it when it is short).
        length = hi - lo + 1
        per = length.clamp(max=_FANOUT)
        task = torch.repeat_interleave(torch.arange(lo.numel()), per)
        r = torch.arange(task.numel()) - (torch.cumsum(per, 0) - per)[task]
        bt, lt = per[task], length[task]
        pivot = lo[task] + ((r + 1) * (lt + 1)) // (bt + 1) - 1
        # Candidates of each pivot: k in [first, last], k <= pivot.
        first = torch.maximum(opt_lo[task], lower[pivot])
        last = torch.minimum(opt_hi[task], pivot)
        first = torch.minimum(first, last)
        counts = last - first + 1
        total = int(counts.sum())
        evaluations += total
        of = torch.repeat_interleave(torch.arange(pivot.numel()), counts)
        k = first[of] + (torch.arange(total) - (torch.cumsum(counts, 0) - counts)[of])
        j = pivot[of]
        values = prev[k] + size_j[j] * (w_j[j] - w_i[k]) - (nw_j[j] - nw_i[k])
        least = torch.full((pivot.numel(),), float("inf"), dtype=torch.float64)
        least = least.scatter_reduce(0, of, values, "amin")
        # The largest minimising k: one tie rule for every pivot keeps the argmin monotone.
        hits = torch.where(values == least[of], k, -1)
        best = torch.full((pivot.numel(),), -1, dtype=torch.long).scatter_reduce(0, of, hits, "amax")
        out[pivot] = least
        arg[pivot] = best
        # Gaps: before each pivot (after the previous one, or from the interval's start), and after
        # the interval's last pivot.
        starts = r == 0
        ends = r == bt - 1
        before_lo = torch.where(starts, lo[task], pivot.roll(1) + 1)
        before_opt = torch.where(starts, opt_lo[task], best.roll(1))
        lo = torch.cat([before_lo, pivot[ends] + 1])
        hi = torch.cat([pivot - 1, hi[task][ends]])
        opt_lo = torch.cat([before_opt, best[ends]])
        opt_hi = torch.cat([best, opt_hi[task][ends]])
        keep = lo <= hi
        lo, hi, opt_lo, opt_hi = lo[keep], hi[keep], opt_lo[keep], opt_hi[keep]
    return out, arg, evaluations


def plan_capture_sizes(
    sizes: Sequence[int],
    pieces: int,
    budget: int | None,
    traffic: Mapping[int, float] | None = None,
    *,
    max_sizes: int | None = None,
) -> CapturePlan:
    """Choose the sizes to capture: at most ``max_sizes``, each costing ``pieces`` streams of ``budget``.

    Args:
        sizes: requested capture sizes.
        pieces: captured pieces per size (each uses one stream).
        budget: streams available (None: no stream limit).
        traffic: ``{size: weight}`` of the calls expected; None weighs the requested sizes equally.
        max_sizes: the stack's cap on capture sizes (``Device.max_capture_sizes``; None: no cap, the
            stream budget alone limits the count).
    Returns:
        a ``CapturePlan``; what it dropped is logged.
    Raises:
        DevgraphError: no sizes, a size below 1, ``pieces`` below 1, or ``max_sizes`` below 1.
    """
    ordered = sorted({int(s) for s in sizes})
    if not ordered or ordered[0] < 1:
        raise DevgraphError(f"capture sizes must be positive integers, got {list(sizes)}")
    if pieces < 1:
        raise DevgraphError(f"pieces must be >= 1, got {pieces}")
    if max_sizes is not None and max_sizes < 1:
        raise DevgraphError(f"max_sizes must be a positive number of capture sizes, got {max_sizes}")
    limits = [n for n in (None if budget is None else budget // pieces, max_sizes) if n is not None]
    count = min(limits) if limits else len(ordered)
    if count >= len(ordered):
        return CapturePlan(tuple(ordered), (), pieces, budget, max_sizes)
    if count == 0:
        logger.warning(
            "devgraph: a capture budget of %d streams cannot hold one size of %d pieces; nothing is "
            "captured, every call runs uncaptured (split at fewer ops, or raise the budget)",
            budget,
            pieces,
        )
        return CapturePlan((), tuple(ordered), pieces, budget, max_sizes)
    if len(ordered) <= _MAX_DP_SIZES:
        kept, _ = _best_subset(ordered, count, _demand(ordered, traffic))
    else:  # more sizes than the exact search is sized for (time, back pointers): spread them evenly
        kept = spread_evenly(ordered, count)
    dropped = tuple(s for s in ordered if s not in kept)
    logger.info(
        "devgraph: capture budget %s streams at %d per size, stack cap %s sizes: capturing %d of %d "
        "sizes; dropped %s (calls of those sizes are padded to the next captured size)",
        budget,
        pieces,
        max_sizes,
        len(kept),
        len(ordered),
        list(dropped),
    )
    return CapturePlan(kept, dropped, pieces, budget, max_sizes)
