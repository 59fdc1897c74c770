"""Process-wide counters of the vLLM adapter: captures, replays and eager runs per runtime mode."""

from __future__ import annotations

import threading
from collections import Counter

__all__ = ["count", "reset_stats", "stats"]

_lock = threading.Lock()
_counters: Counter[str] = Counter()


def count(event: str, mode: str, n: int = 1) -> None:
    """Add ``n`` to the counter ``"<event>.<mode>"`` (events: capture, replay, eager)."""
    with _lock:
        _counters[f"{event}.{mode}"] += n


def stats() -> dict[str, int]:
    """A snapshot: ``{"capture.FULL": 3, "replay.PIECEWISE": 120, "eager.FULL": 4, ...}``.

    Counts the graph wrappers of this process (with vLLM's in-process engine core,
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, that is the engine's worker).
    """
    with _lock:
        return dict(_counters)


def reset_stats() -> None:
    """Zero every counter."""
    with _lock:
        _counters.clear()
