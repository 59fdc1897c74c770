"""Deliberately broken backends: each breaks exactly one property of the graph contract.

Every class here is the CPU reference backend with one thing done wrong, the way a plausible
backend would get it wrong. ``tests/testing/test_conformance_broken.py`` runs the conformance suite against
each one and asserts that the check named for that property fails it -- proof that the check can
catch the bug. ``CorrectDevice`` is the harness itself with nothing broken: it must pass every check.

The reference backend runs work synchronously, so a stream wait that does nothing cannot be told
from one that works there. ``DeferredWrites`` makes streams asynchronous the way a device queue is
-- a stream's last write lands only once something orders it -- and still passes every check;
``WaitIgnored`` is that backend with a stream wait that does nothing.

``Graph``'s public methods are final: a backend overrides private hooks, and a class body that
overrides a public method is refused (``TypeError``). A few properties (the state machine, the locks,
the host-sync check) live in those public methods, so the backends breaking them replace the method
after the class is made (``_replaces_final``), the one way past that refusal: the conformance suite
must catch such a backend too.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

from devgraph._errors import DevgraphError
from devgraph.backends.cpu._device import CpuDevice, CpuEvent, CpuGraph, CpuStream
from devgraph.backends.cpu._pool import Block, CpuPool
from devgraph.backends.cpu._recorder import written_tensors
from devgraph.backends.cuda._device import DeviceMetadataGraph
from devgraph.graph._capture import _call_as_task
from devgraph.graph._contract import Graph, MemoryPool, Stream, current_graph
from devgraph.graph._tasks import TaskGroup

__all__ = ["BROKEN", "CorrectDevice", "DeferredWrites"]


class CorrectDevice(CpuDevice):
    """The reference backend behind the broken ones' scaffolding, nothing broken (the control)."""

    graph_class: type[CpuGraph] = CpuGraph

    def graph(self, keep_graph: bool = False) -> Graph:
        return self.graph_class(self, keep_graph)


def _replaces_final(cls: type[Graph]) -> type[Graph]:
    """Install each ``final_<name>`` method of ``cls`` as ``<name>``, after the class is made: how a
    backend can still replace a final public method of ``Graph`` (a class body doing it is refused)."""
    for attr, value in list(vars(cls).items()):
        if attr.startswith("final_"):
            setattr(cls, attr.removeprefix("final_"), value)
    return cls


class _SpyGraph(CpuGraph):
    """A CPU graph that sees every op issued during its capture, above the recorder (``_spy``)."""

    def _spy(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        """Return the arguments to run ``func`` with (default: unchanged)."""
        return args, kwargs

    def _spied(self, func: Any, result: Any) -> None:
        """Look at ``func``'s result."""

    def _begin_capture(self, stream: Stream, pool: MemoryPool) -> None:
        super()._begin_capture(stream, pool)
        graph = self

        class Spy(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                args, kwargs = graph._spy(func, args, kwargs or {})
                result = func(*args, **kwargs)
                graph._spied(func, result)
                return result

        self._spy_mode = Spy()
        self._spy_mode.__enter__()

    def _leave_spy(self) -> None:
        mode = self.__dict__.pop("_spy_mode", None)
        if mode is not None:
            mode.__exit__(None, None, None)

    def _end_capture(self) -> None:
        self._leave_spy()
        super()._end_capture()

    def _abort_capture(self) -> None:
        self._leave_spy()
        super()._abort_capture()


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


# -- capture on the capture stream -----------------------------------------------------------------


class FreshCaptureStream(CorrectDevice):
    """Hands out a new capture stream per capture, so graphs sharing a pool capture on different
    streams (CUDA's allocator then cannot reuse the pool's blocks across them)."""

    def capture_stream(self) -> Stream:
        return self.stream()


class _StreamNeverCurrent(CpuStream):
    def _enter(self) -> Any:
        return self.device.current_stream()  # forgets to make itself current


class StreamNotEntered(CorrectDevice):
    """``with stream:`` does not make the stream current, so capture runs on the caller's stream."""

    def stream(self, priority: int = 0) -> Stream:
        return _StreamNeverCurrent(self, priority)


class _ChecksAnotherStreamGraph(CpuGraph):
    def _begin_capture(self, stream: Stream, pool: MemoryPool) -> None:
        # Validates a side stream of its own instead of the one the capture runs on.
        super()._begin_capture(self.device.stream(), pool)


class CapturesOnDefaultStream(CorrectDevice):
    """Accepts a capture on the default stream (it checks the wrong stream)."""

    graph_class = _ChecksAnotherStreamGraph


# -- pools -------------------------------------------------------------------------------------------


class _IgnoresPoolGraph(CpuGraph):
    def _begin_capture(self, stream: Stream, pool: MemoryPool) -> None:
        super()._begin_capture(stream, self.device.pool())  # a private pool, whatever was asked


class IgnoresPool(CorrectDevice):
    """``capture(pool=p)`` allocates in a private pool of its own; ``graph.pool()`` still says ``p``."""

    graph_class = _IgnoresPoolGraph


class _NeverReusingPool(CpuPool):
    def allocate(self, nbytes: int) -> Block:
        # Every block looks in use, so the allocator never hands a freed block out again.
        pinned = [torch.empty(0, dtype=torch.uint8).set_(block.storage) for block in self.blocks]
        try:
            return super().allocate(nbytes)
        finally:
            del pinned


class PoolNeverReuses(CorrectDevice):
    """Pools grow by a new block for every allocation: graphs sharing a pool never share memory."""

    def pool(self) -> MemoryPool:
        return _NeverReusingPool(self, self._pool_bytes)


class _HoldsOutputsGraph(_SpyGraph):
    def _spied(self, func: Any, result: Any) -> None:
        self.__dict__.setdefault("_produced", []).extend(weakref.ref(t) for t in _tensors(result))

    def _end_capture(self) -> None:
        super()._end_capture()
        alive = [ref() for ref in self.__dict__.pop("_produced", [])]
        self._held = [t for t in alive if t is not None]  # what the caller holds: the outputs


class HoldsOutputs(CorrectDevice):
    """The graph keeps strong references to its outputs, so their memory never returns to the pool."""

    graph_class = _HoldsOutputsGraph


class _HoldsTaskArgumentsGraph(_SpyGraph):
    def _spy(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        if func._schema.name in self.device.updatable_ops:
            self.__dict__.setdefault("_task_args", []).append((args, kwargs))  # to re-issue later
        return args, kwargs


class HoldsTaskArguments(CorrectDevice):
    """Keeps the tensor arguments of its updatable tasks alive (vLLM/vllm-ascend hold them weakly)."""

    graph_class = _HoldsTaskArgumentsGraph


@_replaces_final
class _RecapturesGraph(CpuGraph):
    @contextlib.contextmanager
    def final_capture(self, *args: Any, **kwargs: Any) -> Iterator[Graph]:
        if self._state == "captured":
            self._state = "new"  # silently drops the captured work instead of asking for reset()
        with super().capture(*args, **kwargs) as graph:
            yield graph


class RecaptureWithoutReset(CorrectDevice):
    """Capturing an already captured graph silently replaces its work (no ``reset()`` needed)."""

    graph_class = _RecapturesGraph


@_replaces_final
class _ResetKeepsPoolGraph(CpuGraph):
    def final_reset(self) -> None:
        """Its own reset, which never tells the pool the graph let go of it."""
        with self._lock:
            self._reset()
            self._tasks = []
            self._state = "new"


class ResetKeepsPool(CorrectDevice):
    """``reset()`` does not release the pool, so a pool whose graphs were all reset is captured
    into again (CUDA's allocator asserts on that)."""

    graph_class = _ResetKeepsPoolGraph


# -- replay on the capture-time memory -------------------------------------------------------------


class _ReplayDoesNothingGraph(CpuGraph):
    def _replay(self) -> None:
        pass


class ReplayDoesNothing(CorrectDevice):
    """``replay()`` returns without running the work: outputs keep their capture-time values."""

    graph_class = _ReplayDoesNothingGraph


class _SnapshotsInputsGraph(_SpyGraph):
    def _spy(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        produced: set[int] = self.__dict__.setdefault("_produced", set())
        kept: list[torch.Tensor] = self.__dict__.setdefault("_snapshots", [])
        written = {id(t) for t in written_tensors(func, args, kwargs)}

        def snapshot(x: Any) -> Any:
            if not isinstance(x, torch.Tensor) or id(x) in written:
                return x
            if x.untyped_storage().data_ptr() in produced:
                return x
            with _disable_current_modes():  # a copy the recorder does not see: replay reads it
                copy = x.clone()
            kept.append(copy)  # held by the graph, so it is a live (stale) input, not a freed one
            return copy

        return tree_map(snapshot, args), tree_map(snapshot, kwargs)

    def _spied(self, func: Any, result: Any) -> None:
        self._produced.update(t.untyped_storage().data_ptr() for t in _tensors(result))


class ReplaySnapshotsInputs(CorrectDevice):
    """Capture reads copies of its input tensors, so replay ignores new data copied into them."""

    graph_class = _SnapshotsInputsGraph


# -- host arguments and task update ------------------------------------------------------------------


class _HostArgsLiveGraph(CpuGraph):
    def _call_opaque(self, fn: Callable[..., Any], args: tuple[Any, ...], name: str) -> Any:
        # Records a closure over the caller's own argument objects: a list the caller changes in
        # place after capture is read, changed, at every replay.
        return super()._call_opaque(lambda: fn(*args), (), name)


class HostArgsLive(CorrectDevice):
    """``call_opaque`` keeps the caller's host lists by reference: read at replay, not frozen."""

    graph_class = _HostArgsLiveGraph


class _UpdateIgnoredGraph(CpuGraph):
    def _needs_reissue(self, group: TaskGroup) -> bool:
        return False  # claims CUDA's no-op update though its kernel reads the host list


class UpdateIgnored(CorrectDevice):
    """``update()``/``replay(host_args)`` record the new host values but never re-issue the task."""

    graph_class = _UpdateIgnoredGraph


class _NotesHostArgsGraph(DeviceMetadataGraph, CpuGraph):
    def _needs_reissue(self, group: TaskGroup) -> bool:
        return False  # CUDA's hooks, though this kernel reads the host list


class HostArgsOnlyNoted(CorrectDevice):
    """Takes CUDA's ``replay(host_args)`` hook (note the values, replay) for a kernel that reads them
    from the host: the replay runs with the captured lengths."""

    graph_class = _NotesHostArgsGraph


# -- host syncs --------------------------------------------------------------------------------------


class _AutoTasks(TorchDispatchMode):
    """Captures every call of the named ops as an updatable task (what devgraph's capture does)."""

    def __init__(self, graph: Graph, ops: Sequence[str]) -> None:
        super().__init__()
        self.graph, self.ops = graph, frozenset(ops)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in self.ops and self.graph._open_group is None:
            return _call_as_task(self.graph, func, args, kwargs or {})
        return func(*args, **(kwargs or {}))


@_replaces_final
class _NoSyncCheckGraph(CpuGraph):
    @contextlib.contextmanager
    def final_capture(
        self,
        stream: Stream | None = None,
        pool: MemoryPool | None = None,
        *,
        auto_update_ops: Sequence[str] = (),
    ) -> Iterator[Graph]:
        """Its own capture: states, lock, stream, pool and auto tasks, but no host-sync check
        (``devgraph.graph._capture.capturing``)."""
        if self._state != "new":
            raise DevgraphError(f"cannot capture a graph that is {self._state}; reset() it first")
        stream = stream or self.device.capture_stream()
        self._pool = pool or self.device.pool()
        self._tasks = []
        self._state = "capturing"
        with self.device.capture_lock(), stream:
            self._pool._enlist(self)
            self._begin_capture(stream, self._pool)
            try:
                with _AutoTasks(self, auto_update_ops):
                    yield self
            except BaseException:
                self._abort_capture()
                self._pool._release(self)
                self._state = "new"
                raise
            self._end_capture()
        self._state = "captured"


class NoHostSyncCheck(CorrectDevice):
    """Replaces ``capture`` and leaves out the host-sync check: ``.item()`` records a frozen value."""

    graph_class = _NoSyncCheckGraph


# -- locks -------------------------------------------------------------------------------------------


class CapturesNotSerialised(CorrectDevice):
    """A new capture lock per capture: threads capture on one device at the same time."""

    def capture_lock(self) -> threading.RLock:
        return threading.RLock()


@_replaces_final
class _UncheckedReplayGraph(CpuGraph):
    def final_replay(self, host_args: Any = None) -> None:
        with self._lock:
            if host_args is not None:
                self.update(host_args)
            self._replay()  # a graph never captured replays nothing, silently


class ReplayOfNothing(CorrectDevice):
    """``replay()`` of a graph that was never captured (or was reset) returns without a word."""

    graph_class = _UncheckedReplayGraph


class WeakRefCopies(CorrectDevice):
    """``weak_ref()`` returns a copy: not the captured memory, and it keeps its own alive."""

    def weak_ref(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone()


@_replaces_final
class _UnlockedReplayGraph(CpuGraph):
    def final_replay(self, host_args: Any = None) -> None:
        if self._state != "captured":
            raise DevgraphError("replay() of a graph that was never captured")
        if host_args is not None:
            self.update(host_args)
        self._replay()  # without the graph's lock


class ReplayWithoutLock(CorrectDevice):
    """``replay()`` skips the per-graph lock, so it can run in the middle of a task update."""

    graph_class = _UnlockedReplayGraph


# -- stream ordering ---------------------------------------------------------------------------------


class _DeferWrites(TorchDispatchMode):
    """Active while a ``_DeferredStream`` is current: its in-place writes are queued, not run.

    Only in-place writes are deferred: they are what another stream can observe as stale (a fresh
    result's memory had no defined contents before it was written anyway).
    """

    def __init__(self, stream: _DeferredStream) -> None:
        super().__init__()
        self.stream = stream

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if current_graph() is not None:  # a capture records the work; nothing runs late
            return func(*args, **kwargs)
        self.stream.flush()  # the stream's own earlier work comes first (program order)
        written = written_tensors(func, args, kwargs)
        if not written:
            return func(*args, **kwargs)
        self.stream.pending.append(lambda: func(*args, **kwargs))
        returns = len(func._schema.returns)
        return None if returns == 0 else written[0] if returns == 1 else tuple(written[:returns])


class _DeferredStream(CpuStream):
    """A stream whose last write lands late, as on a device: until a wait, a synchronize or the
    stream's own next op orders it, another stream reads the memory as it was."""

    def __init__(self, device: DeferredWrites, priority: int = 0) -> None:
        super().__init__(device, priority)
        self.pending: list[Callable[[], Any]] = []
        device._deferred.add(self)

    def flush(self) -> None:
        with _disable_current_modes():  # the queued ops run as issued, on no other stream
            while self.pending:
                self.pending.pop(0)()

    def synchronize(self) -> None:
        self.flush()

    def query(self) -> bool:
        return not self.pending

    def wait_event(self, event: Any) -> None:
        super().wait_event(event)
        event.complete()  # the work recorded before the event is done before this stream's next

    def _enter(self) -> Any:
        previous = super()._enter()
        mode = _DeferWrites(self)
        mode.__enter__()
        return previous, mode

    def _exit(self, token: Any) -> None:
        previous, mode = token
        mode.__exit__(None, None, None)
        super()._exit(previous)


class _DeferredEvent(CpuEvent):
    _stream: Stream | None = None

    def record(self, stream: Stream | None = None) -> None:
        super().record(stream)
        self._stream = stream or self.device.current_stream()

    def complete(self) -> None:
        if isinstance(self._stream, _DeferredStream):
            self._stream.flush()

    def synchronize(self) -> None:
        self.complete()

    def query(self) -> bool:
        return self._stream is None or self._stream.query()


class DeferredWrites(CorrectDevice):
    """Not broken: streams are asynchronous (a stream's last write lands late) and waits, events and
    synchronize order them -- the control showing the stream checks can see a missing wait."""

    def __init__(self, index: int = 0) -> None:
        super().__init__(index)
        self._deferred: weakref.WeakSet[_DeferredStream] = weakref.WeakSet()

    def stream(self, priority: int = 0) -> Stream:
        return _DeferredStream(self, priority)

    def event(self, enable_timing: bool = False) -> Any:
        return _DeferredEvent(self, enable_timing)

    def synchronize(self) -> None:
        for stream in list(self._deferred):
            stream.flush()


class _WaitIgnoredStream(_DeferredStream):
    def wait_event(self, event: Any) -> None:
        pass  # forgets to order anything


class WaitIgnored(DeferredWrites):
    """``DeferredWrites`` whose stream waits (``wait_event``, hence ``wait_stream``) do nothing."""

    def stream(self, priority: int = 0) -> Stream:
        return _WaitIgnoredStream(self, priority)


#: Each broken backend and the conformance check named for the property it breaks.
BROKEN: dict[type[CorrectDevice], str] = {
    FreshCaptureStream: "check_capture_runs_on_capture_stream",
    StreamNotEntered: "check_capture_runs_on_capture_stream",
    CapturesOnDefaultStream: "check_capture_refuses_default_stream",
    IgnoresPool: "check_capture_allocates_in_given_pool",
    PoolNeverReuses: "check_capture_allocates_in_given_pool",
    ResetKeepsPool: "check_reset_pool_not_captured_into",
    RecaptureWithoutReset: "check_reset_and_recapture",
    HoldsOutputs: "check_graph_holds_outputs_weakly",
    HoldsTaskArguments: "check_tasks_hold_arguments_weakly",
    ReplayDoesNothing: "check_output_memory_reuse",
    ReplaySnapshotsInputs: "check_input_rebinding_by_copy",
    HostArgsLive: "check_host_args_frozen",
    UpdateIgnored: "check_task_update",
    HostArgsOnlyNoted: "check_task_update",
    NoHostSyncCheck: "check_capture_error_on_host_sync",
    CapturesNotSerialised: "check_captures_serialised_per_device",
    ReplayWithoutLock: "check_update_and_replay_serialised",
    ReplayOfNothing: "check_replay_without_capture",
    WeakRefCopies: "check_weak_ref",
    WaitIgnored: "check_event_orders_streams",
}
