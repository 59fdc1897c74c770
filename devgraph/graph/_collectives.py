"""Collectives inside a capture: which ``torch.distributed`` ops a graph can hold, and which it refuses.

``torch.distributed`` reaches the dispatcher as ops of two namespaces: ``c10d::`` (the in-place
``dist.all_reduce``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``broadcast``,
``all_gather``..., each taking the ProcessGroup as a script object and returning a ``Work``) and
``_c10d_functional::`` (``torch.distributed._functional_collectives``: a fresh output, completed by
``wait_tensor``). A device graph captures the collective's kernel (NCCL on CUDA, HCCL on NPU) and
replays it on the capture-time buffers; the CPU reference records the op and re-issues it at replay.

Refused on every backend, with a ``CaptureError`` naming the op, the line and the remedy:

* object collectives (``all_gather_object``, ``broadcast_object_list``, ...): they pickle Python
  objects and read sizes on the host, which no graph can replay;
* ``barrier`` / ``monitored_barrier`` (host synchronisation) and ``recv`` from any source (the
  sender is chosen at run time);
* a collective whose tensors are not on the capturing device (a gloo collective on CPU tensors
  inside a CUDA capture would run once, at capture, and never at replay).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from devgraph._errors import CaptureError

__all__ = [
    "OBJECT_COLLECTIVES",
    "is_collective",
    "object_collective_on_stack",
    "refuse_collective",
    "refuse_object_collective",
]

_NAMESPACES = ("c10d::", "_c10d_functional::")

#: torch.distributed functions that move Python objects (pickled into byte tensors, sizes read on the host).
OBJECT_COLLECTIVES = frozenset(
    {
        "all_gather_object",
        "gather_object",
        "broadcast_object_list",
        "scatter_object_list",
        "send_object_list",
        "recv_object_list",
    }
)

_REFUSED = {
    "c10d::barrier": "barrier synchronises the host with the other ranks",
    "c10d::monitored_barrier_": "monitored_barrier synchronises the host with the other ranks",
    "c10d::recv_any_source_": "recv from any source picks its sender at run time",
}

_OBJECT_REMEDY = (
    "exchange Python objects before capture (or after replay); inside the captured region use tensor "
    "collectives (dist.all_reduce, all_gather_into_tensor, ...) on device tensors of fixed shape"
)


def is_collective(name: str) -> bool:
    """True for a ``torch.distributed`` op (``c10d::`` or ``_c10d_functional::``) by schema name."""
    return name.startswith(_NAMESPACES)


def object_collective_on_stack() -> str | None:
    """The ``torch.distributed`` object collective being called on this thread's stack, if any."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name in OBJECT_COLLECTIVES and code.co_filename.endswith("distributed_c10d.py"):
            return code.co_name
        frame = frame.f_back  # type: ignore[assignment]
    return None


def refuse_object_collective(source: Callable[[], str | None]) -> None:
    """Raise ``CaptureError`` if an object collective is on the stack (called where capture refuses
    an op, so that the error names the collective rather than the host sync it makes)."""
    name = object_collective_on_stack()
    if name is not None:
        raise CaptureError(
            f"torch.distributed.{name} inside graph capture: object collectives pickle Python objects "
            "and read their sizes on the host, which a graph cannot replay",
            op=f"torch.distributed.{name}",
            source=source(),
            remedy=_OBJECT_REMEDY,
        )


def refuse_collective(
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    device_type: str | None,
    source: Callable[[], str | None],
) -> None:
    """Raise ``CaptureError`` if collective op ``func`` cannot be captured on ``device_type``.

    ``source`` gives the user's source line (called only to raise). ``device_type=None`` skips
    the device check (an op recorder, which holds whatever device it is given).
    """
    import torch
    from torch.utils._pytree import tree_flatten

    name = func._schema.name
    refuse_object_collective(source)
    why = _REFUSED.get(name)
    if why is not None:
        raise CaptureError(
            f"{why}: a graph cannot replay it",
            op=name,
            source=source(),
            remedy="call it before capture or after replay, outside the captured region",
        )
    others = sorted(
        {
            t.device.type
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor) and t.device.type != device_type
        }
        if device_type is not None
        else ()
    )
    if others:
        raise CaptureError(
            f"a collective on {others[0]} tensors inside a {device_type} capture: the {device_type} graph "
            f"would not hold it, so it would run once at capture and never at replay",
            op=name,
            source=source(),
            remedy=f"use a process group whose backend runs on {device_type} (nccl on cuda, hccl on npu) "
            f"with {device_type} tensors, or move the collective outside the captured region",
        )
