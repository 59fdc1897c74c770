"""Whether the application froze objects itself (``gc.freeze()``), told apart from the interpreter's own.

``gc_frozen`` freezes the live objects while capturing only when the application froze none, since
``gc.unfreeze()`` is all or nothing. ``gc.get_freeze_count()`` alone cannot tell: on CPython 3.12
the collector moves the immortal objects it meets into the permanent generation (375 tuples of the
runtime on 3.12.1 and 3.12.3), so the count is never 0 there. What a fresh interpreter of the same
Python holds after a collection is the interpreter's own share; only objects beyond it are the
application's.
"""

from __future__ import annotations

import gc
import logging
import subprocess
import sys

__all__ = ["application_froze_objects"]

logger = logging.getLogger("devgraph")

_UNKNOWN = -1
_interpreter_frozen: int | None = None  # measured once per process, and only if ever needed


def _measure_interpreter_frozen() -> int:
    """``gc.get_freeze_count()`` after a collection in a fresh interpreter of this Python (-1: unknown)."""
    probe = "import gc; gc.collect(); print(gc.get_freeze_count())"
    try:
        done = subprocess.run(
            [sys.executable, "-I", "-S", "-c", probe], capture_output=True, text=True, timeout=60, check=True
        )
        return int(done.stdout.strip())
    except (OSError, subprocess.SubprocessError, ValueError) as err:
        logger.debug("devgraph: could not measure the interpreter's own frozen objects (%s)", err)
        return _UNKNOWN


def application_froze_objects() -> bool:
    """True if gc's permanent generation holds objects beyond those the interpreter keeps there.

    Call it after a collection, with the caller holding whatever lock serialises gc changes. The
    first call that finds a non-zero count starts one short-lived interpreter to measure that
    Python's own count; when it cannot be measured, any frozen object counts as the application's
    (devgraph then freezes nothing more, the safe side).
    """
    global _interpreter_frozen
    count = gc.get_freeze_count()
    if count == 0:
        return False
    if _interpreter_frozen is None:
        _interpreter_frozen = _measure_interpreter_frozen()
    return _interpreter_frozen == _UNKNOWN or count > _interpreter_frozen
