"""Compiled (``torch.compile``) regions inside a capture: run them compiled, record each one whole.

Dynamo runs a compiled graph through one Python callable per graph, wrapped by
``torch._dynamo.disable(..., reason="do not trace Dynamo-compiled graph")`` and called from the
frame's rewritten bytecode. What that callable launches depends on the backend: the ``eager`` and
``aot_eager`` backends issue aten ops through the dispatcher, inductor's CPU code calls its kernels
directly (only its extern kernels, ``mm`` say, reach the dispatcher). A backend that records the
dispatcher's ops (the CPU reference, the torch_npu simulator) would therefore record an inductor
graph *partially* and replay it wrong.

Stream-capturing backends (cuda, npu) need nothing here: the device records whatever the compiled
code launches. For backends that record ops, devgraph watches Python calls during the capture
(``sys.setprofile``, for the capturing thread only, chained to any profile function already set)
and, for every outermost call of a Dynamo-compiled graph, tells each op recorder on the dispatch
mode stack to stop recording op by op and, when the call returns, to record it as one opaque task:
at replay the compiled callable runs again on the capture-time tensors and its results are copied
into the capture-time outputs. Nothing in torch is patched.

An op recorder takes part by providing ``pause_recording()``, ``resume_recording()``,
``record_compiled(fn, args, kwargs, result, name)`` and ``record_call(fn, args, name)``
(``devgraph.backends.cpu._recorder.Recorder``). ``record_opaque`` uses the last: what
``Graph.call_opaque`` runs is recorded whole by an op recorder, and runs as is under stream capture.
"""

from __future__ import annotations

import logging
import os
import sys
from types import FrameType
from typing import Any

from devgraph._errors import CaptureError
from devgraph._source import is_user_path, render, skip_dirs

__all__ = ["CompiledRegions", "op_recorders", "record_opaque"]

logger = logging.getLogger("devgraph")

#: The reason Dynamo gives ``disable`` for every compiled graph it installs (output_graph.py).
_COMPILED_GRAPH_REASON = "do not trace Dynamo-compiled graph"

_disable_wrapper_code: Any = None


def _wrapper_code() -> Any:
    """The code object of ``torch._dynamo.disable``'s wrapper: every disabled callable runs it."""
    global _disable_wrapper_code
    if _disable_wrapper_code is None:
        import torch._dynamo

        def _probe() -> None:
            return None

        _disable_wrapper_code = torch._dynamo.disable(_probe, reason=_COMPILED_GRAPH_REASON).__code__
        # The profile function sees every call; Dynamo must never trace it (skip its frames, not
        # what they call, as torch._dynamo.decorators.skip does).
        from torch._dynamo.eval_frame import skip_code

        skip_code(CompiledRegions._profile.__code__)
    return _disable_wrapper_code


def op_recorders() -> list[Any]:
    """The dispatch modes on the current stack that record ops (see the module docstring)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    # record_call: a backend's recorder (a bisect's op probe records compiled graphs, not opaque calls)
    return [
        m
        for m in _get_current_dispatch_mode_stack()
        if hasattr(m, "record_compiled") and hasattr(m, "record_call")
    ]


def record_opaque(fn: Any, args: tuple[Any, ...], name: str) -> Any:
    """Run ``fn(*args)``; an op recorder on the dispatch mode stack (the innermost) records it as
    one opaque task, since it cannot see into code that bypasses the dispatcher. Without one (stream
    capture, or no capture) ``fn`` just runs: the device records whatever it launches."""
    recorders = op_recorders()
    if not recorders:
        return fn(*args)
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        return recorders[-1].record_call(fn, args, name)


def _on_stack(modes: list[Any]) -> bool:
    """True when every one of ``modes`` is on the current dispatch mode stack (Dynamo switches the
    modes off while it compiles: what runs then is not the captured work)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    stack = _get_current_dispatch_mode_stack()
    return all(any(m is s for s in stack) for m in modes)


def _describe(frame: FrameType) -> str:
    """``"torch.compile'd graph called at file.py:LINE: code"``: the innermost user frame calling
    the compiled graph that ``frame`` runs (Dynamo's rewritten frames keep the user's file and line)."""
    skip = skip_dirs()
    caller = frame.f_back
    while caller is not None:
        path = os.path.abspath(caller.f_code.co_filename)
        if is_user_path(path, skip):
            return f"torch.compile'd graph called at {render(path, caller.f_lineno)}"
        caller = caller.f_back
    return "torch.compile'd graph"


class CompiledRegions:
    """Records every Dynamo-compiled graph called in the block whole, through ``recorders``.

    A recorder is a dispatch mode with ``pause_recording()``, ``resume_recording()`` and
    ``record_compiled(fn, args, kwargs, result, name)`` (the backend's op recorder, or
    ``devgraph.bisect``'s op probe); a compiled graph is recorded while they are all on the stack.

    Use as a context manager around the captured block (the capturing thread only).

    Raises:
        CaptureError: (on exit) a compiled graph raised inside the capture and the error was
            swallowed, or inductor-generated code ran outside a recognised compiled graph (a torch
            whose Dynamo calls compiled graphs differently): devgraph refuses rather than record
            part of it.
    """

    def __init__(self, recorders: list[Any]) -> None:
        self.recorders = recorders
        self.active: str | None = None  # the compiled graph running now (its description)
        self._frame: FrameType | None = None
        self._call: tuple[Any, tuple[Any, ...], dict[str, Any]] | None = None
        self._problem: CaptureError | None = None
        self._previous: Any = None
        self._inductor_dir: str | None = None

    def __enter__(self) -> CompiledRegions:
        import torch._dynamo

        self._code = _wrapper_code()
        if "torch._inductor" in sys.modules:
            from torch._inductor.runtime.cache_dir_utils import cache_dir

            self._inductor_dir = os.path.abspath(cache_dir()) + os.sep
        # Events also fire inside Dynamo-compiled frames, while Dynamo's frame callback is set: keep
        # Dynamo from tracing devgraph's bookkeeping (_profile's own frames are skipped, see
        # _wrapper_code; what it calls when something happens is disabled).
        self._begin = torch._dynamo.disable(self._begin_region, reason="devgraph capture bookkeeping")
        self._finish = torch._dynamo.disable(self._end, reason="devgraph capture bookkeeping")
        self._unrecognised = torch._dynamo.disable(
            self._refuse_unrecognised, reason="devgraph capture bookkeeping"
        )
        self._previous = sys.getprofile()
        if self._previous is not None and not callable(self._previous):
            logger.warning("devgraph: a C profiler is active; it sees no events while a graph is captured")
        sys.setprofile(self._profile)
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        previous = self._previous
        if previous is not None and not callable(previous) and hasattr(previous, "enable"):
            # A C profiler (cProfile's): sys.setprofile takes no such object back; it re-installs itself.
            previous.enable()
        else:
            sys.setprofile(previous)
        if self._frame is not None:  # the block raised from inside a compiled graph
            self._end(None)
        if exc_type is None and self._problem is not None:
            raise self._problem

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        # Runs on every Python call and return while capturing: cheap checks only.
        previous = self._previous
        if previous is not None and callable(previous):
            previous(frame, event, arg)
        if event == "call":
            if self._frame is not None:
                return  # inside a compiled graph already: it is recorded whole
            code = frame.f_code
            if code is self._code:
                # A torch._dynamo.disable'd callable: a compiled graph, or something else (a
                # dispatch mode's handler runs through one for every op).
                if getattr(frame.f_locals.get("self"), "msg", None) == _COMPILED_GRAPH_REASON:
                    self._begin(frame)
            elif (
                code.co_name == "call"
                and self._inductor_dir is not None
                and code.co_filename.startswith(self._inductor_dir)
            ):
                self._unrecognised(frame)
        elif event == "return" and frame is self._frame:
            self._finish(arg)

    def _begin_region(self, frame: FrameType) -> None:
        local = frame.f_locals
        if "fn" not in local or not _on_stack(self.recorders):
            return  # run by Dynamo itself with the modes switched off (while compiling): not captured work
        self._frame = frame
        self.active = _describe(frame)
        self._call = (local["fn"], tuple(local.get("args", ())), dict(local.get("kwargs", {})))
        for recorder in self.recorders:
            recorder.pause_recording()

    def _end(self, result: Any) -> None:
        assert self._call is not None
        fn, args, kwargs = self._call
        name, self.active, self._frame, self._call = self.active or "", None, None, None
        for recorder in self.recorders:
            recorder.resume_recording()
        if result is None:
            # Python reports a raising frame's return with None; compiled graphs return a list. The
            # capture normally fails with that error; if it was caught, nothing was recorded.
            self._problem = CaptureError(
                "a compiled graph raised inside the capture and was not recorded",
                op=name,
                remedy="let errors inside the captured block propagate (do not catch them inside it)",
            )
            return
        for recorder in self.recorders:
            recorder.record_compiled(fn, args, kwargs, result, name)

    def _refuse_unrecognised(self, frame: FrameType) -> None:
        if self._problem is None and _on_stack(self.recorders):
            self._problem = CaptureError(
                "inductor-generated code ran inside the capture outside a compiled graph devgraph "
                "recognises, so it cannot be recorded whole (the CPU reference backend records "
                "dispatcher calls and inductor's kernels bypass the dispatcher)",
                op=f"{frame.f_code.co_name} in {frame.f_code.co_filename}",
                remedy="capture on cuda/npu, or run the model uncompiled on the CPU reference backend "
                "(this torch's Dynamo calls compiled graphs in a way devgraph does not know)",
            )
