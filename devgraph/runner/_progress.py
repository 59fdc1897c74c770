"""What a user sees of a capture: the progress bar, and sizes in the summary line."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence

__all__ = ["progress", "size_ranges"]


def progress(items: list[int], desc: str) -> Iterable[int]:
    """``items`` behind a tqdm bar on a terminal (when tqdm is installed), else as they are."""
    if not sys.stderr.isatty():
        return items
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, unit="graph", leave=False)


def size_ranges(sizes: Sequence[int]) -> str:
    """Sizes for a log line: all of them when few, else ``first..last (count)``."""
    sizes = list(sizes)
    return ", ".join(map(str, sizes)) if len(sizes) <= 8 else f"{sizes[0]}..{sizes[-1]} ({len(sizes)})"
