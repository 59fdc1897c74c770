"""The Ascend NPU backend over torch_npu's ACL graphs (``torch_npu.npu.NPUGraph``).

Every call goes through the ``torch_npu`` module imported when the device is built
(``torch_npu.npu.X``): never ``torch.npu``, never ``torch.cuda``. Under
devgraph's tests (``tests/sim``) that module is a CPU simulator and this code runs unchanged and
unaware: it has no seam for it. Where tensors live it asks as on hardware, from a stream's
``device`` (``npu:<index>``; the simulator's streams answer ``cpu``).

Task update (DESIGN.md, graph contract point 3) follows vllm-ascend: each task group waits on its
own ``ExternalEvent`` captured in front of it; an update re-issues the group's work on a dedicated
update stream between ``graph_task_update_begin/end`` and records the event. A group nobody
updated since the last replay has its event recorded just before the next replay, so the graph
never hangs: it replays with the arguments it last had (stale, as on the CPU reference backend).
``replay(host_args)`` overlaps the updates with the replay by default (``NpuDevice.update_order``;
see ``NpuGraph.replay``).

One step's updates are one submission: the device's update lock (one submitter per device: CANN
fails on task updates submitted from two host threads at once, sglang-omni #2160), one fence, one
entry onto the update stream, then per task group the begin / re-issue / end / event record that
torch_npu needs (``graph_task_update_begin`` takes one group's handle). The host lists are built
once per step and shared by every layer; an attention task whose only new argument is its lengths
is re-issued from the torch_npu call it launched (``_kernels.Launch``), not by running the devgraph
op again; what a step re-issues is planned, and checked, before anything is queued
(``_update_plan``). The ordering steps are small methods of ``NpuGraph``
(``_fence_update_stream``, ``_release_updated``, ``_release_stale``): tests/backends/npu/test_npu_async.py
removes each in turn on the asynchronous simulator and watches a test fail.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any, TypeAlias

import torch

from devgraph._errors import DevgraphError
from devgraph._source import user_source_line
from devgraph.backends.npu import _capture_errors, _handlers, _kernels, _update_plan
from devgraph.graph import Device, Event, Graph, MemoryPool, MemoryStats, Stream, TaskGroup

__all__ = [
    "NPU_HARDWARE_STREAMS",
    "UPDATE_ORDERS",
    "NpuDevice",
    "NpuEvent",
    "NpuGraph",
    "NpuPool",
    "NpuStream",
]

logger = logging.getLogger("devgraph.npu")

#: Hardware streams of an Ascend device; ACL graph capture uses streams per captured piece, so a
#: piecewise runner keeps (pieces + 1) * capture sizes within this. Override: DEVGRAPH_NPU_STREAMS.
NPU_HARDWARE_STREAMS = 2048


def _positive_env(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise DevgraphError(f"{name} must be a positive integer, got {raw!r}")
    return value


def _stream_budget() -> int:
    return _positive_env("DEVGRAPH_NPU_STREAMS") or NPU_HARDWARE_STREAMS


#: Capture sizes per Ascend stack, by device-name prefix: the Ascend 950 captures at most 4 until
#: its driver update (vllm-ascend caps it the same way). Other stacks declare no cap: the stream
#: budget rule is the fallback (devgraph.compile._planner). Override: DEVGRAPH_NPU_MAX_CAPTURE_SIZES.
STACK_MAX_CAPTURE_SIZES = {"Ascend950": 4}


def _max_capture_sizes(npu: Any, index: int) -> int | None:
    """The stack's cap on capture sizes: configured (DEVGRAPH_NPU_MAX_CAPTURE_SIZES), else probed from
    the device name, else None (no cap declared)."""
    configured = _positive_env("DEVGRAPH_NPU_MAX_CAPTURE_SIZES")
    if configured is not None:
        return configured
    get_name = getattr(npu, "get_device_name", None)
    if get_name is None:
        return None
    try:
        name = str(get_name(index))
    except Exception as exc:  # a device name is a hint; no name, no cap
        logger.debug("torch_npu.npu.get_device_name(%d) failed: %s", index, exc)
        return None
    for prefix, cap in STACK_MAX_CAPTURE_SIZES.items():
        if name.replace(" ", "").startswith(prefix):
            return cap
    return None


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


#: How ``replay(host_args)`` orders the task updates and the replay (``NpuDevice.update_order``).
UPDATE_ORDERS = ("overlap", "serial")

_UNSET = object()
_Plan: TypeAlias = "list[_update_plan.Reissue] | _update_plan.LengthsStep"

_thread = threading.local()  # .updating: what this thread is updating now (nesting is refused)


class NpuGraph(Graph):
    """A devgraph graph over ``torch_npu.npu.NPUGraph`` (see the module docstring for task update)."""

    def __init__(self, device: NpuDevice, keep_graph: bool = False) -> None:
        super().__init__(device, keep_graph)
        self.native: Any = None
        self._released: set[int] = set()  # task groups whose event was recorded since the last replay
        self._update: Any = None
        self._scratch: _kernels.Scratch = {}  # attention workspaces of this graph's capture
        self._capture_work: Any = None
        self._poisoned: str | None = None  # why replay() refuses until reset()
        #: per auto task group (index): the attention launch a lengths-only update re-issues
        self._launches: dict[int, _kernels.Launch] = {}
        #: per auto task group: the tensors its attention call passed (``_kernels.call_signature``)
        self._call_signatures: dict[int, Any] = {}
        self._next_call: Any = None  # the signature of the auto task about to be captured
        self._sink: Any = None  # the launch sink of the auto task being captured
        #: the tasks a lengths-only step re-issues from their launches (None: none), once made
        self._fast: _update_plan.FastTasks | None = None
        self._fast_made = False
        #: the lengths the last lengths-only steps gave every task of ``_fast``, not yet written into
        #: their ``host_args`` (``_settle_host_args``): a step copies no task's dict
        self._pending_lengths: Any = _UNSET
        self._sink_launches: list[_kernels.Launch] = []

    @property
    def _npu(self) -> Any:
        return self.device._npu  # type: ignore[attr-defined]

    # -- capture ---------------------------------------------------------------------------------

    def _begin_capture(self, stream: Stream, pool: MemoryPool) -> None:
        if not isinstance(pool, NpuPool):
            raise DevgraphError(f"an npu graph cannot capture into {pool!r}; use device.pool()")
        self._npu.synchronize(self.device.index)  # as torch_npu.npu.graph does: nothing in flight
        self.native = self._npu.NPUGraph()
        self._released = set()
        self._scratch = {}
        self._launches, self._call_signatures = {}, {}
        self._fast_made, self._pending_lengths = False, _UNSET
        self._poisoned = None
        mode = "global" if self.capture_error_mode == "default" else self.capture_error_mode
        self.native.capture_begin(pool=pool.handle, capture_error_mode=mode)
        self._capture_work = _kernels.graph_work(self._scratch)
        self._capture_work.__enter__()

    def _leave_capture_work(self) -> None:
        work, self._capture_work = self._capture_work, None
        if work is not None:
            work.__exit__(None, None, None)

    def _end_capture(self) -> None:
        self._leave_capture_work()
        self.native.capture_end()

    def _abort_capture(self) -> None:
        self._leave_capture_work()
        self._scratch = {}
        self._launches, self._call_signatures = {}, {}
        self._fast_made, self._pending_lengths = False, _UNSET
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

    def _enable_debug_mode(self) -> None:
        if not hasattr(self._npu.NPUGraph, "debug_dump"):
            raise self._no_debug()

    def _debug_dump(self, path: str) -> None:
        dump = getattr(self.native, "debug_dump", None)
        if dump is None:
            raise self._no_debug()
        dump(path)

    def _translate_capture_error(self, exc: BaseException) -> BaseException | None:
        """Stream exhaustion (207008) and an old driver ("Alloc sq cq fail") name their remedy."""
        return _capture_errors.classify(exc)

    def _reset(self) -> None:
        if self.native is not None:
            self.native.reset()
        self.native = None
        self._released = set()
        self._scratch = {}  # the workspaces pointed into this graph's pool: free them with it
        self._launches, self._call_signatures = {}, {}
        self._fast_made, self._pending_lengths = False, _UNSET
        self._poisoned = None

    # -- the ordering steps of task update (tests/backends/npu/test_npu_async.py removes each in turn) ---------

    def _fence_update_stream(self, update_stream: Any) -> None:
        """The update stream waits for the work queued so far on the current stream: an earlier
        replay may still run the tasks about to be rewritten."""
        update_stream.wait_stream(self._npu.current_stream(self.device.index))

    def _release_updated(self, group: TaskGroup, update_stream: Any) -> None:
        """Record the group's event on the update stream, after its rewrite: a replay waiting on
        it runs the task only once the new arguments are in."""
        group.handle[1].record(update_stream)
        self._released.add(group.index)

    def _release_stale(self, stream: Any, skip: AbstractSet[int] = frozenset()) -> None:
        """Record, on ``stream``, the event of every group nobody updated since the last replay (and
        that ``skip`` does not name): it replays with the arguments it holds instead of hanging."""
        if len(skip) == len(self._tasks):  # a step updating every task (skip names only tasks)
            return
        for group in self._tasks:
            if group.index not in self._released and group.index not in skip:
                group.handle[1].record(stream)

    def _launch(self) -> None:
        """Queue the replay on the current stream; the released set starts over."""
        self._released = set()
        self.native.replay()

    # -- replay and update -----------------------------------------------------------------------

    def _replay(self) -> None:
        self._check_poisoned()
        self._release_stale(self._npu.current_stream(self.device.index))
        self._launch()

    def _replay_with_host_args(self, host_args: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Replay with ``host_args``: the updated tasks get them first.

        With ``device.update_order == "overlap"`` (the default) the replay is queued first and the
        tasks are re-issued on the update stream while it runs, as vllm-ascend does: each updated
        task waits on its event, which the update records after rewriting it. ``"serial"``
        re-issues every task, then replays; so does a call updating a task whose event an
        ``update()`` since the last replay already recorded (overlapping would race with it).
        """
        if self.device.update_order == "serial":  # type: ignore[attr-defined]
            super()._replay_with_host_args(host_args)
            return
        self._check_poisoned()
        plan = self._plan(host_args)  # every check, and the lengths built, before anything is queued
        updating = _indices(plan)
        if updating & self._released:
            # An event already recorded (an update() since the last replay) would let the
            # replay run that task before this update rewrites it: update first, then replay.
            self.update(host_args)
            self._replay()
            return
        with self._updating() as update_stream:
            self._release_stale(self._npu.current_stream(self.device.index), updating)
            self._launch()
            try:
                self._reissue_all(plan, update_stream)
            except BaseException:
                # The replay in flight must not wait forever on the tasks left un-updated.
                for group in _groups(plan):
                    if group.index not in self._released:
                        group.handle[1].record(update_stream)
                raise
            finally:
                self._released = set()  # the replay in flight consumed these releases

    def _update_tasks(self, host_args: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Re-issue the updatable tasks with ``host_args`` before the next replay, all or nothing:
        if one re-issue fails, the tasks already re-issued get their previous arguments back."""
        plan = self._plan(host_args)
        with self._updating() as update_stream:
            self._reissue_all(plan, update_stream)

    def _check_update_allowed(self, what: str) -> None:
        """Refuse an update nested in another one on this thread, before the graph lock is taken:
        nesting across graphs must not deadlock (one update stream per device)."""
        _refuse_nested(what)

    @contextlib.contextmanager
    def _updating(self) -> Iterator[Any]:
        """Hold the device's update stream (one per device: threads take turns), fenced."""
        device: NpuDevice = self.device  # type: ignore[assignment]
        _refuse_nested("a task update")  # the lock is not re-entrant: this thread would wait on itself
        with device._update_lock:
            _thread.updating = self
            try:
                update_stream = device._update_stream()
                self._fence_update_stream(update_stream)
                yield update_stream
            finally:
                _thread.updating = None

    def _plan(self, host_args: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> _Plan:
        """What this step re-issues, every check done (``_update_plan``)."""
        if not self._fast_made:
            self._fast, self._fast_made = _update_plan.fast_tasks(self._tasks, self._launches), True
        step = _update_plan.lengths_step(self._fast, host_args)
        if step is not None:
            return step
        self._settle_host_args()  # a task by task update reads and writes the tasks' host_args
        return _update_plan.plan(self._tasks, self._launches, host_args)

    def _settle_host_args(self) -> None:
        """Write the lengths the last lengths-only steps gave into the tasks' ``host_args``."""
        pending, self._pending_lengths = self._pending_lengths, _UNSET
        if pending is not _UNSET and self._fast is not None:
            for group in self._fast.groups:
                group.host_args = {**group.host_args, _kernels.LENGTHS: pending}

    def _reissue(
        self,
        group: TaskGroup,
        host_args: Mapping[str, Any],
        lengths: list[int] | None,
        update_stream: Any,
    ) -> None:
        """Rewrite one auto task and release it: its launch re-issued with ``lengths``, or (None) its
        op run again with ``host_args`` over the ones it holds. Runs on the update stream, in the
        graph's work (``_reissue_all``)."""
        npu = self._npu
        if lengths is not None:
            call = functools.partial(self._launches[group.index].reissue, lengths)
        else:
            # The arguments not given keep the values the task holds now (as torch_npu's own
            # update records do), not their capture-time ones.
            op_call = group.call_with({**group.host_args, **host_args})
            call = functools.partial(self._call_keeping_launch, group, op_call, _kernels.launch_sink())
        npu.graph_task_update_begin(update_stream, group.handle[0])
        try:
            call()
        except BaseException:
            with contextlib.suppress(Exception):  # torch_npu has no abort: end it, report the call's error
                npu.graph_task_update_end(update_stream)
            raise
        npu.graph_task_update_end(update_stream)
        self._release_updated(group, update_stream)

    def _call_keeping_launch(self, group: TaskGroup, call: Callable[[], Any], sink: Any) -> None:
        """Run ``call`` (the group's op, again); the launch it makes is the one the group re-issues next."""
        with sink as launches:
            call()
        self._keep_launch(group, launches)

    def _keep_launch(self, group: TaskGroup, launches: list[_kernels.Launch]) -> None:
        self._settle_host_args()  # the tasks a lengths-only step re-issues may change
        self._fast_made = False
        called_with = self._call_signatures.get(group.index)
        if len(launches) == 1 and called_with is not None and launches[0].called_with == called_with:
            self._launches[group.index] = launches[0]
        else:  # not one attention launch: the group is always re-issued through its op
            self._launches.pop(group.index, None)

    def _reissue_all(self, plan: _Plan, update_stream: Any) -> None:
        """Re-issue ``plan`` in one submission on the update stream, all or nothing: if one re-issue
        fails, the tasks already re-issued get their previous arguments back."""
        if isinstance(plan, _update_plan.LengthsStep):
            self._reissue_launches(plan, update_stream)
            return
        done: list[tuple[TaskGroup, dict[str, Any]]] = []
        with self._npu.stream(update_stream), _kernels.graph_work(self._scratch):
            for group, host_args, lengths in plan:
                previous = group.host_args  # replaced below, never changed in place
                try:
                    self._reissue(group, host_args, lengths, update_stream)
                except Exception as exc:
                    self._fail(group, host_args, exc, [*done, (group, previous)], update_stream)
                done.append((group, previous))
                group.host_args = {**previous, **host_args}

    def _reissue_launches(self, step: _update_plan.LengthsStep, update_stream: Any) -> None:
        """``_reissue_all`` of a lengths-only step: per task only what torch_npu needs (begin, the
        launch with the step's lengths, end, the event)."""
        npu = self._npu
        begin, end = npu.graph_task_update_begin, npu.graph_task_update_end
        fast, lengths = step.fast, step.lengths
        with npu.stream(update_stream), _kernels.graph_work(self._scratch):
            for done, (group, launch) in enumerate(zip(fast.groups, fast.launches)):
                try:
                    begin(update_stream, group.handle[0])
                    try:
                        launch.reissue(lengths)
                    except BaseException:
                        with contextlib.suppress(Exception):  # no abort: end it, report the call's error
                            end(update_stream)
                        raise
                    end(update_stream)
                except Exception as exc:
                    self._settle_host_args()  # the previous steps' lengths: what to restore
                    items = [(g, g.host_args) for g in fast.groups[: done + 1]]
                    self._fail(group, {_kernels.LENGTHS: step.given}, exc, items, update_stream)
                self._release_updated(group, update_stream)
        self._pending_lengths = step.given

    def _fail(
        self,
        group: TaskGroup,
        host_args: Mapping[str, Any],
        exc: Exception,
        items: list[tuple[TaskGroup, dict[str, Any]]],
        update_stream: Any,
    ) -> None:
        """The re-issue of ``group`` failed with ``exc``: give ``items`` their previous arguments back
        (``_restore``) and raise the error."""
        restored = self._restore(items, update_stream)
        raise DevgraphError(
            f"task update of task {group.index} ({group.op}) with {dict(host_args)} failed "
            f"({type(exc).__name__}: {exc}). "
            + (
                "Every task of this update keeps its previous arguments (a replay already in "
                "flight ran with some new ones: do not use its outputs)."
                if restored
                else "Restoring the previous arguments failed too: the graph is poisoned; "
                "reset() and capture it again."
            )
        ) from exc

    def _restore(self, items: list[tuple[TaskGroup, dict[str, Any]]], update_stream: Any) -> bool:
        """Re-issue ``items`` with their previous arguments (on the update stream, in the graph's
        work); poison the graph if that fails."""
        for group, previous in reversed(items):
            try:
                self._reissue(group, previous, None, update_stream)
            except Exception as exc:
                self._poison(f"restoring task {group.index} ({group.op}) after a failed update failed: {exc}")
                return False
            group.host_args = previous
        return True

    def _poison(self, why: str) -> None:
        self._poisoned = why
        logger.error("npu graph poisoned: %s", why)

    def _check_poisoned(self) -> None:
        if self._poisoned is not None:
            raise DevgraphError(
                f"this npu graph cannot replay: {self._poisoned}. torch_npu cannot abort a task update, "
                "so a task may hold half-rewritten arguments; call graph.reset() and capture it again"
            )

    # -- explicit task groups (Graph.task_update) --------------------------------------------------

    def _task_group_begin(self, group: TaskGroup) -> None:
        npu = self._npu
        stream = npu.current_stream(self.device.index)
        event = npu.ExternalEvent()
        event.wait(stream)
        event.reset(stream)
        npu.graph_task_group_begin(stream)
        group.handle = (None, event)
        if group.is_auto:  # the attention launch the op makes now is what a lengths update re-issues
            self._call_signatures[group.index], self._next_call = self._next_call, None
            self._sink = _kernels.launch_sink()
            self._sink_launches = self._sink.__enter__()

    def _task_group_end(self, group: TaskGroup) -> None:
        sink, self._sink = self._sink, None
        if sink is not None:
            sink.__exit__(None, None, None)
            self._keep_launch(group, self._sink_launches)
        handle = self._npu.graph_task_group_end(self._npu.current_stream(self.device.index))
        group.handle = (handle, group.handle[1])

    def _task_update_begin(self, group: TaskGroup) -> None:
        npu = self._npu
        self._settle_host_args()  # an abort restores the task from its host_args
        stack = contextlib.ExitStack()
        try:
            update_stream = stack.enter_context(self._updating())
            stack.enter_context(npu.stream(update_stream))
            stack.enter_context(_kernels.graph_work(self._scratch))
            # What the block re-issues is what a later lengths-only update re-issues (auto tasks).
            launches = stack.enter_context(_kernels.launch_sink())
            npu.graph_task_update_begin(update_stream, group.handle[0])
        except BaseException:
            stack.close()
            raise
        self._update = (update_stream, stack, launches)

    def _task_update_end(self, group: TaskGroup) -> None:
        update_stream, stack, launches = self._update
        self._update = None
        with stack:
            self._npu.graph_task_update_end(update_stream)
            if group.is_auto:
                self._keep_launch(group, launches)
            self._release_updated(group, update_stream)

    def _task_update_abort(self, group: TaskGroup) -> None:
        """The re-issue block raised. torch_npu commits whatever it re-issued (no abort): an auto
        task gets its previous arguments back; an explicit group, whose work devgraph cannot
        re-issue, poisons the graph."""
        update_stream, stack, _ = self._update
        self._update = None
        with stack:
            with contextlib.suppress(Exception):  # the block's error is the one to report
                self._npu.graph_task_update_end(update_stream)
            if group.is_auto:
                if self._restore([(group, dict(group.host_args))], update_stream):
                    return
            else:
                self._poison(f"the task_update() block of explicit task group {group.index} raised")
            self._release_updated(group, update_stream)  # replays must not hang on it

    def _prepare_task_call(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Any, tuple[Any, ...], dict[str, Any], Any]:
        """An op torch_npu's handler registry handles is captured as torch_npu captures it: the
        handler's ``prepare_capture`` (``.default`` becomes ``.out`` over outputs allocated now, so a
        task update rewrites the task into the very buffers the graph reads) and
        ``postprocess_result``. Other ops are captured as called. What the handler allocates (workspace,
        outputs) the task holds weakly, as torch_npu's records do: ordinary pool memory, ordered by the
        stream like any other temporary of the graph."""
        self._next_call = _kernels.call_signature(func, args, kwargs)
        registry = self.device._handlers  # type: ignore[attr-defined]
        handler = registry.get(getattr(func, "__name__", "")) if registry else None
        if handler is None:
            return func, args, kwargs, None
        should = getattr(handler, "should_handle", None)
        if should is not None and not should(func, args, kwargs):
            return func, args, kwargs, None
        actual, args, kwargs = handler.prepare_capture(func, tuple(args), dict(kwargs))
        _handlers.spec_names(actual, handler)  # refuse a spec that would update the wrong argument
        return actual, tuple(args), kwargs, lambda result: handler.postprocess_result(result, kwargs)

    def _updatable_tensor_args(self, func: Any) -> tuple[str, ...]:
        """What torch_npu's handler registry re-issues for ``func`` (``_npu_paged_attention``'s
        ``context_lens``, a host tensor): an update may give those too."""
        registry = self.device._handlers  # type: ignore[attr-defined]
        handler = registry.get(getattr(func, "__name__", "")) if registry else None
        return _handlers.spec_names(func, handler) if handler is not None else ()


def _refuse_nested(what: str) -> None:
    """Task updates cannot nest (one update stream per device, one open update on it)."""
    inner = getattr(_thread, "updating", None)
    if inner is not None:
        raise DevgraphError(
            f"{what} inside another task update (of {inner!r}) on this thread: task updates cannot nest "
            "(they share the device's update stream). Finish the outer update first, then update or "
            f"replay this graph (at {user_source_line()})"
        )


class NpuDevice(Device):
    """One Ascend NPU, through torch_npu."""

    name = "npu"
    dispatch_key = "PrivateUse1"
    capture_stream_budget = NPU_HARDWARE_STREAMS  # per instance: DEVGRAPH_NPU_STREAMS overrides
    #: devgraph's own updatable op; per instance, the ops of torch_npu's handler registry follow it.
    updatable_ops: tuple[str, ...] = ("devgraph::paged_decode_attention",)

    def __init__(self, index: int = 0) -> None:
        import torch_npu

        super().__init__(index)
        self._torch_npu = torch_npu
        self._npu = torch_npu.npu
        #: torch_npu's task-update handler registry (None before torch_npu 2.13; see _handlers).
        self._handlers = _handlers.handler_registry()
        self.updatable_ops = (
            *type(self).updatable_ops,
            *_handlers.registry_ops(torch_npu, self._handlers),
        )
        self.capture_stream_budget = _stream_budget()
        self.max_capture_sizes = _max_capture_sizes(self._npu, index)
        #: where this device's tensors live, as torch_npu's streams report it (``npu:<index>``)
        self._torch_device = torch.device(self._npu.current_stream(index).device)
        self._streams: weakref.WeakValueDictionary[Any, NpuStream] = weakref.WeakValueDictionary()
        self._updates: Any = None
        self._update_lock = threading.Lock()
        #: "overlap": replay(host_args) queues the replay, then re-issues the tasks while it runs;
        #: "serial": re-issue, then replay (see NpuGraph.replay).
        self.update_order = "overlap"
        # Not torchair: its modes cannot run inside the ACL graphs pieces are captured into.
        self.default_compile_backend = "eager"

    @property
    def torch_device(self) -> torch.device:
        return self._torch_device

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


def _groups(plan: _Plan) -> list[TaskGroup]:
    if isinstance(plan, _update_plan.LengthsStep):
        return plan.fast.groups
    return [group for group, _, _ in plan]


def _indices(plan: _Plan) -> frozenset[int] | set[int]:
    if isinstance(plan, _update_plan.LengthsStep):
        return plan.fast.indices
    return {group.index for group, _, _ in plan}
