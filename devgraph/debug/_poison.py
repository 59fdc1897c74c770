"""The NaN an eager run writes into memory no op wrote, marked so it is told from any other NaN.

Eager runs under the bisect fill every uninitialised output (``empty``) with a NaN whose payload
carries the bisect run's number. A graph that leaves the same memory unwritten replays whatever it
held: a plain NaN there (memory an earlier poisoned run freed, handed to the capture) would match
eager's NaN by chance, and the op that left it unwritten would pass unseen. Only this run's marked
NaN matches this run's marked NaN, bit for bit; any other NaN counts as a difference there.
"""

from __future__ import annotations

import itertools

import torch

__all__ = ["fill_poison", "new_run", "unmatched_poison"]

#: per float dtype: the integer view, the marked quiet-NaN bits, and the mask of the run's number
#: (a quiet NaN with one more payload bit set than the NaN arithmetic produces)
_MARKS = {
    torch.float64: (torch.int64, 0x7FFA_0000_0000_0000, 0xFFFF_FFFF),
    torch.float32: (torch.int32, 0x7FD0_0000, 0xFFFF),
    torch.float16: (torch.int16, 0x7F00, 0xFF),
    torch.bfloat16: (torch.int16, 0x7FE0, 0x1F),
}
_RUNS = itertools.count(1)


def new_run() -> int:
    """A new run number: the eager runs of one bisect share it, no earlier run's poison matches it."""
    return next(_RUNS)


def _real(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t) if t.is_complex() else t


def fill_poison(t: torch.Tensor, run: int) -> None:
    """Fill a floating tensor with run ``run``'s marked NaN (other dtypes are left as they are)."""
    t = _real(t)
    mark = _MARKS.get(t.dtype)
    if mark is None:
        if t.is_floating_point():
            t.fill_(float("nan"))  # a float8 and the like: an unmarked NaN
        return
    view, bits, number = mark
    t.view(view).fill_(bits | (1 + (run - 1) % number))


def unmatched_poison(graph: torch.Tensor, eager: torch.Tensor) -> torch.Tensor:
    """Where ``eager`` holds a marked NaN and ``graph`` (same shape) holds other bits: memory eager left
    unwritten, which the graph holds otherwise (a complex tensor as its real pairs, one more dim)."""
    g, e = _real(graph), _real(eager)
    mark = _MARKS.get(e.dtype)
    if mark is None or g.dtype != e.dtype:
        return torch.zeros(e.shape, dtype=torch.bool, device=e.device)
    view, bits, number = mark
    eb, gb = e.view(view), g.view(view)
    return ((eb & ~number) == bits) & (gb != eb)
