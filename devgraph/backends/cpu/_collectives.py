"""How the op recorder holds a ``torch.distributed`` collective: re-issued at replay, then waited.

A recorded collective keeps the op, its ProcessGroup (a script object, held strongly) and its
tensors as any entry does (capture-time buffers: replay re-issues it on the very same memory, in
place, as a device graph does). Replay waits for each collective right after issuing it, whatever
the capture did: a ``Work`` (``c10d::`` ops, ``async_op=True`` included) is waited, a functional
collective's output gets ``wait_tensor``. That is the strongest order a device could give, so a
program that waited before reading the result (the only one that is correct eagerly) reads the same
values at replay; every rank replays its collectives in the order it captured them.

Point-to-point ops (``send``, ``recv_`` with an explicit peer: ``dist.send``/``recv``, ``isend``/
``irecv``, ``batch_isend_irecv``) are the exception. At capture the caller waits their ``Work``
itself, and the recorder does not (a gloo send or recv waited twice never returns). At replay a run
of consecutive ones is issued before any is waited, then all are waited before the next entry: in a
ring exchange every rank sends before it receives, and a gloo send completes only once the peer's
recv is posted, so waiting each send alone would deadlock.

Ops that ``torch.distributed``'s own Python code issues around a collective are not recorded either:
they are views, or what a ``Work.wait()`` runs (gloo copies a reduce-scatter's result out of its
scratch buffer there), which the re-issued collective and its wait redo at replay.

``wait_tensor`` itself is not recorded (the collective it waits for was already waited at replay),
and ``_wrap_tensor_autograd`` returns its input: the recorder waits every functional collective at
capture before placing its output in the pool, so there is nothing left for an
``AsyncCollectiveTensor`` to wait for.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

__all__ = [
    "IDENTITY",
    "NOT_RECORDED",
    "POINT_TO_POINT",
    "completion",
    "issued_by_torch_distributed",
    "refuse_async_with_work_in_wait",
]

#: ops that run but are not recorded
NOT_RECORDED = frozenset({"_c10d_functional::wait_tensor"})
#: point-to-point ops: waited by the caller at capture; at replay a run of them is issued, then waited
POINT_TO_POINT = frozenset({"c10d::send", "c10d::recv_"})
#: ops that return their input unchanged under the recorder
IDENTITY = frozenset({"_c10d_functional::_wrap_tensor_autograd"})


#: ``c10d::`` ops whose ``Work.wait()`` issues no op of its own on the caller's thread (gloo), so an
#: ``async_op=True`` call with the user's own later ``wait()`` records correctly
_ASYNC_RECORDABLE = frozenset({"c10d::allreduce_", "c10d::allgather_"})


def refuse_async_with_work_in_wait(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse an ``async_op=True`` collective whose ``Work.wait()`` runs ops of its own.

    gloo's reduce-scatter (and others) copy the result out of a scratch buffer inside ``wait()``.
    Called by ``torch.distributed`` itself (``async_op=False``) that copy is recognised and left to
    the re-issued collective; called by the user's own ``work.wait()`` it would be recorded as the
    user's op and replay the capture-time scratch memory over the fresh result.
    """
    from devgraph._errors import CaptureError
    from devgraph._source import user_source_line

    name = func._schema.name
    if not name.startswith("c10d::") or name in _ASYNC_RECORDABLE:
        return
    params = func._schema.arguments
    index = next((i for i, a in enumerate(params) if a.name == "async_op"), None)
    if index is None:
        return
    value = args[index] if index < len(args) else kwargs.get("async_op", params[index].default_value)
    if value:
        raise CaptureError(
            f"{name} with async_op=True inside a recorded capture (the CPU reference, the torch_npu "
            "simulator): its Work.wait() runs "
            "work of its own (gloo copies the result out of scratch memory) that a replay would "
            "repeat from the capture-time scratch buffer",
            op=name,
            source=user_source_line(),
            remedy="call it synchronously (async_op=False, the default) inside the captured region; "
            "all_reduce and the list all_gather may be async",
        )


def _wait_works(result: Any) -> None:
    for leaf in tree_flatten(result)[0]:
        if isinstance(leaf, torch.ScriptObject) and leaf._type().qualified_name().endswith(".Work"):
            leaf.wait()  # type: ignore[attr-defined]  # a torchbind method mypy cannot see


def _wait_tensors(result: Any) -> None:
    for leaf in tree_flatten(result)[0]:
        if isinstance(leaf, torch.Tensor):
            torch.ops._c10d_functional.wait_tensor(leaf)


def completion(name: str) -> Callable[[Any], None]:
    """What waits for collective ``name`` to finish, given what the op returned."""
    return _wait_tensors if name.startswith("_c10d_functional::") else _wait_works


_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
#: frames between an op's caller and the dispatch mode (skipped when looking for who issued the op)
_DISPATCH_FILES = tuple(
    os.path.join(_TORCH_DIR, *parts)
    for parts in (
        ("utils", "_python_dispatch.py"),
        ("_compile.py",),
        ("_dynamo", "eval_frame.py"),
        ("_ops.py",),
    )
)
#: devgraph's own frames (dispatch modes, recorders) are skipped too, and any dispatch mode's
#: ``__torch_dispatch__`` (an op recorder outside devgraph: its tests' torch_npu simulator);
#: devgraph.testing's models are user code
_DEVGRAPH_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep
_TESTING_DIR = os.path.join(_DEVGRAPH_DIR, "testing") + os.sep
_DISTRIBUTED_C10D = os.path.join(_TORCH_DIR, "distributed", "distributed_c10d.py")


def issued_by_torch_distributed() -> bool:
    """True when the op being dispatched was issued by ``torch.distributed``'s Python code itself
    (``distributed_c10d.py``, e.g. inside ``work.wait()``), not by the code being captured."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        devgraph_own = path.startswith(_DEVGRAPH_DIR) and not path.startswith(_TESTING_DIR)
        in_a_mode = frame.f_code.co_name == "__torch_dispatch__"
        if not (path.startswith(_DISPATCH_FILES) or devgraph_own or in_a_mode):
            return path == _DISTRIBUTED_C10D
        frame = frame.f_back  # type: ignore[assignment]
    return False
