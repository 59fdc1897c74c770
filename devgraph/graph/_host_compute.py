"""Host computation inside a device capture: refused where its result would be frozen.

A device graph (CUDA, NPU) records the work launched on the device. An op whose tensors are all on
the CPU launches nothing there: it runs once, while capturing, and a replay neither runs it again nor
sees what it would compute now. When such an op reads a CPU tensor that existed before the capture
(a model left on the CPU, an input or a counter the caller changes between calls), the graph holds
the value of capture time and replays it silently. ``HostCompute`` follows one capture's ops and
refuses that case by name: a host op that reads a pre-capture CPU tensor, computes (is not a view),
and returns no device tensor.

What stays allowed: views (they compute nothing: the op that reads them is checked), host ops over
tensors made inside the capture (from shapes and constants: the same at every call), copies whose
result is on the device (a pinned host buffer uploaded each replay, a 0-d CPU tensor given to a
device kernel as a scalar; pageable uploads are refused earlier, by the capture's host-sync check),
and everything on the CPU reference backend, whose graphs record host ops.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

from devgraph._errors import CaptureError
from devgraph._source import user_source_line
from devgraph.graph._break_calls import storage
from devgraph.graph._flat import tensor_leaves
from devgraph.graph._opnames import writes_arguments

__all__ = ["HostCompute", "for_capture", "shared_across"]

#: One record for several captures (a breakable capture's segments: a CPU tensor one segment made
#: is still made inside the capture when the next reads it).
_SHARED: contextvars.ContextVar[HostCompute | None] = contextvars.ContextVar(
    "devgraph_host_compute", default=None
)

REMEDY = (
    "put the tensor on the graph's device before capture (model.to(device), inputs on the device), or "
    "compute it before capture and pass the result in; a value that changes between calls belongs in a "
    "device buffer refilled before each replay"
)


class HostCompute:
    """One capture's record of the CPU tensors it made, and the check of every op it sees."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self.made: set[int] = set()  # storages of CPU tensors made inside this capture

    def check(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> None:
        """Refuse op ``func`` if it computed on the host from a pre-capture CPU tensor; else remember
        the CPU tensors it made. Called after the op ran (its result tells where it ran)."""
        name = func._schema.name
        outside = None
        inputs: set[int] = set()
        for t in tensor_leaves((args, kwargs)):  # an op's arguments: flat by schema
            ptr = storage(t)
            inputs.add(ptr)
            if outside is None and t.device.type == "cpu" and ptr and ptr not in self.made:
                outside = t
        results = tensor_leaves(result)
        # A view computes nothing (the op that reads it is checked); an op writing an input does.
        computed = (
            not results or writes_arguments(func._schema) or any(storage(r) not in inputs for r in results)
        )
        if outside is not None and computed and not any(r.device.type == self.device_type for r in results):
            raise CaptureError(
                f"{name} computes on the CPU from a CPU tensor {tuple(outside.shape)} made before "
                f"capture: a {self.device_type} graph records device work only, so this op ran once, "
                "at capture, and every replay would reuse that result (later values of the tensor "
                "ignored)",
                op=name,
                source=user_source_line(),
                remedy=REMEDY,
            )
        for r in results:
            if r.device.type == "cpu":
                ptr = storage(r)
                if ptr and ptr not in inputs:  # a view of an input is still what the input is
                    self.made.add(ptr)


def for_capture(device_type: str) -> HostCompute | None:
    """The record a capture on ``device_type`` checks its ops with (None on the CPU, whose graphs
    record host ops): the one ``shared_across`` opened, else a new one."""
    if device_type == "cpu":
        return None
    shared = _SHARED.get()
    return shared if shared is not None and shared.device_type == device_type else HostCompute(device_type)


@contextlib.contextmanager
def shared_across(device_type: str) -> Iterator[None]:
    """Let every capture on ``device_type`` inside the block share one record (see ``_SHARED``)."""
    token = _SHARED.set(HostCompute(device_type) if device_type != "cpu" else None)
    try:
        yield
    finally:
        _SHARED.reset(token)
