"""What devgraph shows a person while it captures: a progress bar and a one-line summary, unless quiet.

Capture of many sizes takes seconds to minutes; by default the user sees it:

* a progress bar (``tqdm.auto``: a text bar on a terminal, a widget in a Jupyter notebook) when
  the ``progress`` extra (tqdm) is installed and stderr is a terminal or the code runs in a notebook;
* one summary line per capture (sizes, device, seconds, pool memory), an INFO record of the
  ``devgraph`` logger. Where the application configured logging (a handler on the ``devgraph``
  logger or above it), that record goes through its handlers and levels like any other. Where
  nobody did, devgraph writes it to stderr itself (Python's own last-resort handler would drop an
  INFO record), formatted as the message alone.

Quiet: ``DEVGRAPH_QUIET=1`` (or ``devgraph -q``) turns both off; so does a level above INFO set on
the ``devgraph`` logger (``logging.getLogger("devgraph").setLevel(logging.WARNING)``).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

__all__ = ["announce", "in_notebook", "quiet", "show_progress"]

_OFF = ("", "0", "false", "no", "off")


def quiet() -> bool:
    """Whether ``DEVGRAPH_QUIET`` asks for no progress bar and no summary line (any value but 0/false/no/off)."""
    return os.environ.get("DEVGRAPH_QUIET", "").strip().lower() not in _OFF


def in_notebook() -> bool:
    """Whether this runs in a Jupyter kernel (where ``tqdm.auto`` draws a widget)."""
    ipython = sys.modules.get("IPython")
    if ipython is None or "ipykernel" not in sys.modules:
        return False
    shell = getattr(ipython, "get_ipython", lambda: None)()
    return type(shell).__name__ == "ZMQInteractiveShell"


def _level_set_above_info(logger: logging.Logger) -> bool:
    """Whether a level above INFO was set on ``logger`` or an ancestor below the root."""
    node: Any = logger
    while node is not None and node is not logging.root:
        if node.level != logging.NOTSET:
            return bool(node.level > logging.INFO)
        node = node.parent
    return False


def show_progress() -> bool:
    """Whether a capture loop should draw a progress bar: not quiet, on a terminal or in a notebook."""
    if quiet() or _level_set_above_info(logging.getLogger("devgraph")):
        return False
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty is not None and isatty()) or in_notebook()


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """A handler writing to whatever ``sys.stderr`` is at the time (a notebook or pytest replaces it)."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


_STDERR = _Stderr()
_STDERR.setFormatter(logging.Formatter("%(message)s"))


def announce(logger: logging.Logger, msg: str, *args: Any) -> None:
    """Log the capture summary ``msg % args`` at INFO, shown on stderr by default (see the module docstring)."""
    if logger.hasHandlers():  # the application configured logging: its handlers and levels decide
        logger.info(msg, *args, stacklevel=2)
        return
    if quiet() or _level_set_above_info(logger):
        return
    _STDERR.handle(logger.makeRecord(logger.name, logging.INFO, __file__, 0, msg, args, None))
