"""``Accounts``: what a runner counts in its ``stats`` and warns about once (eager calls by reason,
recaptures), and the row-count rounding its padding check measured (logged once)."""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Sequence

from devgraph._console import announce
from devgraph._errors import DevgraphError
from devgraph._fallback_fixes import with_fix
from devgraph._source import user_stacklevel
from devgraph.runner._config import RunnerConfig, RunnerStats
from devgraph.runner._rounding import RowCountRounding, report

__all__ = ["Accounts"]

logger = logging.getLogger("devgraph")


class Accounts:
    """What a runner counts in its ``stats`` and warns about once: eager calls by reason, recaptures.

    One per runner, for every part: eager calls and recaptures are counted in the runner's ``stats``.
    ``warned`` holds the categories already warned about (capture warnings use it too).
    ``serve_what`` says in ``strict=True`` errors what could not be done ("from a graph").
    """

    def __init__(
        self, config: RunnerConfig, stats: RunnerStats, lock: threading.RLock, serve_what: str
    ) -> None:
        self.config = config
        self.stats = stats
        self.lock = lock
        self.serve_what = serve_what
        self.warned: set[str] = set()

    def note_fallback(self, category: str, detail: str) -> None:
        """Account for a call served without graphs: raise when ``strict``, else count it in
        ``stats.fallbacks[category]`` and ``stats.eager_calls`` and warn once per category.

        Raises:
            DevgraphError: ``strict=True``.
        """
        detail = with_fix(category, detail)  # every warning (and strict error) names the fix
        if self.config.strict:
            raise DevgraphError(f"cannot serve this call {self.serve_what} (strict=True): {detail}")
        with self.lock:
            self.stats.fallbacks[category] = self.stats.fallbacks.get(category, 0) + 1
            self.stats.eager_calls += 1
            first = category not in self.warned
            self.warned.add(category)
        if first:
            warnings.warn(
                f"devgraph: running eagerly ({category}): {detail}. "
                "Further calls like this fall back silently; see .stats.fallbacks.",
                stacklevel=user_stacklevel(),
            )

    def note_recapture(self, replaced: str) -> None:
        """A weight was replaced since capture (the caller dropped its graphs): count it, warn once."""
        self._recapture(
            "recapture",
            f"devgraph: {replaced} was replaced since capture; capturing again (stats.recaptures counts "
            "this). To keep the graphs, load new weights in place: param.copy_(new), or "
            "load_state_dict(sd) without assign=True",
        )

    def note_changed(self, what: str) -> None:
        """A Python value the forward reads changed since capture (the caller dropped its graphs):
        count it as a recapture, warn once naming it."""
        self._recapture(
            "attribute_changed",
            f"devgraph: {what} changed since capture, and the graphs froze its value; capturing again "
            "(stats.recaptures counts this). A value that changes at every call recaptures at every "
            "call: pass it as an argument, or keep it in a tensor the forward reads",
        )

    def note_rounding(
        self, found: Sequence[RowCountRounding], device: str, option: str, stats: RunnerStats
    ) -> None:
        """Keep the padding check's row-count rounding (``found``; empty: bit for bit) in the capturing
        part's ``stats.row_count_rounding``; the first time any is found, log it (``_rounding.report``: an
        INFO record of the ``devgraph`` logger, on stderr by default like the capture summary).
        Not a fallback: padded calls still replay."""
        with self.lock:
            stats.row_count_rounding = tuple(found)
            first = bool(found) and "row_count_rounding" not in self.warned
            if first:
                self.warned.add("row_count_rounding")
        if first:
            announce(logger, "%s", report(found, device, option))

    def _recapture(self, category: str, message: str) -> None:
        with self.lock:
            self.stats.recaptures += 1
            first = category not in self.warned
            self.warned.add(category)
        if first:
            warnings.warn(message, stacklevel=user_stacklevel())
