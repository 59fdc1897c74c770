"""The runtime half of the torch_npu simulator: streams, events, graphs, task groups, memory.

Every public name mirrors ``torch_npu.npu`` 2.13.0 with the same parameters (names, order,
defaults, keyword-only-ness; ``tests/backends/npu/test_npu_signatures.py`` checks them against the wheel), except
``SIMULATOR_ONLY``. Device work is asynchronous: replays, task rewrites and event records/waits are
queued on their stream and run as ``devgraph_sim.npu._streams`` schedules them (eager or
lazy mode); host tensor ops run when issued.

Graphs hold the CPU reference backend's ``Tape`` (its ``Recorder``, ``Segment`` and ``BlockPool``),
so capture, replay, memory pools and frozen host arguments behave exactly as on the reference
backend. What the simulator adds is the ACL graph machinery around task update:

* ``ExternalEvent.wait/reset`` on a capturing stream become steps of the graph. At replay, a wait
  on an event nobody recorded since the last reset stops the replay until it is recorded; if
  nothing will record it, a host sync raises ``SimulatedHang`` naming the task group.
* What a graph records is what the NPU kernels launch: a ``devgraph::`` op is a Python kernel over
  torch_npu ops, not a launch, so its torch_npu / aten ops are recorded one by one (as stream
  capture would), not the devgraph op as one step.
* ``graph_task_group_begin/end`` cut the capture into segments; ``graph_task_update_begin/end``
  re-record one group's segment from the calls issued between them (running nothing) and queue its
  rewrite on the update stream, as the hardware rewrites the captured tasks' parameters; a replay
  reaching the group before the rewrite runs the old tasks. There is no abort: a partial re-issue
  is committed. The re-issued calls must be the captured ones (same ops, in order),
  and they may only touch memory that outlives the update (graph-pool memory, or tensors that
  existed before it): memory allocated during the update -- a fresh output, a converted copy, a
  staging buffer -- is freed when the update returns while the rewritten task keeps its address,
  so touching it raises ``RuntimeError("simulated NPU task update reads/writes memory allocated
  during the update: ...")`` (a use-after-free at replay on hardware).
* ``graph(..., auto_dispatch_capture=True)`` + ``NPUGraph.update(cpu_update_input)`` follow
  ``torch_npu/npu/graphs.py`` (``_GraphDispatchMode``) step by step.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Callable
from copy import deepcopy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes, _get_current_dispatch_mode
from torch.utils._pytree import tree_flatten

from devgraph.backends.cpu._collectives import issued_by_torch_distributed
from devgraph.backends.cpu._pool import BlockPool, PoolBytes, block_of, tensor_bytes
from devgraph.backends.cpu._recorder import (
    _UNINITIALISED,
    Entry,
    Recorder,
    Segment,
    Tape,
    _is_view,
    finish_deferred,
    refuse_collective_in_task,
    refuse_unrecordable_kinds,
    written_tensors,
)
from devgraph.backends.cpu._rng import is_random
from devgraph.graph._collectives import is_collective
from devgraph.graph._weakref import weak_ref_tensor
from devgraph_sim.npu._handlers import _NPU_GRAPH_OP_HANDLERS
from devgraph_sim.npu._ops import NAMESPACE as _SIM_NAMESPACE
from devgraph_sim.npu._ops import check_call
from devgraph_sim.npu._streams import Call, Scheduler, Work

__all__ = [
    "Event",
    "ExternalEvent",
    "NPUGraph",
    "Stream",
    "StreamContext",
    "current_stream",
    "device_count",
    "graph",
    "graph_pool_handle",
    "graph_task_group_begin",
    "graph_task_group_end",
    "graph_task_update_begin",
    "graph_task_update_end",
    "is_available",
    "fail_next_capture",
    "is_current_stream_capturing",
    "max_memory_allocated",
    "memory_allocated",
    "memory_reserved",
    "reset_state",
    "stream_mode",
    "set_stream",
    "stream",
    "synchronize",
    "update_log",
]


#: Names in ``__all__`` that are the simulator's own controls, not part of ``torch_npu.npu``.
SIMULATOR_ONLY = frozenset({"fail_next_capture", "reset_state", "stream_mode", "update_log"})

#: What ``capture_begin`` raises, per failure ``fail_next_capture`` can inject: the words torch_npu
#: 2.13 / CANN print (vllm-ascend issues 9691 and 8393).
CAPTURE_FAILURES = {
    "stream_resources": (
        "capture_begin:../torch_npu/csrc/core/npu/NPUGraph.cpp:230 NPU function error: "
        "c10_npu::acl::AclmdlRICaptureBegin(capture_stream_, capture_mode), error code is 207008\n"
        "[Error]: Stream resources are insufficient.\n"
        "Insufficient_Stream_Resources(EL0009): The stream resources are insufficient."
    ),
    "old_driver": (
        "capture_begin:build/CMakeFiles/torch_npu.dir/compiler_depend.ts:214 NPU function error: "
        "c10_npu::acl::AclmdlRICaptureBegin(capture_stream_, capture_mode), error code is 207005\n"
        "[Error]: Failed to apply for memory.\n"
        "EE9999: Inner Error! [SqCqManage]Alloc sq cq fail, stream_id=1984, retCode=0x7020023."
    ),
}


#: How many task-update begin/end calls ``update_log`` remembers (the oldest are dropped).
UPDATE_LOG_LENGTH = 100_000


class _DeviceState:
    """Process-wide state of the one simulated NPU."""

    def __init__(self) -> None:
        self.pool_bytes = PoolBytes()  # what the graph pools hold
        self.tls = threading.local()
        self.capturing: dict[int, NPUGraph] = {}  # stream id -> graph capturing on it
        self.updating: dict[int, _Update] = {}  # stream id -> task update in progress on it
        self.sched = Scheduler()
        self.fail_captures: list[str] = []  # failures the next capture_begin calls raise
        #: every graph_task_update_begin/end, in host order: (thread ident, "begin" | "end",
        #: graph id, task group index); see ``update_log``
        self.update_log: collections.deque[tuple[int, str, int, int | None]] = collections.deque(
            maxlen=UPDATE_LOG_LENGTH
        )


_STATE = _DeviceState()


def fail_next_capture(kind: str, times: int = 1) -> None:
    """Make the next ``times`` ``NPUGraph.capture_begin`` calls raise ``kind``'s runtime error (a key of
    ``CAPTURE_FAILURES``: ``"stream_resources"``, ``"old_driver"``), as Ascend hardware does."""
    if kind not in CAPTURE_FAILURES:
        raise ValueError(f"unknown capture failure {kind!r}; known: {sorted(CAPTURE_FAILURES)}")
    _STATE.fail_captures.extend([kind] * times)


_stream_ids = itertools.count(1)  # 0 is the default stream


def reset_state(mode: str = "eager", hang_timeout: float = 2.0) -> list[tuple[int, Work]]:
    """Forget the current stream of this thread, any capture or task update left open and all
    queued device work; run streams in ``mode`` from now on (simulator entry/exit). Returns the
    work that was still queued (blocked)."""
    _STATE.tls.stream_id = 0
    _STATE.fail_captures.clear()
    _STATE.update_log.clear()
    for graph_ in list(_STATE.capturing.values()):
        graph_._abandon()
    _STATE.capturing.clear()
    for update in list(_STATE.updating.values()):
        if _get_current_dispatch_mode() is update.recorder:  # else it would record all that follows
            update.recorder.__exit__(None, None, None)
    _STATE.updating.clear()
    left = _STATE.sched.clear()
    _STATE.sched = Scheduler(mode, hang_timeout)
    return left


def update_log() -> list[tuple[int, str, int, int | None]]:
    """Every ``graph_task_update_begin`` / ``graph_task_update_end`` since the simulator block began
    (at most ``UPDATE_LOG_LENGTH``), in the order the host issued them: ``(thread ident, "begin" |
    "end", graph id, task group index)``. Two host threads submitting task updates at once fail
    inside CANN (sglang-omni #2160); this shows whether their sequences interleaved."""
    return list(_STATE.update_log)


def stream_mode() -> tuple[str, float]:
    """The scheduler's (mode, hang_timeout) (restored when a nested simulator exits)."""
    return _STATE.sched.mode, _STATE.sched.hang_timeout


# -- streams and events --------------------------------------------------------------------------


class Stream:
    """A simulated NPU stream: a queue of device work (``_streams``); equality is by id."""

    stream_id: int
    device_index: int
    priority: int

    def __new__(cls, device=None, priority=0, **kwargs):
        self = super().__new__(cls)
        self.stream_id = kwargs.get("stream_id", next(_stream_ids))
        self.device_index = 0
        self.priority = priority
        return self

    @property
    def npu_stream(self) -> int:
        return 0x1000 + self.stream_id

    @property
    def device(self) -> torch.device:
        """Where this stream's tensors live: on hardware ``npu:<index>``; here ``cpu``, as the
        simulated NPU's tensors are CPU tensors (devgraph's NPU backend asks this, as on hardware)."""
        return torch.device("cpu")

    def wait_event(self, event):
        event.wait(self)

    def wait_stream(self, stream):
        self.wait_event(stream.record_event())

    def record_event(self, event=None):
        if event is None:
            event = Event()
        event.record(self)
        return event

    def query(self):
        return not _STATE.sched.pending(self.stream_id)

    def synchronize(self):
        _STATE.sched.synchronize_stream(self.stream_id)

    def __eq__(self, other):
        return isinstance(other, Stream) and other.stream_id == self.stream_id

    def __hash__(self):
        return hash((self.npu_stream, "npu:0"))

    def __repr__(self):
        return f"<torch_npu.npu.Stream device=npu:0 npu_stream={self.npu_stream:#x}> (simulated)"


def current_stream(device=None):
    return Stream(stream_id=getattr(_STATE.tls, "stream_id", 0))


def set_stream(stream):
    if stream is None:
        return
    _STATE.tls.stream_id = stream.stream_id


class StreamContext:
    """``with stream(s):`` makes ``s`` current for the block (a no-op for None)."""

    def __init__(self, stream_ctx):
        self.stream = stream_ctx
        self.src_prev_stream = None

    def __enter__(self):
        if self.stream is None:
            return
        self.src_prev_stream = current_stream()
        set_stream(self.stream)

    def __exit__(self, exec_type, exec_value, traceback):
        if self.stream is None:
            return
        set_stream(self.src_prev_stream)


def stream(stream):
    return StreamContext(stream)


def synchronize(device=None):
    _STATE.sched.synchronize_all()


def is_available():
    return True


def device_count() -> int:
    return 1


def _stream_id(stream) -> int:
    return (stream if stream is not None else current_stream()).stream_id


class _RecordEvent(Work):
    def __init__(self, event: Event, generation: int) -> None:
        self.name = f"Event[{event._id}].record"
        self.event, self.generation = event, generation

    def step(self, sched: Scheduler) -> bool:
        self.event._done = max(self.event._done, self.generation)
        self.event._t = time.perf_counter_ns()
        return True


class _WaitEvent(Work):
    def __init__(self, event: Event, generation: int) -> None:
        self.name = f"Event[{event._id}].wait"
        self.event, self.generation = event, generation

    def step(self, sched: Scheduler) -> bool:
        if self.event._done < self.generation:
            sched.advance(self.event._where[self.generation])  # the recording stream must get there
        return self.event._done >= self.generation

    def blocker(self) -> str:
        return f"Event {self.event._id} (record #{self.generation})"


class Event:
    """A simulated NPU event: a record completes when its stream reaches it; timed then."""

    _ids = itertools.count()
    enable_timing: bool
    _t: int | None
    _id: int
    _where: dict[int, int]

    def __new__(cls, enable_timing=False, blocking=False, interprocess=False):
        self = super().__new__(cls)
        self.enable_timing = enable_timing
        self._t = None
        self._id = next(cls._ids)
        self._recorded = 0  # records issued
        self._done = 0  # records the device has reached
        self._where = {}  # record number -> stream id
        return self

    def record(self, stream=None):
        sid = _stream_id(stream)
        self._recorded += 1
        self._where[self._recorded] = sid
        if sid in _STATE.capturing:  # not a node of the simulated graph: complete at once
            self._done, self._t = self._recorded, time.perf_counter_ns()
            return
        _STATE.sched.submit(sid, _RecordEvent(self, self._recorded))

    def wait(self, stream=None):
        sid = _stream_id(stream)
        if self._recorded == 0 or sid in _STATE.capturing:
            return  # waiting on an event never recorded is a no-op, as in CUDA
        _STATE.sched.submit(sid, _WaitEvent(self, self._recorded))

    def query(self):
        return self._done >= self._recorded

    def synchronize(self):
        target = self._recorded
        if target:
            sched = _STATE.sched
            sched.synchronize(
                lambda: self._done >= target, lambda: [self._where[target]], f"Event {self._id} synchronize()"
            )

    def elapsed_time(self, end_event):
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self._t is None or end_event._t is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return (end_event._t - self._t) / 1e6


class _Step:
    """A non-op step of a captured graph (event wait / reset / record), run at replay.

    ``ready`` (waits only) says whether the step may run; a replay stops in front of a step that
    is not ready until it is.
    """

    __slots__ = ("event", "fn", "name", "ready")

    def __init__(
        self, name: str, fn: Callable[[], None], ready: Callable[[], bool] | None = None, event: Any = None
    ) -> None:
        self.name = name
        self.fn = fn
        self.ready = ready
        self.event = event

    def run(self) -> None:
        self.fn()


class _ExternalWork(Work):
    """An ExternalEvent record / wait / reset queued on a stream (outside a capture)."""

    def __init__(self, event: ExternalEvent, what: str) -> None:
        self.name = f"ExternalEvent[{event._id}].{what}"
        self.what = what
        self._ev = event
        self.external = event if what == "record" else None  # what drive_external looks for

    def step(self, sched: Scheduler) -> bool:
        event = self._ev
        if self.what == "wait":
            if not event._recorded:
                sched.drive_external(event)
            return event._recorded
        event._recorded = self.what == "record"
        return True

    def blocker(self) -> str:
        return f"ExternalEvent {self._ev._id}, which nothing records"


class ExternalEvent:
    """An event a graph can wait on before anyone records it (``graph_external=True``).

    On a capturing stream, ``wait``/``reset``/``record`` become steps of the graph; elsewhere they
    are queued on the stream. Reset clears the flag a record sets; a wait holds its stream (or the
    replay) until the flag is set.
    """

    _ids = itertools.count()
    _id: int
    _recorded: bool

    def __new__(cls):
        self = super().__new__(cls)
        self._recorded = False
        self._id = next(cls._ids)
        return self

    def _act(self, stream, what: str, fn: Callable[[], None]) -> None:
        sid = _stream_id(stream)
        graph_ = _STATE.capturing.get(sid)
        if graph_ is not None:
            ready = (lambda: self._recorded) if what == "wait" else None
            graph_._append_step(_Step(f"ExternalEvent[{self._id}].{what}", fn, ready, self))
            return
        _STATE.sched.submit(sid, _ExternalWork(self, what))

    def record(self, stream=None):
        self._act(stream, "record", self._set)

    def wait(self, stream=None):
        self._act(stream, "wait", _noop)

    def reset(self, stream=None):
        self._act(stream, "reset", self._clear)

    def _set(self) -> None:
        self._recorded = True

    def _clear(self) -> None:
        self._recorded = False


def _noop() -> None:
    pass


# -- memory --------------------------------------------------------------------------------------


def memory_allocated(device=None):
    return _STATE.pool_bytes.reserved


def memory_reserved(device=None):
    return _STATE.pool_bytes.reserved


def max_memory_allocated(device=None):
    return _STATE.pool_bytes.peak


class _PoolToken:
    """The opaque id ``graph_pool_handle()`` returns: here it carries its ``BlockPool``."""

    __slots__ = ("__weakref__", "pool")

    def __init__(self) -> None:
        self.pool = BlockPool(_STATE.pool_bytes)

    def __repr__(self) -> str:
        return f"<simulated NPU graph pool {id(self):#x}>"


def graph_pool_handle():
    return _PoolToken()


# -- graphs and task groups ----------------------------------------------------------------------


#: Ops that only allocate memory (no task is launched): not re-run at replay, not tasks of a group.
_ALLOCATIONS = frozenset(
    _UNINITIALISED
    | {
        f"{_SIM_NAMESPACE}::_npu_fused_infer_attention_score_get_max_workspace",
        f"{_SIM_NAMESPACE}::_npu_fused_infer_attention_score_infer_output",
    }
)

_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _describe_tensor(t: torch.Tensor) -> str:
    return f"[{', '.join(map(str, t.shape))}] {t.dtype}"


class _SimRecorder(Recorder):
    """The CPU recorder, recording what the NPU kernels launch (capture, or a task update).

    * A ``devgraph::`` op runs its (NPU) kernel with the recorder active, so the graph holds the
      torch_npu / aten ops it launches, as stream capture would, not the devgraph op as one step.
    * A conditional alias (``to``, ``reshape``...) that copies records the copy it makes.
    * Allocations (``empty``, the attention workspace) are memory, not tasks: never re-run.
    * An ``.out`` op returning its ``out`` tensors writes them; nothing new is placed in the pool.
    * ``_npu_paged_attention`` reads ``context_lens`` (a CPU tensor) when it is launched, so the
      captured task holds the values of that moment: record a copy, not the live tensor.
    * A ``torch.distributed`` collective (HCCL on hardware) is simulated by whatever process group
      the caller made (gloo on CPU): recorded and re-issued at replay as on the CPU reference
      (``devgraph.backends.cpu._collectives``); refused inside a task update.
    * ``updating=True`` (between ``graph_task_update_begin/end``): nothing is placed in the pool
      (on hardware the update allocates from the ordinary allocator), and a task that reads or
      writes memory allocated during the update raises ``RuntimeError`` -- that memory is freed
      when the update returns while the rewritten task keeps its address.
    """

    def __init__(self, pool: BlockPool, segment: Segment, *, updating: bool = False) -> None:
        super().__init__(pool, segment)
        self.updating = updating
        self.failed = False  # a task touched memory allocated during the update
        self._born: dict[int, tuple[str, torch.UntypedStorage]] = {}  # data_ptr -> (op, storage)
        self._inputs: frozenset[int] = frozenset()
        self._allocating = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if threading.get_ident() != self._thread:
            return func(*args, **kwargs)  # a collective's worker thread (see Recorder)
        if is_collective(func._schema.name):
            # HCCL simulated by whatever process group the caller uses (gloo on CPU): recorded and
            # re-issued at replay as on the CPU reference; never part of a task update.
            if self.updating:
                refuse_collective_in_task(func._schema.name)
            return self._collective(func, args, kwargs)
        if self._collectives and issued_by_torch_distributed():
            return func(*args, **kwargs)  # torch.distributed's own work around a collective
        refuse_unrecordable_kinds(func, (args, kwargs))  # as the CPU reference (quantized, nested)
        if func.namespace == "devgraph":
            with self:  # record what the kernel launches (its ops come back to this method)
                return func.redispatch(_CPU_KEYS, *args, **kwargs)
        frozen_lens = func.__name__ == "_npu_paged_attention.default" and len(args) > 7
        if frozen_lens:
            args = (*args[:7], args[7].clone(), *args[8:])
        if _is_view(func):
            # Metadata over memory already referenced, unless it is a conditional alias (``to``,
            # ``reshape``, ``contiguous``) that copies: decomposed, a copy is recorded like any op.
            with self:
                result = func.decompose(*args, **kwargs)
            return func(*args, **kwargs) if result is NotImplemented else result
        name = func._schema.name
        allocating = name in _ALLOCATIONS
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if self.updating and not allocating:
            self._check_inputs(func, args, kwargs, inputs)
        entry = Entry(func, name, args, kwargs, rerun=not allocating)
        if frozen_lens:
            entry.own(7)  # the task's own copy: nothing else holds it
        random = is_random(func)  # re-seeding inside the capture is refused as on the CPU reference
        gen = self.rng.before(func, args, kwargs) if random else None
        result = self._issue(func, args, kwargs, allocating)
        if random:
            self.rng.after(func, args, kwargs, gen)
        refuse_unrecordable_kinds(func, result)
        self._inputs = frozenset(_storage_ptr(t) for t in inputs if tensor_bytes(t))
        self._allocating = allocating
        result = self._place_outputs(func, entry, result)
        if not (self.updating and allocating):  # an allocation during an update is no graph work
            self.segment.entries.append(entry)
        return result

    def _issue(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], allocating: bool) -> Any:
        """Run ``func`` as capture does; in a task update, run nothing the hardware would not.

        A task update rewrites the task's parameters; nothing runs until a replay. An ``.out`` op
        is only checked (``_ops.check_call``) and hands back its ``out`` tensors; any other
        op runs (its results are needed) and what it writes is put back afterwards.
        """
        if not self.updating or allocating:
            return func(*args, **kwargs)
        if func._overloadname == "out" and "out" in kwargs and check_call(func, args, kwargs):
            return tuple(kwargs["out"])
        written = written_tensors(func, args, kwargs)
        saved = [t.clone() for t in written]
        result = func(*args, **kwargs)
        for t, before in zip(written, saved):
            t.copy_(before)
        return result

    def _check_inputs(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], inputs: list) -> None:
        """Raise if a re-issued task reads or writes memory allocated during the update."""
        written = {id(t) for t in written_tensors(func, args, kwargs)}
        for t in inputs:
            born = self._born.get(_storage_ptr(t)) if tensor_bytes(t) else None
            if born is not None:
                how = "writes" if id(t) in written else "reads"
                self._fail(
                    f"{func._schema.name} {how} a {_describe_tensor(t)} tensor that {born[0]} allocated"
                )

    def _place(self, entry: Entry, leaf_index: int, t: torch.Tensor) -> torch.Tensor:
        if not tensor_bytes(t) or _storage_ptr(t) in self._inputs:
            return t  # empty, or an ``.out`` op handing back the tensor it wrote
        if not self.updating:
            return super()._place(entry, leaf_index, t)
        if not self._allocating:
            self._fail(f"{entry.name} writes a new {_describe_tensor(t)} tensor")
        self._born[_storage_ptr(t)] = (entry.name, t.untyped_storage())  # held: no address reuse
        return t

    def _fail(self, what: str) -> None:
        self.failed = True
        raise RuntimeError(
            f"simulated NPU task update reads/writes memory allocated during the update: {what}. On "
            "hardware that memory is freed when the update returns while the rewritten task keeps its "
            "address (use-after-free at replay), and the graph would never see the new values. A task "
            "group may only be re-issued over memory that outlives the update: tensors that existed at "
            "capture, or buffers allocated at capture and reused (devgraph.backends.npu._kernels keeps "
            "its attention workspace that way)"
        )


class _TaskGroupHandle:
    """What ``graph_task_group_end`` returns: the group's segment, and where it sits in its graph.

    ``segment`` is the group as last re-issued on the host (its rewrite may still be queued);
    ``segments``/``position`` locate it in the graph's tape (a reset replaces the list).
    """

    __slots__ = ("graph", "position", "segment", "segments")

    def __init__(self, graph_: NPUGraph, segment: Segment) -> None:
        self.graph = graph_
        self.segment = segment
        self.segments = graph_._tape.segments
        self.position = self.segments.index(segment)


@dataclass
class _Update:
    recorder: _SimRecorder
    handle: _TaskGroupHandle
    segment: Segment


def _capturing_graph(stream, what: str) -> NPUGraph:
    graph_ = _STATE.capturing.get(stream.stream_id)
    if graph_ is None:
        raise RuntimeError(f"{what}: stream {stream!r} is not capturing a graph")
    return graph_


def is_current_stream_capturing():
    return current_stream().stream_id in _STATE.capturing


def graph_task_group_begin(stream):
    _capturing_graph(stream, "graph_task_group_begin")._group_begin()


def graph_task_group_end(stream):
    return _capturing_graph(stream, "graph_task_group_end")._group_end()


def graph_task_update_begin(stream, handle):
    if not isinstance(handle, _TaskGroupHandle):
        raise TypeError(f"graph_task_update_begin expects a handle from graph_task_group_end, got {handle!r}")
    if stream.stream_id in _STATE.capturing:
        raise RuntimeError("graph_task_update_begin: the update stream must not be capturing")
    if stream.stream_id in _STATE.updating:
        raise RuntimeError("graph_task_update_begin: a task update is already open on this stream")
    if handle.segments is not handle.graph._tape.segments:
        raise RuntimeError("graph_task_update_begin: the task group's graph was reset or never captured")
    new = Segment(handle.segment.group_index)
    recorder = _SimRecorder(handle.graph._pool_token.pool, new, updating=True)
    recorder.__enter__()
    _STATE.updating[stream.stream_id] = _Update(recorder, handle, new)
    _STATE.update_log.append((threading.get_ident(), "begin", handle.graph._id, new.group_index))


def _tasks(segment: Segment) -> list[str]:
    """The launches of a segment (allocations and event steps are not tasks)."""
    return [e.name for e in segment.entries if isinstance(e, Entry) and e.rerun]


def graph_task_update_end(stream):
    """Close the update and queue the rewrite of the group's tasks on ``stream``.

    torch_npu has no abort: whatever the update re-issued is committed. When the update issued
    only the first k of the group's captured tasks (its block raised), the group replays those k
    rewritten tasks followed by the rest as they were -- a partial update, as on hardware.
    """
    update = _STATE.updating.pop(stream.stream_id, None)
    if update is None:
        raise RuntimeError("graph_task_update_end without graph_task_update_begin on this stream")
    _STATE.update_log.append(
        (threading.get_ident(), "end", update.handle.graph._id, update.segment.group_index)
    )
    update.recorder.__exit__(None, None, None)
    old, new = update.handle.segment, update.segment
    issued, captured = _tasks(new), _tasks(old)
    if issued != captured[: len(issued)]:
        raise RuntimeError(
            f"graph_task_update_end: the update issued {issued}, the task group captured "
            f"{captured}; re-issue exactly the captured calls"
        )
    partial = len(issued) < len(captured)
    if issued:
        _commit(update.handle, _merge_prefix(new, old, len(issued)) if partial else new, stream)
    if partial and not update.recorder.failed:
        raise RuntimeError(
            f"graph_task_update_end: the update issued {len(issued)} of the group's {len(captured)} "
            f"tasks ({captured}); torch_npu has no abort, so the re-issued ones are committed and the "
            "rest keep their previous arguments"
        )


def _commit(handle: _TaskGroupHandle, new: Segment, stream) -> None:
    """Queue the rewrite of ``handle``'s group as ``new`` on ``stream``."""
    graph_, index, segments = handle.graph, handle.position, handle.segments
    handle.segment = new

    def rewrite() -> None:
        if graph_._tape.segments is segments:  # else the graph was reset meanwhile
            graph_._tape.replace(segments[index], new)

    _STATE.sched.submit(stream.stream_id, Call(f"task update of group {new.group_index}", rewrite))


def _merge_prefix(new: Segment, old: Segment, issued: int) -> Segment:
    """The group's segment after a partial update: the re-issued tasks, then the captured rest."""
    merged = Segment(old.group_index)
    merged.entries = list(new.entries)
    seen = 0
    for position, entry in enumerate(old.entries):
        if isinstance(entry, Entry) and entry.rerun:
            seen += 1
            if seen == issued:
                merged.entries.extend(old.entries[position + 1 :])
                break
    return merged


class _Replay(Work):
    """A graph replay queued on a stream: runs the graph's steps, stopping at an unready wait.

    It reads each segment when it reaches it, so a task update whose rewrite runs before the
    replay gets to the group is replayed with the new arguments, one that runs after is not.
    """

    def __init__(self, graph_: NPUGraph) -> None:
        self.name = f"replay of NPUGraph {graph_._id}"
        self.segments = graph_._tape.segments
        self.index = 0
        self.current: Segment | None = None
        self.entry = 0
        self.waiting: _Step | None = None
        self.deferred: list[tuple[Entry, Any]] = []  # point-to-point ops issued, not yet waited

    def step(self, sched: Scheduler) -> bool:
        with torch.inference_mode():
            while self.index < len(self.segments):
                if self.current is None:
                    self.current, self.entry = self.segments[self.index], 0
                entries = self.current.entries
                while self.entry < len(entries):
                    item: Any = entries[self.entry]  # an Entry, or a _Step waiting on an external event
                    if getattr(item, "deferred", False):  # see Segment.run
                        self.deferred.append((item, item.run()))
                        self.entry += 1
                        sched.ticks += 1
                        continue
                    finish_deferred(self.deferred)
                    ready = getattr(item, "ready", None)
                    if ready is not None and not ready():
                        sched.drive_external(item.event)
                        if not ready():
                            self.waiting = item
                            return False
                    item.run()
                    self.entry += 1
                    sched.ticks += 1
                finish_deferred(self.deferred)
                self.index, self.current = self.index + 1, None
        return True

    def blocker(self) -> str:
        step = self.waiting
        group = next((s for s in self.segments[self.index + 1 :] if s.group_index is not None), None)
        where = f"task group {group.group_index} {_tasks(group)}" if group is not None else "the graph's end"
        return f"{step.name if step else '?'} in front of {where}, which nothing records"


class NPUGraph:
    """A simulated ACL graph (``torch_npu.npu.NPUGraph``) over the CPU reference backend's ``Tape``."""

    def __new__(cls):
        return super().__new__(cls)

    _ids = itertools.count()

    def __init__(self):
        self._id = next(NPUGraph._ids)
        self.graph_dispatch_mode = _GraphDispatchMode()
        self.auto_dispatch_capture = False
        self._tape = Tape()
        self._pool_token: _PoolToken | None = None
        self._stream_id: int | None = None
        self._group: Segment | None = None

    def capture_begin(self, pool=None, capture_error_mode="global"):
        if capture_error_mode not in ("global", "thread_local", "relaxed"):
            raise RuntimeError(f"Unknown capture error mode {capture_error_mode!r}")
        if self._tape.recorder is not None or self._tape.segments:
            raise RuntimeError(
                "This NPUGraph instance already owns a captured graph (or is capturing). Call reset() "
                "or create a new instance to capture a new graph."
            )
        s = current_stream()
        if s.stream_id == 0:
            raise RuntimeError(
                "NPU graphs must be captured on a non-default stream. (However, after capture, it's ok "
                "to replay them on the default stream.)"
            )
        if s.stream_id in _STATE.capturing:
            raise RuntimeError("the current stream is already capturing another graph")
        if pool is not None and not isinstance(pool, _PoolToken):
            raise TypeError(f"pool must come from graph_pool_handle() or NPUGraph.pool(), got {pool!r}")
        if _STATE.fail_captures:
            raise RuntimeError(CAPTURE_FAILURES[_STATE.fail_captures.pop(0)])
        self._pool_token = pool if pool is not None else _PoolToken()
        self._tape.begin(self._pool_token.pool, _SimRecorder)
        self._stream_id = s.stream_id
        _STATE.capturing[s.stream_id] = self

    def capture_end(self):
        if self._tape.recorder is None:
            raise RuntimeError("capture_end() without capture_begin()")
        try:
            self._tape.end()
        finally:  # a capture that end() refuses stops capturing its stream too
            _STATE.capturing.pop(self._stream_id, None)  # type: ignore[arg-type]
        if self._group is not None:
            self._group = None
            self._tape.abandon()
            raise RuntimeError("capture ended inside a task group: graph_task_group_end was never called")

    def replay(self):
        if not self._tape.segments or self._tape.recorder is not None:
            raise RuntimeError("Called NPUGraph::replay without a preceding successful capture.")
        _STATE.sched.submit(current_stream().stream_id, _Replay(self))

    def reset(self):
        if self._tape.recorder is not None:
            self._abandon()  # a capture still open: it stops capturing its stream too
        self._tape.abandon()
        self._group = None

    def pool(self):
        return self._pool_token

    def update(self, cpu_update_input):
        if not self.auto_dispatch_capture:
            raise RuntimeError(
                "The current graph configuration does not support update,"
                "Try to capture by setting auto_dispatch_capture=True during capture"
            )
        self.graph_dispatch_mode.update_capture_record(cpu_update_input)

    # -- simulator internals ---------------------------------------------------------------------

    def _abandon(self) -> None:
        self._tape.abandon()
        _STATE.capturing.pop(self._stream_id, None)  # type: ignore[arg-type]

    def _append_step(self, step: _Step) -> None:
        assert self._tape.recorder is not None
        self._tape.recorder.segment.entries.append(step)  # type: ignore[arg-type]

    def _group_begin(self) -> None:
        if self._group is not None:
            raise RuntimeError("graph_task_group_begin: task groups cannot nest")
        index = len([s for s in self._tape.segments if s.group_index is not None])
        self._group = self._tape.open_group(index)

    def _group_end(self) -> _TaskGroupHandle:
        if self._group is None:
            raise RuntimeError("graph_task_group_end without graph_task_group_begin")
        handle = _TaskGroupHandle(self, self._group)
        self._group = None
        self._tape.close_group()
        return handle

    @property
    def _recorded_ops(self) -> list[str]:
        """Names of the captured steps in replay order (for tests)."""
        return self._tape.ops


class graph:
    """``with graph(npu_graph):`` captures the block into ``npu_graph`` on a side stream."""

    default_capture_stream = None

    def __init__(
        self, npu_graph, pool=None, stream=None, auto_dispatch_capture=False, capture_error_mode="global"
    ):
        if self.__class__.default_capture_stream is None:
            self.__class__.default_capture_stream = Stream()
        self.pool = () if pool is None else (pool,)
        self.capture_stream = stream if stream is not None else self.__class__.default_capture_stream
        self.stream_ctx = StreamContext(self.capture_stream)
        self.npu_graph = npu_graph
        self.capture_error_mode = capture_error_mode
        self.npu_graph.auto_dispatch_capture = auto_dispatch_capture

    def __enter__(self):
        synchronize()
        self.stream_ctx.__enter__()
        # The recorder (stream capture on hardware) must sit *below* the dispatch mode so that it
        # records what the mode launches; torch_npu enters them the other way round because its
        # capture is not a dispatch mode at all.
        self.npu_graph.capture_begin(*self.pool, capture_error_mode=self.capture_error_mode)
        if self.npu_graph.auto_dispatch_capture:
            self.npu_graph.graph_dispatch_mode.__enter__()

    def __exit__(self, exc_type, exc_value, traceback):
        try:
            if self.npu_graph.auto_dispatch_capture:
                self.npu_graph.graph_dispatch_mode.__exit__(exc_type, exc_value, traceback)
            self.npu_graph.capture_end()
        finally:
            self.stream_ctx.__exit__(exc_type, exc_value, traceback)


# -- auto_dispatch_capture (torch_npu/npu/graphs.py::_GraphDispatchMode) -------------------------


@dataclass
class _GraphDispatchRecord:
    event: Any = None
    handle: Any = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    args: list[Any] = field(default_factory=list)
    op_cache_entry: Any = None


def _keep(value: Any) -> Any:
    """How a dispatch record holds an argument: tensors in a graph pool weakly (torch_npu's
    ``TensorWeakRef`` for device tensors), other tensors as they are, everything else deep-copied."""
    if isinstance(value, torch.Tensor):
        return weak_ref_tensor(value) if block_of(value) is not None else value
    if isinstance(value, (list, tuple)):
        return type(value)(_keep(v) for v in value)
    return deepcopy(value)


class _GraphDispatchMode(TorchDispatchMode):
    """Captures every call of a handled op as a task group behind an ExternalEvent."""

    tensor_schema_name: dict[str, list[str]] = {}
    update_stream = None

    def __new__(cls):
        if cls.update_stream is None:
            cls.update_stream = Stream()
        return super().__new__(cls)

    def __init__(self):
        super().__init__()
        self.graph_dispatch_records: list[_GraphDispatchRecord] = []

    @classmethod
    def is_infra_mode(cls):
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler_cls = _NPU_GRAPH_OP_HANDLERS.get(func.__name__)
        if handler_cls is None:
            return func(*args, **kwargs)
        if hasattr(handler_cls, "should_handle") and not handler_cls.should_handle(func, args, kwargs):
            return func(*args, **kwargs)
        s = current_stream()
        event = ExternalEvent()
        event.wait(s)
        event.reset(s)
        actual_func, args, kwargs = handler_cls.prepare_capture(func, args, dict(kwargs))
        graph_task_group_begin(s)
        result = actual_func(*args, **kwargs)
        handle = graph_task_group_end(s)
        with _disable_current_modes():  # bookkeeping, not work the graph should hold
            self.graph_dispatch_records.append(
                _GraphDispatchRecord(
                    event=event,
                    handle=handle,
                    kwargs={k: _keep(v) for k, v in kwargs.items()},
                    args=[_keep(a) for a in args],
                    op_cache_entry=actual_func,
                )
            )
        return handler_cls.postprocess_result(result, kwargs)

    def update_capture_record(self, cpu_update_input):
        records = self.graph_dispatch_records
        if len(cpu_update_input) == 1:
            cpu_update_input = [cpu_update_input[0].copy() for _ in records]
        if len(cpu_update_input) != len(records):
            raise RuntimeError(
                f"Currently, there are {len(records)} operators that need to be updated by capture, and "
                f"there are only {len(cpu_update_input)} elements in the incoming cpu_update_input list"
            )
        with stream(self.update_stream):
            for record, update_input in zip(records, cpu_update_input):
                graph_task_update_begin(self.update_stream, record.handle)
                for key in update_input:
                    if key in record.kwargs:
                        record.kwargs[key] = update_input[key]
                handler_cls = _NPU_GRAPH_OP_HANDLERS.get(record.op_cache_entry.__name__)
                if handler_cls is None:
                    raise RuntimeError(
                        f"No handler for recorded op: {record.op_cache_entry.__name__}. "
                        "This indicates the handler was unregistered between capture and update."
                    )
                handler_cls.update_args(record, update_input)
                record.op_cache_entry(*record.args, **record.kwargs)
                graph_task_update_end(self.update_stream)
                record.event.record(self.update_stream)
