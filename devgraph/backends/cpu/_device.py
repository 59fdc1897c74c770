"""The CPU reference backend: a faithful simulator of graph semantics, not a speed path.

Capture records the aten ops that run (see ``_recorder``); replay re-executes the record with the
host arguments frozen at capture, on the capture-time memory. It is at least as strict as CUDA and
NPU: host syncs raise ``CaptureError``, host arguments go stale unless updated, outputs are
overwritten by the next replay, graphs sharing a pool reuse each other's dead blocks. Work runs
synchronously, so streams and events only keep order and time (with a monotonic clock).

Use it to check "will my model capture?" on a machine without an accelerator. Replay on it is
*slower* than eager; speed-ups come on cuda and npu.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from devgraph._errors import DevgraphError
from devgraph.backends.cpu._pool import CpuPool, PoolBytes
from devgraph.backends.cpu._recorder import Recorder, Segment, Tape
from devgraph.graph import Device, Event, Graph, MemoryPool, MemoryStats, Stream, TaskGroup

__all__ = ["CpuDevice", "CpuEvent", "CpuGraph", "CpuStream"]


class CpuStream(Stream):
    """A stream of the reference backend: work is synchronous, so it only tracks "current"."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def wait_event(self, event: Event) -> None:
        if not isinstance(event, CpuEvent):
            raise DevgraphError(f"cannot wait on {event!r} from a cpu stream")

    def _enter(self) -> Any:
        dev: CpuDevice = self.device  # type: ignore[assignment]
        previous = dev.current_stream()
        dev._tls.stream = self
        return previous

    def _exit(self, token: Any) -> None:
        self.device._tls.stream = token  # type: ignore[attr-defined]


class CpuEvent(Event):
    """An event of the reference backend, timed with ``time.perf_counter_ns``."""

    def __init__(self, device: Device, enable_timing: bool = False) -> None:
        super().__init__(device, enable_timing)
        self._t: int | None = None

    def record(self, stream: Stream | None = None) -> None:
        self._t = time.perf_counter_ns()

    def wait(self, stream: Stream | None = None) -> None:
        (stream or self.device.current_stream()).wait_event(self)

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: Event) -> float:
        self._check_timing(end)
        if self._t is None or getattr(end, "_t", None) is None:
            raise DevgraphError("elapsed_time needs both events recorded first")
        return (end._t - self._t) / 1e6  # type: ignore[attr-defined]


class CpuGraph(Graph):
    """A graph of the reference backend (see the module docstring)."""

    def __init__(self, device: Device, keep_graph: bool = False) -> None:
        super().__init__(device, keep_graph)
        self._tape = Tape()

    def _begin_capture(self, stream: Stream, pool: MemoryPool) -> None:
        if stream is getattr(self.device, "_default_stream", None):
            raise DevgraphError(
                "cannot capture on the default stream (CUDA refuses it too): pass a side stream, "
                "device.stream(), or none to get one"
            )
        if not isinstance(pool, CpuPool):
            raise DevgraphError(f"a cpu graph cannot capture into {pool!r}")
        self._tape.begin(pool)

    def _end_capture(self) -> None:
        self._tape.end()

    def _abort_capture(self) -> None:
        self._tape.abandon()

    def _replay(self) -> None:
        self._tape.replay()

    def _reset(self) -> None:
        self._tape.abandon()

    def _task_group_begin(self, group: TaskGroup) -> None:
        group.handle = self._tape.open_group(group.index)

    def _task_group_end(self, group: TaskGroup) -> None:
        self._tape.close_group()

    def _task_update_begin(self, group: TaskGroup) -> None:
        old: Segment = group.handle
        new = Segment(group.index)
        recorder = Recorder(self.pool(), new, reissue=list(old.fresh))  # type: ignore[arg-type]
        recorder.__enter__()
        self._update = (recorder, old, new)

    def _task_update_end(self, group: TaskGroup) -> None:
        recorder, old, new = self._update
        recorder.__exit__(None, None, None)
        del self._update
        recorder.check_generators()  # re-seeding inside a re-issue is refused like capture
        if recorder._reissued != len(old.fresh):
            raise DevgraphError(
                f"task {group.index} ({group.op}) was re-issued with {recorder._reissued} outputs, "
                f"captured with {len(old.fresh)}; re-issue exactly the captured calls"
            )
        self._tape.replace(old, new)
        group.handle = new

    def _task_update_abort(self, group: TaskGroup) -> None:
        recorder, _, _ = self._update
        recorder.__exit__(None, None, None)
        del self._update  # the captured segment stays in place

    @property
    def recorded_ops(self) -> list[str]:
        """Names of the recorded calls, in replay order (for tests and debugging)."""
        return self._tape.ops


class CpuDevice(Device):
    """The CPU reference device (see the module docstring)."""

    name = "cpu"
    dispatch_key = "CPU"
    updatable_ops = ("devgraph::paged_decode_attention",)

    def __init__(self, index: int = 0) -> None:
        if index != 0:
            raise DevgraphError("the cpu reference backend has one device, index 0")
        super().__init__(index)
        self._tls = threading.local()
        self._default_stream = CpuStream(self)
        self._pool_bytes = PoolBytes()  # what this device's pools hold

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu")

    def synchronize(self) -> None:
        pass

    def stream(self, priority: int = 0) -> Stream:
        return CpuStream(self, priority)

    def current_stream(self) -> Stream:
        return getattr(self._tls, "stream", None) or self._default_stream

    def event(self, enable_timing: bool = False) -> Event:
        return CpuEvent(self, enable_timing)

    def graph(self, keep_graph: bool = False) -> Graph:
        return CpuGraph(self, keep_graph)

    def pool(self) -> MemoryPool:
        return CpuPool(self, self._pool_bytes)

    def memory_stats(self) -> MemoryStats:
        """Bytes in graph pools (the reference backend does not see torch's CPU allocator)."""
        counter = self._pool_bytes
        return MemoryStats(allocated=counter.reserved, reserved=counter.reserved, peak_allocated=counter.peak)
