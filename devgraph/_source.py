"""Where in the user's code: the source line and warning level that errors and warnings point at.

Errors name the user's line, not devgraph's or torch's: the innermost frame outside torch,
devgraph (its ``testing`` package aside: its models are user code) and the standard
library. The capture check, the compiled-region recorder, the backends and the runner all use it,
so it sits below all of them.
"""

from __future__ import annotations

import linecache
import os
import re
import sys
import sysconfig
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any

__all__ = ["meta_source", "set_generated_meta", "user_source_line", "user_stacklevel"]

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


#: ``(filename, line) -> node meta`` of the FX graph whose generated code (``<eval_with_key>.N``) a
#: frame runs, set by the layer that knows the graphs (``devgraph.frontend``); None: not known
_generated_meta: Callable[[str, int], Mapping[str, Any] | None] | None = None

_GENERATED = "<eval_with_key>"
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in [^\n]*\n\s*([^\n]*)')


def set_generated_meta(find: Callable[[str, int], Mapping[str, Any] | None]) -> None:
    """Let errors name the user's line of an op run by an FX graph's generated code: ``find(filename,
    line)`` returns the meta of the node that line computes (its ``stack_trace``)."""
    global _generated_meta
    _generated_meta = find


def meta_source(meta: Mapping[str, Any]) -> str | None:
    """``file:LINE: code`` of the innermost user frame of an FX node's ``stack_trace`` (the op's own
    line, not torch's: an ``nn.Linear``'s op is named at the line calling the layer)."""
    frames = _FRAME.findall(meta.get("stack_trace") or "")
    skip = skip_dirs()
    for path, line, code in reversed(frames):
        name = os.path.basename(path)
        if name.startswith(_GENERATED):  # a Dynamo graph's code traced again: its node's line
            found = _generated_line(name, int(line))
            if found is not None:
                return found
            continue
        if is_user_path(os.path.abspath(path), skip):
            return f"{path}:{line}: {code.strip()}"
    return None


def _generated_line(filename: str, line: int) -> str | None:
    """The user's line behind line ``line`` of an FX graph's generated code, where it is known."""
    if _generated_meta is None or not os.path.basename(filename).startswith(_GENERATED):
        return None
    meta = _generated_meta(os.path.basename(filename), line)
    return meta_source(meta) if meta is not None else None


def user_source_line(tb: TracebackType | None = None) -> str | None:
    """``"file.py:LINE: code"`` of the innermost user frame (outside torch, devgraph and the stdlib);
    a frame of an FX graph's generated code counts as the user's line its node was traced from.

    Walks the current stack, or the traceback ``tb`` of an exception when given.
    """
    skip = skip_dirs()
    if tb is not None:
        found = None
        while tb is not None:
            found = _frame_line(tb.tb_frame.f_code.co_filename, tb.tb_lineno, skip) or found
            tb = tb.tb_next
        return found
    frame = sys._getframe(1)
    while frame is not None:
        found = _frame_line(frame.f_code.co_filename, frame.f_lineno, skip)
        if found is not None:
            return found
        frame = frame.f_back  # type: ignore[assignment]
    return None


def _frame_line(filename: str, line: int, skip: tuple[str, str]) -> str | None:
    if filename.startswith("<"):
        return _generated_line(filename, line)
    path = os.path.abspath(filename)
    return render(path, line) if is_user_path(path, skip) else None


def user_stacklevel() -> int:
    """``stacklevel`` for ``warnings.warn`` that points at the first frame outside devgraph."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_DEVGRAPH_DIR):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level
