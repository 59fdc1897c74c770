"""The Ascend NPU backend over torch_npu's ACL graphs (``torch_npu.npu.NPUGraph``).

Every call goes through the ``torch_npu`` module imported when the device is built
(``torch_npu.npu.X``): never ``torch.npu``, never ``torch.cuda``. Under
``devgraph.testing.simulated_torch_npu()`` that module is the CPU simulator and this code runs
unchanged; the one thing it asks the module is where tensors live
(``torch_npu._devgraph_simulated_device_type``, ``"cpu"`` on the simulator, absent on hardware).

Task update (DESIGN.md, graph contract point 3) follows vllm-ascend: each task group waits on its
own ``ExternalEvent`` captured in front of it; an update re-issues the group's work on a dedicated
update stream between ``graph_task_update_begin/end`` and records the event. A group nobody
updated since the last replay has its event recorded just before the next replay, so the graph
never hangs: it replays with the arguments it last had (stale, as on the CPU reference backend).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import threading
import weakref
from typing import Any

import torch

from devgraph._contract import Device, Event, Graph, MemoryPool, MemoryStats, Stream
from devgraph._errors import DevgraphError
from devgraph._tasks import TaskGroup
from devgraph.backends.npu import _kernels

__all__ = ["NPU_HARDWARE_STREAMS", "NpuDevice", "NpuEvent", "NpuGraph", "NpuPool", "NpuStream"]

logger = logging.getLogger("devgraph.npu")

#: Hardware streams of an Ascend device; ACL graph capture uses streams per captured piece, so a
#: piecewise runner keeps (pieces + 1) * capture sizes within this. Override: DEVGRAPH_NPU_STREAMS.
NPU_HARDWARE_STREAMS = 2048


def _stream_budget() -> int:
    raw = os.environ.get("DEVGRAPH_NPU_STREAMS", "").strip()
    if not raw:
        return NPU_HARDWARE_STREAMS
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise DevgraphError(f"DEVGRAPH_NPU_STREAMS must be a positive integer, got {raw!r}")
    return value


class NpuStream(Stream):
    """A devgraph stream over a ``torch_npu.npu.Stream`` (``native``)."""

    def __init__(self, device: NpuDevice, priority: int = 0, native: Any = None) -> None:
        super().__init__(device, priority)
        self.native = (
            native if native is not None else device._npu.Stream(device=device.index, priority=priority)
        )

    def synchronize(self) -> None:
        self.native.synchronize()

    def query(self) -> bool:
        return bool(self.native.query())

    def wait_event(self, event: Event) -> None:
        if not isinstance(event, NpuEvent):
            raise DevgraphError(f"an npu stream cannot wait on {event!r}")
        self.native.wait_event(event.native)

    def _enter(self) -> Any:
        npu = self.device._npu  # type: ignore[attr-defined]
        previous = npu.current_stream(self.device.index)
        npu.set_stream(self.native)
        return previous

    def _exit(self, token: Any) -> None:
        self.device._npu.set_stream(token)  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        return f"<NpuStream {self.native!r}>"


def _native(stream: Stream | None) -> Any:
    """The torch_npu stream behind a devgraph stream (None: torch_npu's current stream)."""
    if stream is None:
        return None
    if not isinstance(stream, NpuStream):
        raise DevgraphError(f"an npu event cannot be recorded on or waited from {stream!r}")
    return stream.native


class NpuEvent(Event):
    """A devgraph event over a ``torch_npu.npu.Event`` (``native``)."""

    def __init__(self, device: NpuDevice, enable_timing: bool = False) -> None:
        super().__init__(device, enable_timing)
        self.native = device._npu.Event(enable_timing=enable_timing)

    def record(self, stream: Stream | None = None) -> None:
        self.native.record(_native(stream))

    def wait(self, stream: Stream | None = None) -> None:
        self.native.wait(_native(stream))

    def query(self) -> bool:
        return bool(self.native.query())

    def synchronize(self) -> None:
        self.native.synchronize()

    def elapsed_time(self, end: Event) -> float:
        self._check_timing(end)
        return float(self.native.elapsed_time(end.native))  # type: ignore[attr-defined]


class NpuPool(MemoryPool):
    """A graph memory pool: the token of ``torch_npu.npu.graph_pool_handle()`` (``handle``)."""

    def __init__(self, device: NpuDevice) -> None:
        super().__init__(device)
        self.handle = device._npu.graph_pool_handle()


class NpuGraph(Graph):
    """A devgraph graph over ``torch_npu.npu.NPUGraph`` (see the module docstring for task update)."""

    def __init__(self, device: NpuDevice, keep_graph: bool = False) -> None:
        super().__init__(device, keep_graph)
        self.native: Any = None
        self._released: set[int] = set()  # task groups whose event was recorded since the last replay
        self._update: Any = None

    @property
    def _npu(self) -> Any:
        return self.device._npu  # type: ignore[attr-defined]

    def _begin_capture(self, stream: Stream, pool: MemoryPool) -> None:
        if not isinstance(pool, NpuPool):
            raise DevgraphError(f"an npu graph cannot capture into {pool!r}; use device.pool()")
        self._npu.synchronize(self.device.index)  # as torch_npu.npu.graph does: nothing in flight
        self.native = self._npu.NPUGraph()
        self._released = set()
        self.native.capture_begin(pool=pool.handle)

    def _end_capture(self) -> None:
        self.native.capture_end()

    def _abort_capture(self) -> None:
        native, self.native = self.native, None
        if native is None:
            return
        try:
            native.capture_end()
        except Exception:  # the capture already failed; that error is the one to report
            logger.debug("capture_end after a failed capture raised", exc_info=True)
        try:
            native.reset()
        except Exception:
            logger.debug("reset after a failed capture raised", exc_info=True)

    def _replay(self) -> None:
        pending = [g for g in self._tasks if g.index not in self._released]
        if pending:
            current = self._npu.current_stream(self.device.index)
            for group in pending:
                group.handle[1].record(current)  # release the task with the arguments it holds
        self._released = set()
        self.native.replay()

    def _reset(self) -> None:
        if self.native is not None:
            self.native.reset()
        self.native = None
        self._released = set()

    def _task_group_begin(self, group: TaskGroup) -> None:
        npu = self._npu
        stream = npu.current_stream(self.device.index)
        event = npu.ExternalEvent()
        event.wait(stream)
        event.reset(stream)
        npu.graph_task_group_begin(stream)
        group.handle = (None, event)

    def _task_group_end(self, group: TaskGroup) -> None:
        handle = self._npu.graph_task_group_end(self._npu.current_stream(self.device.index))
        group.handle = (handle, group.handle[1])

    def _task_update_begin(self, group: TaskGroup) -> None:
        npu = self._npu
        device: NpuDevice = self.device  # type: ignore[assignment]
        # One update stream per device: graphs updated from several threads take turns on it.
        device._update_lock.acquire()
        stack = contextlib.ExitStack()
        stack.callback(device._update_lock.release)
        try:
            update_stream = device._update_stream()
            # Do not rewrite a task while an earlier replay may still run it.
            update_stream.wait_stream(npu.current_stream(device.index))
            stack.enter_context(npu.stream(update_stream))
            stack.enter_context(_kernels.graph_work())
            npu.graph_task_update_begin(update_stream, group.handle[0])
        except BaseException:
            stack.close()
            raise
        self._update = (update_stream, stack)

    def _task_update_end(self, group: TaskGroup) -> None:
        update_stream, stack = self._update
        self._update = None
        with stack:
            self._npu.graph_task_update_end(update_stream)
            group.handle[1].record(update_stream)
            self._released.add(group.index)

    def call_opaque(self, fn: Any, *args: Any, name: str = "opaque") -> Any:
        """Run ``fn(*args)``; stream capture records what it launches.

        The simulator's graphs record dispatcher calls instead, so they are handed ``fn`` to record
        as one unit (``NPUGraph._devgraph_call_opaque``, absent on hardware).
        """
        record = getattr(self.native, "_devgraph_call_opaque", None)
        if record is not None and self._state == "capturing":
            return record(fn, args, name)
        return fn(*args)


class NpuDevice(Device):
    """One Ascend NPU, through torch_npu (or the devgraph.testing simulator)."""

    name = "npu"
    dispatch_key = "PrivateUse1"
    capture_stream_budget = NPU_HARDWARE_STREAMS  # per instance: DEVGRAPH_NPU_STREAMS overrides
    updatable_ops = ("devgraph::paged_decode_attention",)

    def __init__(self, index: int = 0) -> None:
        import torch_npu

        super().__init__(index)
        self._torch_npu = torch_npu
        self._npu = torch_npu.npu
        self.capture_stream_budget = _stream_budget()
        self._simulated_type: str | None = getattr(torch_npu, "_devgraph_simulated_device_type", None)
        self._streams: weakref.WeakValueDictionary[Any, NpuStream] = weakref.WeakValueDictionary()
        self._updates: Any = None
        self._update_lock = threading.Lock()
        # torchair (Ascend's graph compiler) compiles pieces where it can be imported; else eager.
        self.default_compile_backend = "torchair" if importlib.util.find_spec("torchair") else "eager"

    @property
    def simulated(self) -> bool:
        """True on the devgraph.testing torch_npu simulator (tensors are CPU tensors)."""
        return self._simulated_type is not None

    @property
    def torch_device(self) -> torch.device:
        if self._simulated_type is not None:
            return torch.device(self._simulated_type)
        return torch.device("npu", self.index)

    def synchronize(self) -> None:
        self._npu.synchronize(self.index)

    def _wrap(self, native: Any) -> NpuStream:
        stream = self._streams.get(native)
        if stream is None:
            stream = NpuStream(self, native=native)
            self._streams[native] = stream
        return stream

    def stream(self, priority: int = 0) -> Stream:
        stream = NpuStream(self, priority)
        self._streams[stream.native] = stream
        return stream

    def current_stream(self) -> Stream:
        return self._wrap(self._npu.current_stream(self.index))

    def _update_stream(self) -> Any:
        """The stream task updates are issued on (one per device, made on first use)."""
        if self._updates is None:
            self._updates = self._npu.Stream(device=self.index)
        return self._updates

    def event(self, enable_timing: bool = False) -> Event:
        return NpuEvent(self, enable_timing)

    def graph(self, keep_graph: bool = False) -> Graph:
        return NpuGraph(self, keep_graph)

    def pool(self) -> MemoryPool:
        return NpuPool(self)

    def memory_stats(self) -> MemoryStats:
        npu = self._npu
        return MemoryStats(
            allocated=int(npu.memory_allocated(self.index)),
            reserved=int(npu.memory_reserved(self.index)),
            peak_allocated=int(npu.max_memory_allocated(self.index)),
        )
