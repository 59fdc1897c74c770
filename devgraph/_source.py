"""Where in the user's code: the source line and warning level that errors and warnings point at.

Errors name the user's line, not devgraph's or torch's: the innermost frame outside torch,
devgraph (its ``testing`` package aside: its models are user code) and the standard
library. The capture guard, the compiled-region recorder, the backends and the runner all use it,
so it sits below all of them.
"""

from __future__ import annotations

import linecache
import os
import sys
import sysconfig
from types import TracebackType

__all__ = ["user_source_line", "user_stacklevel"]

_DEVGRAPH_DIR = os.path.dirname(os.path.abspath(__file__))
_TESTING_DIR = os.path.join(_DEVGRAPH_DIR, "testing")


def skip_dirs() -> tuple[str, str]:
    """torch's package and the standard library (but not site-packages inside it: a model's own
    library, transformers say, is where the user's offending line usually is)."""
    import torch

    return (
        os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
        sysconfig.get_paths()["stdlib"] + os.sep,
    )


#: files of decorators that wrap torch's own functions (torch's ``@deprecated`` is typing_extensions')
_WRAPPERS = (os.sep + "typing_extensions.py",)

_SITE_DIRS = tuple({sysconfig.get_paths()[k] + os.sep for k in ("purelib", "platlib")})


def is_user_path(path: str, skip: tuple[str, ...]) -> bool:
    """True for a file of the user's (``skip`` is ``skip_dirs()``, computed once per walk)."""
    torch_dir, stdlib = skip
    if path.startswith("<") or path.startswith(torch_dir):
        return False
    if path.startswith(_DEVGRAPH_DIR) and not path.startswith(_TESTING_DIR):
        return False
    if path.endswith(_WRAPPERS):  # a decorator's wrapper around torch's function (``@deprecated``)
        return False
    return not path.startswith(stdlib) or path.startswith(_SITE_DIRS)


def render(path: str, lineno: int) -> str:
    """``"file.py:LINE: code"`` (without the code when the line cannot be read)."""
    code = linecache.getline(path, lineno).strip()
    return f"{path}:{lineno}: {code}" if code else f"{path}:{lineno}"


def user_source_line(tb: TracebackType | None = None) -> str | None:
    """``"file.py:LINE: code"`` of the innermost user frame (outside torch, devgraph and the stdlib).

    Walks the current stack, or the traceback ``tb`` of an exception when given.
    """
    skip = skip_dirs()
    if tb is not None:
        found = None
        while tb is not None:
            path = os.path.abspath(tb.tb_frame.f_code.co_filename)
            if is_user_path(path, skip):
                found = render(path, tb.tb_lineno)
            tb = tb.tb_next
        return found
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if is_user_path(path, skip):
            return render(path, frame.f_lineno)
        frame = frame.f_back  # type: ignore[assignment]
    return None


def user_stacklevel() -> int:
    """``stacklevel`` for ``warnings.warn`` that points at the first frame outside devgraph."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_DEVGRAPH_DIR):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level
