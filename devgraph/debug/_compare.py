"""Comparing two runs op by op: aligning their op sequences and measuring each op's difference."""

from __future__ import annotations

import difflib
import math
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from devgraph.debug._poison import unmatched_poison
from devgraph.debug._probe import OpRecord

__all__ = ["Diff", "align", "diff_tensors", "max_difference"]


@attrs.frozen
class Diff:
    """How far one op's output (graph side) is from the other side's.

    ``max_abs`` is ``inf`` where one side holds NaN or inf and the other does not; ``where`` indexes
    the largest difference in the graph side's tensor; ``comparable`` is False where the shapes
    cannot be lined up (then the other fields are zero).
    """

    max_abs: float
    max_rel: float
    scale: float  # the largest |value| of the reference side (what max_rel is relative to)
    where: tuple[int, ...]
    comparable: bool = True
    output: int = 0  # which tensor output of the op


def _as_float(t: torch.Tensor) -> torch.Tensor:
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.to(torch.float64)


def _lined_up(g: torch.Tensor, e: torch.Tensor) -> torch.Tensor | None:
    """``g`` cut to ``e``'s shape where ``g`` is larger (padding rows of a bucket), else None."""
    if g.dim() != e.dim():
        return None
    for d, (a, b) in enumerate(zip(g.shape, e.shape)):
        if a < b:
            return None
        if a > b:
            g = g.narrow(d, 0, b)
    return g


def diff_tensors(g: torch.Tensor, e: torch.Tensor) -> Diff:
    """The difference of ``g`` (cut to ``e``'s shape where it is padded) from ``e``.

    NaN on both sides counts as equal (both computed NaN there), except where eager holds its marked
    poison (memory no op wrote, ``_poison``) and the graph other bits; NaN or inf on one side only is
    an infinite difference.
    """
    cut = _lined_up(g, e.to(g.device) if e.device != g.device else e)
    if cut is None:
        return Diff(0.0, 0.0, 0.0, (), comparable=False)
    e = e.to(cut.device)
    a, b = _as_float(cut), _as_float(e)
    if a.numel() == 0:
        return Diff(0.0, 0.0, 0.0, ())
    both_nan = torch.isnan(a) & torch.isnan(b) & ~unmatched_poison(cut, e)
    finite = torch.isfinite(a) & torch.isfinite(b)
    same_inf = ~finite & (a == b)
    delta = torch.where(finite, (a - b).abs(), torch.full_like(a, math.inf))
    delta = torch.where(both_nan | same_inf, torch.zeros_like(a), delta)
    flat = int(delta.argmax())
    max_abs = float(delta.reshape(-1)[flat])
    scale = float(b[torch.isfinite(b)].abs().max()) if bool(torch.isfinite(b).any()) else 0.0
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    # ``a`` views a complex tensor as real pairs (one more dim): index it, keep ``cut``'s dims
    at = torch.unravel_index(torch.tensor(flat), a.shape)[: cut.dim()]
    where = tuple(int(i) for i in at)
    return Diff(max_abs, max_rel, scale, where)


def max_difference(g: OpRecord, e: OpRecord) -> Diff:
    """The largest difference over an op's outputs (the graph side's ``g`` against ``e``)."""
    worst = Diff(0.0, 0.0, 0.0, ())
    if len(g.outputs) != len(e.outputs):
        return Diff(0.0, 0.0, 0.0, (), comparable=False)
    for i, (a, b) in enumerate(zip(g.outputs, e.outputs)):
        d = diff_tensors(a, b)
        if not d.comparable:
            return attrs.evolve(d, output=i)
        if d.max_abs > worst.max_abs or (d.max_abs == worst.max_abs and i == 0):
            worst = attrs.evolve(d, output=i)
    return worst


def align(
    left: Sequence[OpRecord], right: Sequence[OpRecord], *, by_source: bool = False
) -> tuple[list[tuple[int, int]], list[str]]:
    """Pairs ``(i, j)`` of the ops the two runs both ran, in order, and the ops only one side ran.

    The runs usually issue the same ops; where they do not (code that branches on the batch size,
    a piecewise graph's lowered ops) the longest common subsequence of op names lines them up
    (``by_source``: of op names and source lines, where both runs' ops come from the same lines).
    """
    a: list[Any] = [(r.op, r.source) if by_source else r.op for r in left]
    b: list[Any] = [(r.op, r.source) if by_source else r.op for r in right]
    if a == b:
        return [(i, i) for i in range(len(a))], []
    matcher = difflib.SequenceMatcher(a=a, b=b, autojunk=False)
    pairs: list[tuple[int, int]] = []
    unmatched: list[str] = []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            pairs.extend(zip(range(i1, i2), range(j1, j2)))
            continue
        unmatched.extend(f"graph: {r.op}" for r in left[i1:i2])
        unmatched.extend(f"eager: {r.op}" for r in right[j1:j2])
    return pairs, unmatched
