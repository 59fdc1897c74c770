"""Helpers of the runners' capture loops: garbage collection frozen, a progress bar, sizes in logs."""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterable, Iterator, Sequence

from devgraph._console import show_progress

__all__ = ["gc_frozen", "progress", "size_ranges"]


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


class _GcState:
    """What ``gc_frozen`` found on entry, kept while any thread is inside it."""

    lock = threading.RLock()
    depth = 0
    was_enabled = True
    froze = False


@contextlib.contextmanager
def gc_frozen() -> Iterator[None]:
    """Collect once, then freeze and disable collection while capturing; restore exactly what was found.

    A collection during capture would walk every live object (``torch.cuda.graph`` collects on
    entry, SGLang freezes for that reason). The application's own state comes back as it was: gc
    enabled or disabled, and the objects it froze itself (vLLM and SGLang ``gc.freeze()`` after
    start-up) stay frozen. ``gc.unfreeze()`` is all or nothing, so when the application has frozen
    objects already, devgraph freezes nothing more (collection stays disabled while capturing).
    Nested and concurrent uses share one entry: the first in saves the state, the last out restores it.
    """
    with _GcState.lock:
        if _GcState.depth == 0:
            _GcState.was_enabled = gc.isenabled()
            gc.disable()
            gc.collect()
            _GcState.froze = gc.get_freeze_count() == 0
            if _GcState.froze:
                gc.freeze()
        _GcState.depth += 1
    try:
        yield
    finally:
        with _GcState.lock:
            _GcState.depth -= 1
            if _GcState.depth == 0:
                if _GcState.froze:
                    gc.unfreeze()
                if _GcState.was_enabled:
                    gc.enable()


def size_ranges(sizes: Sequence[int]) -> str:
    """Sizes for a log line: all of them when few, else ``first..last (count)``."""
    sizes = list(sizes)
    return ", ".join(map(str, sizes)) if len(sizes) <= 8 else f"{sizes[0]}..{sizes[-1]} ({len(sizes)})"
