"""Batch-size buckets: which sizes get a graph, and which graph serves a batch."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from devgraph._errors import DevgraphError

__all__ = ["choose_bucket", "default_batch_sizes", "normalise_batch_sizes"]


def default_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to 256 and of 16 beyond, always ending at ``max_batch_size``.

    The shape of SGLang's and vLLM's defaults: dense where batches are small (decode latency),
    coarser where padding costs relatively less.
    """
    if max_batch_size < 1:
        raise DevgraphError(f"max_batch_size must be >= 1, got {max_batch_size}")
    sizes = [s for s in (1, 2, 4) if s < max_batch_size]
    s = 8
    while s < max_batch_size:
        sizes.append(s)
        s += 8 if s < 256 else 16
    sizes.append(max_batch_size)
    return sizes


def normalise_batch_sizes(batch_sizes: Sequence[int] | None, max_batch_size: int | None) -> list[int]:
    """Sorted, de-duplicated bucket list; ``max_batch_size`` (when given) is always included."""
    if batch_sizes is None:
        return default_batch_sizes(max_batch_size if max_batch_size is not None else 32)
    sizes = sorted(set(int(s) for s in batch_sizes))
    if not sizes or sizes[0] < 1:
        raise DevgraphError(f"batch_sizes must be positive integers, got {list(batch_sizes)}")
    if max_batch_size is not None:
        if max_batch_size < sizes[-1]:
            raise DevgraphError(
                f"max_batch_size={max_batch_size} is below the largest of batch_sizes ({sizes[-1]}); "
                "drop one of the two options or make them agree"
            )
        if max_batch_size not in sizes:
            sizes.append(max_batch_size)
    return sizes


def choose_bucket(n: int, sizes: Sequence[int]) -> int | None:
    """The smallest bucket that holds ``n`` rows, or None when ``n`` exceeds the largest."""
    if n < 1:
        return None
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None
