"""Counters of the devgraph SGLang backend in this process, optionally mirrored to a JSON file."""

from __future__ import annotations

import json
import os
import threading
from collections import Counter

import attrs

#: Path of the JSON file the counters are written to after every capture and replay (unset: none).
STATS_ENV = "DEVGRAPH_SGLANG_STATS"


@attrs.define
class GraphStats:
    """What the devgraph graph backend did in this process.

    ``captured``: bucket sizes captured, in capture order (largest first). ``replays``: replays per
    bucket. ``padded_replays``: replays whose real batch was smaller than the bucket.
    ``padded_rows``: rows of padding replayed in all. ``task_updates``: replays that gave the
    graph's updatable tasks new host arguments. ``eager_decode``: decode batches run eagerly
    because no graph of their size was captured, by batch size (``DevgraphDecodeGraphRunner``
    replays a graph only of a batch's exact size; see ``_runner``). Prefill is never captured and
    not counted. ``capture_s``: seconds the decode runner's ``capture()`` took (warm-ups included).
    ``runner``: the class of the decode runner that captured. ``graphs``: per captured size, the
    devgraph graph type and its updatable tasks (``{"graph": "NpuGraph", "tasks":
    ["devgraph::paged_decode_attention", ...]}``). ``eager_checks``: with ``DEVGRAPH_COMPARE_EAGER``, one
    entry per sampled replay (``step``, ``max_abs``, ``rows``, ``flips``: rows whose greedy token flipped).
    """

    captured: list[int] = attrs.field(factory=list)
    replays: Counter = attrs.field(factory=Counter)
    padded_replays: int = 0
    padded_rows: int = 0
    task_updates: int = 0
    eager_decode: Counter = attrs.field(factory=Counter)
    capture_s: float = 0.0
    runner: str = ""
    graphs: dict = attrs.field(factory=dict)
    eager_checks: list = attrs.field(factory=list)
    prefill_captured: list[int] = attrs.field(factory=list)
    prefill_graphs: dict = attrs.field(factory=dict)
    prefill_capture_s: float = 0.0
    prefill_replays: Counter = attrs.field(factory=Counter)
    prefill_padded_tokens: int = 0

    def as_dict(self) -> dict:
        """A JSON-ready copy (bucket keys as strings)."""
        return {
            "captured": list(self.captured),
            "replays": {str(k): v for k, v in sorted(self.replays.items())},
            "padded_replays": self.padded_replays,
            "padded_rows": self.padded_rows,
            "task_updates": self.task_updates,
            "eager_decode": {str(k): v for k, v in sorted(self.eager_decode.items())},
            "capture_s": round(self.capture_s, 3),
            "runner": self.runner,
            "graphs": {str(k): dict(v) for k, v in self.graphs.items()},
            "eager_checks": list(self.eager_checks),
            "prefill_captured": list(self.prefill_captured),
            "prefill_graphs": {str(k): dict(v) for k, v in self.prefill_graphs.items()},
            "prefill_capture_s": round(self.prefill_capture_s, 3),
            "prefill_replays": {str(k): v for k, v in sorted(self.prefill_replays.items())},
            "prefill_padded_tokens": self.prefill_padded_tokens,
        }


_STATS = GraphStats()
_LOCK = threading.Lock()


def stats() -> GraphStats:
    """This process's counters (the object itself; the backend updates it)."""
    return _STATS


def record(update) -> None:
    """Applies ``update(stats)`` under the lock and mirrors the result to ``$DEVGRAPH_SGLANG_STATS``."""
    with _LOCK:
        update(_STATS)
        path = os.environ.get(STATS_ENV)
        if path:
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(_STATS.as_dict(), f)
            os.replace(tmp, path)  # a reader never sees half a file


def reset() -> None:
    """Forgets every counter (tests)."""
    global _STATS
    with _LOCK:
        _STATS = GraphStats()
