"""The generic backend: devgraph's contract over ``torch.accelerator.Graph``, ``torch.Stream``,
``torch.Event`` and ``torch.accelerator``'s stream and memory functions (torch 2.12+).

It holds what torch's contract holds: capture on a side stream into a pool (torch's pool is a
``tuple[int, int]`` id, known once a graph captured into it: a devgraph pool takes the id of its first
graph and hands it to the rest), replay on the same memory, reset, ``capture_error_mode``, and
``enable_debug_mode`` / ``debug_dump``. torch's graph has no task update, so this backend declares no
updatable ops; a task group is captured as ordinary work and re-issuing it (``update``,
``task_update``, ``replay(host_args)``) raises: host arguments stay frozen at capture (keep changing
values in device tensors). devgraph's own ops have kernels for CPU, CUDA and PrivateUse1 only; on another
device type a devgraph op has no kernel and fails when called, it never computes something else.

Every call goes through the ``api`` the device was built with: torch itself (``torch.accelerator``,
``torch.Stream``, ``torch.Event``), or a stand-in with the same Python API
(``devgraph_sim.accelerator``).
"""

from __future__ import annotations

import logging
import types
import weakref
from typing import Any

import torch

from devgraph._errors import DevgraphError
from devgraph.graph import Device, Event, Graph, MemoryPool, MemoryStats, Stream, TaskGroup

__all__ = [
    "AcceleratorDevice",
    "AcceleratorEvent",
    "AcceleratorGraph",
    "AcceleratorPool",
    "AcceleratorStream",
]

logger = logging.getLogger("devgraph.accelerator")

#: torch dispatch keys by device type (PrivateUse1 devices are looked up by their registered name).
_DISPATCH_KEYS = {"cpu": "CPU", "xpu": "XPU", "mps": "MPS", "mtia": "MTIA", "hpu": "HPU", "maia": "MAIA"}


def torch_api() -> types.SimpleNamespace:
    """torch's own objects: ``accelerator``, ``Stream``, ``Event``."""
    return types.SimpleNamespace(accelerator=torch.accelerator, Stream=torch.Stream, Event=torch.Event)


def _dispatch_key(kind: str) -> str:
    if kind in _DISPATCH_KEYS:
        return _DISPATCH_KEYS[kind]
    if kind == torch._C._get_privateuse1_backend_name():
        return "PrivateUse1"
    return kind.upper()


class AcceleratorStream(Stream):
    """A devgraph stream over a ``torch.Stream`` (``native``)."""

    def __init__(self, device: AcceleratorDevice, priority: int = 0, native: Any = None) -> None:
        super().__init__(device, priority)
        self.native = (
            native if native is not None else device._api.Stream(device.torch_device, priority=priority)
        )

    def synchronize(self) -> None:
        self.native.synchronize()

    def query(self) -> bool:
        return bool(self.native.query())

    def wait_event(self, event: Event) -> None:
        if not isinstance(event, AcceleratorEvent):
            raise DevgraphError(f"an accelerator stream cannot wait on {event!r}")
        self.native.wait_event(event.native)

    def _enter(self) -> Any:
        acc = self.device._api.accelerator  # type: ignore[attr-defined]
        previous = acc.current_stream(self.device.index)
        acc.set_stream(self.native)
        return previous

    def _exit(self, token: Any) -> None:
        self.device._api.accelerator.set_stream(token)  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        return f"<AcceleratorStream {self.native!r}>"


def _native(stream: Stream | None) -> Any:
    if stream is None:
        return None
    if not isinstance(stream, AcceleratorStream):
        raise DevgraphError(f"an accelerator event cannot be recorded on or waited from {stream!r}")
    return stream.native


class AcceleratorEvent(Event):
    """A devgraph event over a ``torch.Event`` (``native``)."""

    def __init__(self, device: AcceleratorDevice, enable_timing: bool = False) -> None:
        super().__init__(device, enable_timing)
        self.native = device._api.Event(device.torch_device, enable_timing=enable_timing)

    def record(self, stream: Stream | None = None) -> None:
        native = _native(stream)
        if native is None:
            native = self.device._api.accelerator.current_stream(self.device.index)  # type: ignore[attr-defined]
        self.native.record(native)

    def wait(self, stream: Stream | None = None) -> None:
        native = _native(stream)
        if native is None:
            native = self.device._api.accelerator.current_stream(self.device.index)  # type: ignore[attr-defined]
        self.native.wait(native)

    def query(self) -> bool:
        return bool(self.native.query())

    def synchronize(self) -> None:
        self.native.synchronize()

    def elapsed_time(self, end: Event) -> float:
        self._check_timing(end)
        return float(self.native.elapsed_time(end.native))  # type: ignore[attr-defined]


class AcceleratorPool(MemoryPool):
    """A graph memory pool: torch's pool id (``handle``, a ``tuple[int, int]``), taken from the first
    graph that captures into it (None until then: that capture gets a fresh pool)."""

    def __init__(self, device: AcceleratorDevice) -> None:
        super().__init__(device)
        self.handle: tuple[int, int] | None = None


class AcceleratorGraph(Graph):
    """A devgraph graph over ``torch.accelerator.Graph`` (``native``, made at each capture)."""

    def __init__(self, device: AcceleratorDevice, keep_graph: bool = False) -> None:
        super().__init__(device, keep_graph)
        self.native: Any = None
        self._debug = False

    @property
    def _acc(self) -> Any:
        return self.device._api.accelerator  # type: ignore[attr-defined]

    def _begin_capture(self, stream: Stream, pool: MemoryPool) -> None:
        if not isinstance(pool, AcceleratorPool):
            raise DevgraphError(f"an accelerator graph cannot capture into {pool!r}; use device.pool()")
        self._acc.synchronize(self.device.index)  # as torch.accelerator.Graph.__enter__ does
        self.native = self._acc.Graph(
            self.keep_graph, pool=pool.handle, capture_error_mode=self.capture_error_mode
        )
        if self._debug:
            self.native.enable_debug_mode()
        self.native.capture_begin()
        if pool.handle is None:
            pool.handle = tuple(self.native.pool())  # type: ignore[assignment]

    def _end_capture(self) -> None:
        self.native.capture_end()

    def _abort_capture(self) -> None:
        native, self.native = self.native, None
        if native is None:
            return
        for step in (native.capture_end, native.reset):
            try:
                step()
            except Exception:  # the capture already failed; that error is the one to report
                logger.debug("cleaning up a failed capture raised", exc_info=True)

    def _replay(self) -> None:
        self.native.replay()

    def _reset(self) -> None:
        if self.native is not None:
            self.native.reset()
        self.native = None

    def _enable_debug_mode(self) -> None:
        self._debug = True

    def _debug_dump(self, path: str) -> None:
        self.native.debug_dump(path)

    def _no_task_update(self) -> DevgraphError:
        return DevgraphError(
            "torch.accelerator.Graph has no task update, so the accelerator backend cannot re-issue a "
            "task with new host arguments: they stay frozen at capture. Keep values that change between "
            "replays in device tensors (copy new data into them before replay)"
        )

    def _task_group_begin(self, group: TaskGroup) -> None:
        group.handle = None  # captured as ordinary graph work (as on CUDA); re-issuing it is refused

    def _task_group_end(self, group: TaskGroup) -> None:
        pass

    def _task_update_begin(self, group: TaskGroup) -> None:
        raise self._no_task_update()

    def _task_update_end(self, group: TaskGroup) -> None:
        raise self._no_task_update()


class AcceleratorDevice(Device):
    """torch's current accelerator (XPU, a PrivateUse1 device...) through ``torch.accelerator``."""

    name = "accelerator"
    updatable_ops: tuple[str, ...] = ()

    def __init__(self, index: int = 0, api: Any = None) -> None:
        super().__init__(index)
        self._api = api if api is not None else torch_api()
        current = self._api.accelerator.current_accelerator()
        if current is None:
            raise DevgraphError("torch sees no accelerator (torch.accelerator.current_accelerator() is None)")
        self.device_type: str = current.type
        self.dispatch_key = _dispatch_key(self.device_type)
        self._torch_device = (
            torch.device(self.device_type)
            if self.device_type == "cpu"
            else torch.device(self.device_type, index)
        )
        self._streams: weakref.WeakValueDictionary[Any, AcceleratorStream] = weakref.WeakValueDictionary()

    def __repr__(self) -> str:
        return f"<devgraph.Device accelerator:{self.index} ({self.device_type})>"

    @property
    def torch_device(self) -> torch.device:
        return self._torch_device

    def synchronize(self) -> None:
        self._api.accelerator.synchronize(self.index)

    def stream(self, priority: int = 0) -> Stream:
        stream = AcceleratorStream(self, priority)
        self._streams[stream.native] = stream
        return stream

    def current_stream(self) -> Stream:
        native = self._api.accelerator.current_stream(self.index)
        stream = self._streams.get(native)
        if stream is None:
            stream = AcceleratorStream(self, native=native)
            self._streams[native] = stream
        return stream

    def event(self, enable_timing: bool = False) -> Event:
        return AcceleratorEvent(self, enable_timing)

    def graph(self, keep_graph: bool = False) -> Graph:
        return AcceleratorGraph(self, keep_graph)

    def pool(self) -> MemoryPool:
        return AcceleratorPool(self)

    def memory_stats(self) -> MemoryStats:
        acc = self._api.accelerator
        return MemoryStats(
            allocated=int(acc.memory_allocated(self.index)),
            reserved=int(acc.memory_reserved(self.index)),
            peak_allocated=int(acc.max_memory_allocated(self.index)),
        )
