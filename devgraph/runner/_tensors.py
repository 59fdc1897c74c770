"""Two questions the runner asks of a tensor in several places: its version, and whether it still
holds what a copy of it holds."""

from __future__ import annotations

import torch

__all__ = ["same_values", "tensor_version"]


def tensor_version(t: torch.Tensor) -> int | None:
    """``t``'s version counter (bumped by every in-place write); None for an inference tensor, which
    has none (callers then assume it written)."""
    try:
        return t._version
    except RuntimeError:
        return None


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` holds what ``b`` holds: same shape and dtype, equal values, NaN where NaN was (a
    NaN-holding buffer written by nobody is unchanged)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):
        return True
    if not (a.is_floating_point() or a.is_complex()):
        return False
    return bool(((a == b) | (a.isnan() & b.isnan())).all())
