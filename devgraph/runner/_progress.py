"""What a user sees of a capture: the progress bar, and sizes in the summary line."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from devgraph._console import show_progress

__all__ = ["progress", "size_ranges"]


def progress(items: list[int], desc: str) -> Iterable[int]:
    """``items`` behind a ``tqdm.auto`` bar on a terminal or in a notebook (when tqdm is installed and
    devgraph is not quiet: ``devgraph._console.show_progress``), else as they are."""
    if not show_progress():
        return items
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, unit="graph", leave=False)


def size_ranges(sizes: Sequence[int]) -> str:
    """Sizes for a log line: all of them when few, else ``first..last (count)``."""
    sizes = list(sizes)
    return ", ".join(map(str, sizes)) if len(sizes) <= 8 else f"{sizes[0]}..{sizes[-1]} ({len(sizes)})"
