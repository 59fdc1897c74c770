"""The device contract every backend implements: Device, Stream, Event, Graph, MemoryPool.

The vocabulary follows ``torch.accelerator`` / ``torch.Stream`` / ``torch.Event`` /
``torch.cuda.CUDAGraph``. A backend subclasses these ABCs; the shared behaviour (capture state
machine, host-sync check, task update, locking) lives here so every backend honours the same
contract (see DESIGN.md, "The graph contract").
"""

from __future__ import annotations

import abc
import contextlib
import contextvars
import logging
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, final

import attrs

from devgraph._errors import DevgraphError
from devgraph.graph import _capture
from devgraph.graph._compiled_regions import record_opaque
from devgraph.graph._grad import refuse_backward
from devgraph.graph._opnames import resolve_auto_update_ops
from devgraph.graph._tasks import TaskGroup, apply_host_args

if TYPE_CHECKING:
    import torch

__all__ = [
    "CAPTURE_ERROR_MODES",
    "Device",
    "Event",
    "Graph",
    "MemoryPool",
    "MemoryStats",
    "Stream",
    "current_graph",
    "probe_captures",
]

#: ``capture_error_mode`` names, as ``torch.accelerator.Graph`` spells them (torch 2.12+): what the
#: runtime refuses while a stream captures. ``"default"``: the backend's own choice (CUDA and torch_npu:
#: ``"global"``). Backends without such checks (the CPU reference) accept and ignore them.
CAPTURE_ERROR_MODES = ("default", "global", "thread_local", "relaxed")

logger = logging.getLogger("devgraph")

_device_state_lock = threading.Lock()

_current: contextvars.ContextVar[Graph | None] = contextvars.ContextVar("devgraph_graph", default=None)


def current_graph() -> Graph | None:
    """The devgraph Graph being captured in this context, or None."""
    return _current.get()


@contextlib.contextmanager
def _being_captured(graph: Graph) -> Iterator[None]:
    token = _current.set(graph)
    try:
        yield
    finally:
        _current.reset(token)


_probes: contextvars.ContextVar[tuple[Callable[[Graph], contextlib.AbstractContextManager[Any]], ...]] = (
    contextvars.ContextVar("devgraph_capture_probes", default=())
)


@contextlib.contextmanager
def probe_captures(factory: Callable[[Graph], contextlib.AbstractContextManager[Any]]) -> Iterator[None]:
    """While the block runs, every ``Graph.capture`` in this context also enters ``factory(graph)``.

    It is entered innermost, inside the capture check: what it issues (a debug tool's copies of each
    op's output, ``devgraph.bisect``) is captured work like the block's own, on every backend. Probes
    nest; the outer one is entered first.
    """
    token = _probes.set((*_probes.get(), factory))
    try:
        yield
    finally:
        _probes.reset(token)


@contextlib.contextmanager
def _probed(graph: Graph) -> Iterator[None]:
    factories = _probes.get()
    if not factories:
        yield
        return
    with contextlib.ExitStack() as stack:
        for factory in factories:
            stack.enter_context(factory(graph))
        yield


@attrs.frozen
class MemoryStats:
    """Device memory counters in bytes (``peak_allocated`` since the last reset)."""

    allocated: int
    reserved: int
    peak_allocated: int


class MemoryPool(abc.ABC):
    """An opaque, shareable handle to the memory a graph captures into.

    Pass the same pool to several ``Graph.capture`` calls to let the graphs share memory; capture
    the largest shape first so smaller graphs reuse its blocks.
    """

    def __init__(self, device: Device) -> None:
        self.device = device

    def __repr__(self) -> str:
        return f"<{type(self).__name__} on {self.device}>"

    @property
    def id(self) -> tuple[int, int] | None:
        """torch's ``(int, int)`` id of this pool (what ``torch.accelerator.Graph(pool=...)`` and
        ``graph_pool_handle()`` use), where the backend's pool has one (its ``handle``); else None."""
        handle = getattr(self, "handle", None)
        if isinstance(handle, tuple) and len(handle) == 2 and all(isinstance(i, int) for i in handle):
            return handle
        return None

    def _users(self) -> weakref.WeakSet[Graph]:
        # Made on first use: a backend's pool may not call this __init__.
        return self.__dict__.setdefault("_devgraph_users", weakref.WeakSet())

    @property
    def in_use(self) -> int:
        """How many graphs hold this pool now (captured or capturing, not reset, not freed)."""
        return len(self._users())

    @property
    def retired(self) -> bool:
        """True once every graph that captured into this pool let go of it: it is never captured
        into again (CUDA's allocator asserts on it); mint a fresh one (``SharedPool`` does)."""
        return bool(self.__dict__.get("_devgraph_used")) and not self._users()

    def _enlist(self, graph: Graph) -> None:
        """Count ``graph`` as a user of this pool; refuse a pool whose every user let go of it.

        CUDA's allocator (and torch_npu's port of it) asserts when a capture joins a pool whose
        last graph was reset or freed, so every backend refuses it, the CPU reference included.
        """
        if self.retired:
            raise DevgraphError(
                "this pool's graphs were all reset, freed or failed to capture: a pool is not captured "
                "into again once its last graph lets go of it (CUDA's allocator asserts on it). Capture "
                "into a fresh pool, device.pool(), or keep one graph of the pool captured while others "
                "re-capture."
            )
        self.__dict__["_devgraph_used"] = True
        self._users().add(graph)

    def _release(self, graph: Graph) -> None:
        """``graph`` was reset (or its capture failed): it no longer holds this pool."""
        self._users().discard(graph)


class Stream(abc.ABC):
    """An ordered queue of device work (``torch.Stream`` vocabulary).

    ``with stream:`` makes it the current stream of its device for the block.
    """

    def __init__(self, device: Device, priority: int = 0) -> None:
        self.device = device
        self.priority = priority

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Block the host until all work queued on this stream has finished."""

    @abc.abstractmethod
    def query(self) -> bool:
        """True when all work queued on this stream has finished."""

    @abc.abstractmethod
    def wait_event(self, event: Event) -> None:
        """Make future work on this stream wait for ``event``."""

    def wait_stream(self, other: Stream) -> None:
        """Make future work on this stream wait for all work queued so far on ``other``."""
        event = self.device.event()
        event.record(other)
        self.wait_event(event)

    def record_event(self, event: Event | None = None) -> Event:
        """Record ``event`` (a new one if None) on this stream and return it."""
        event = event or self.device.event()
        event.record(self)
        return event

    @abc.abstractmethod
    def _enter(self) -> Any:
        """Make this the current stream; return a token for ``_exit``."""

    @abc.abstractmethod
    def _exit(self, token: Any) -> None:
        """Restore the stream that was current before ``_enter``."""

    def _token_stack(self) -> list[Any]:
        # Per thread: two threads may enter the same stream (the device's capture stream) at once.
        tls = self.__dict__.setdefault("_devgraph_tls", threading.local())
        if not hasattr(tls, "stack"):
            tls.stack = []
        return tls.stack

    def __enter__(self) -> Stream:
        self._token_stack().append(self._enter())
        return self

    def __exit__(self, *exc: object) -> None:
        self._exit(self._token_stack().pop())


class Event(abc.ABC):
    """A marker in a stream (``torch.Event`` vocabulary)."""

    def __init__(self, device: Device, enable_timing: bool = False) -> None:
        self.device = device
        self.enable_timing = enable_timing

    @abc.abstractmethod
    def record(self, stream: Stream | None = None) -> None:
        """Record the event on ``stream`` (the current stream if None)."""

    @abc.abstractmethod
    def wait(self, stream: Stream | None = None) -> None:
        """Make ``stream`` (the current stream if None) wait for this event."""

    @abc.abstractmethod
    def query(self) -> bool:
        """True when the work before the event has finished."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Block the host until the event has completed."""

    @abc.abstractmethod
    def elapsed_time(self, end: Event) -> float:
        """Milliseconds between this event and ``end`` (both need ``enable_timing=True``)."""

    def _check_timing(self, end: Event) -> None:
        if not (self.enable_timing and end.enable_timing):
            raise DevgraphError(
                "elapsed_time needs both events created with enable_timing=True: "
                "device.event(enable_timing=True)"
            )


class Graph(abc.ABC):
    """A captured sequence of device work that can be replayed.

    Contract (checked by ``devgraph.testing.conformance``):

    * ``with graph.capture(stream=None, pool=None):`` records the work issued in the block on a
      side stream; memory allocated in the block belongs to ``pool``.
    * ``replay()`` re-runs the work on the same memory: refill the capture-time input tensors,
      read the capture-time output tensors (overwritten by the next replay).
    * Host (non-tensor) arguments are frozen at capture. Work captured as an updatable task
      (``task_group()``, or every call of an op named in ``auto_update_ops``) can be given new host
      arguments with ``update()`` / ``task_update()``.
    * Host syncs inside the block raise ``CaptureError``.
    * ``update()`` and ``replay()`` of one graph are serialised by a per-graph lock, so a worker
      thread may update while another thread replays; ``replay(host_args)`` does both atomically.

    The public methods hold the state machine and the locks and are final: a backend overrides the
    private hooks instead, one per decision (``_FINAL_HOOKS`` maps each public name to its hooks). A
    subclass that overrides a public method is refused when the class is defined (``TypeError``).
    """

    #: Each public name and the hooks a backend overrides instead (``__init_subclass__`` enforces it).
    _FINAL_HOOKS: ClassVar[dict[str, tuple[str, ...]]] = {
        "capture": ("_begin_capture", "_end_capture", "_abort_capture", "_translate_capture_error"),
        "is_captured": (),
        "pool": (),
        "replay": ("_replay", "_replay_with_host_args"),
        "reset": ("_reset",),
        "tasks": ("_settle_host_args",),
        "task_group": ("_task_group_begin", "_task_group_end", "_prepare_task_call"),
        "task_update": (
            "_check_update_allowed",
            "_task_update_begin",
            "_task_update_end",
            "_task_update_abort",
        ),
        "update": ("_check_update_allowed", "_update_tasks", "_needs_reissue", "_updatable_tensor_args"),
        "enable_debug_mode": ("_enable_debug_mode",),
        "debug_dump": ("_debug_dump",),
        "call_opaque": ("_call_opaque",),
    }

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name, hooks in Graph._FINAL_HOOKS.items():
            if name in cls.__dict__:
                instead = (
                    f"override {' / '.join(hooks)} instead" if hooks else "it has no hook: leave it to Graph"
                )
                raise TypeError(
                    f"{cls.__module__}.{cls.__qualname__} overrides Graph.{name}, which is final (the public "
                    f"methods hold the graph's state machine and locks); {instead}"
                )

    def __init__(self, device: Device, keep_graph: bool = False) -> None:
        self.device = device
        self.keep_graph = keep_graph
        self._state = "new"  # new -> capturing -> captured -> (reset) new
        self._pool: MemoryPool | None = None
        self._tasks: list[TaskGroup] = []
        self._lock = threading.RLock()
        self._open_group: TaskGroup | None = None
        #: the ``capture_error_mode`` of the capture in progress or done (``CAPTURE_ERROR_MODES``).
        self.capture_error_mode = "default"

    # -- capture -----------------------------------------------------------------------------

    @final
    @contextlib.contextmanager
    def capture(
        self,
        stream: Stream | None = None,
        pool: MemoryPool | None = None,
        *,
        auto_update_ops: Sequence[str] = (),
        capture_error_mode: str = "default",
    ) -> Iterator[Graph]:
        """Record the work issued inside the block.

        Args:
            stream: the side stream to capture on (None: the device's ``capture_stream()``). It
                must not be the default stream.
            pool: the memory pool to capture into (a new one if None); share it across graphs.
            auto_update_ops: qualified op names (``"devgraph::paged_decode_attention"``) whose every
                call is captured as an updatable task (torch_npu's ``auto_dispatch_capture``).
            capture_error_mode: what the runtime refuses while capturing, in torch.accelerator's
                names (``CAPTURE_ERROR_MODES``); passed to runtimes that take it (npu, accelerator).
        Raises:
            DevgraphError: the graph is already captured (call ``reset()``) or capturing, or an
                ``auto_update_ops`` name is misspelt or names no registered op.
            CaptureError: the block did something a graph cannot hold (a host sync...).
        """
        if self._state == "capturing":
            raise DevgraphError("this graph is already capturing; captures cannot nest")
        if self._state == "captured":
            raise DevgraphError("this graph was already captured; call graph.reset() before capturing again")
        if pool is not None and pool.device.name != self.device.name:
            raise DevgraphError(f"pool belongs to {pool.device}, graph to {self.device}")
        if capture_error_mode not in CAPTURE_ERROR_MODES:
            raise DevgraphError(
                f"capture_error_mode {capture_error_mode!r} is not one of {list(CAPTURE_ERROR_MODES)} "
                "(torch.accelerator.Graph's names)"
            )
        self.capture_error_mode = capture_error_mode
        auto_update_ops = resolve_auto_update_ops(auto_update_ops, getattr(self.device, "updatable_ops", ()))
        stream = stream or self.device.capture_stream()
        self._pool = pool or self.device.pool()
        self._tasks = []
        self._state = "capturing"
        body_ok = False
        try:
            with contextlib.ExitStack() as stack:
                # One capture at a time per device: captures share the capture stream, and CUDA
                # forbids device-wide syncs while another thread captures.
                stack.enter_context(self.device.capture_lock())
                self._pool._enlist(self)
                stack.enter_context(stream)
                self._begin_capture(stream, self._pool)
                stack.callback(self._finish_capture, lambda: body_ok)
                # The check's own exit may refuse the capture (a compiled graph it could not record
                # whole): only a block whose check also exited cleanly ends the capture.
                with (
                    _being_captured(self),
                    _capture.capturing(self, auto_update_ops),
                    _probed(self),
                    refuse_backward(),  # a backward after the capture would read the capture's values
                ):
                    yield self
                body_ok = True
        except BaseException as exc:
            self._state = "new"  # the block or the backend's capture end failed
            self._pool._release(self)
            self._tasks = []
            self._open_group = None
            translated = self._translate_capture_error(exc)
            if translated is not None:
                raise translated from exc
            raise
        self._state = "captured"

    def _finish_capture(self, ok: Callable[[], bool]) -> None:
        if ok():
            self._end_capture()
        else:
            self._abort_capture()

    @final
    def is_captured(self) -> bool:
        """True once a capture has completed (until ``reset()``)."""
        return self._state == "captured"

    @final
    def pool(self) -> MemoryPool:
        """The pool this graph captured into (pass it to other captures to share memory)."""
        if self._pool is None:
            raise DevgraphError("this graph has no pool yet; capture it first (or pass pool= to capture)")
        return self._pool

    # -- replay ------------------------------------------------------------------------------

    @final
    def replay(self, host_args: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None) -> None:
        """Re-run the captured work; with ``host_args``, ``update(host_args)`` first, atomically."""
        if host_args is not None:
            self._check_update_allowed("replay(host_args)")
        with self._lock:  # a reset() on another thread cannot slip between the check and the replay
            if self._state != "captured":
                raise DevgraphError(
                    "replay() of a graph that was never captured (or was reset): capture it first, "
                    "`with graph.capture(): ...`"
                    if self._state == "new"
                    else "replay() inside the graph's own capture block"
                )
            if host_args is None:
                self._replay()
            else:
                self._replay_with_host_args(host_args)

    @final
    def reset(self) -> None:
        """Drop the captured work (and its hold on pool memory) so the graph can be captured again."""
        if self._state == "capturing":
            raise DevgraphError("reset() inside the graph's own capture block")
        with self._lock:
            self._reset()
            if self._pool is not None:
                self._pool._release(self)
            self._tasks = []
            self._state = "new"

    # -- task update -------------------------------------------------------------------------

    @property
    @final
    def tasks(self) -> tuple[TaskGroup, ...]:
        """The updatable tasks captured so far, in capture order."""
        with self._lock:
            self._settle_host_args()
            return tuple(self._tasks)

    @final
    @contextlib.contextmanager
    def task_group(self, op: str = "<explicit>") -> Iterator[TaskGroup]:
        """Capture the work issued in the block as one updatable task.

        Re-issue it later, with new host arguments, inside ``with graph.task_update(group):``.
        """
        if self._state != "capturing":
            raise DevgraphError("task_group() is only valid inside graph.capture()")
        with self._group(TaskGroup(index=len(self._tasks), op=op)) as group:
            yield group

    @contextlib.contextmanager
    def _group(self, group: TaskGroup) -> Iterator[TaskGroup]:
        """Capture the block's work as ``group`` (explicit groups and auto-captured calls alike)."""
        if self._open_group is not None:
            raise DevgraphError("task groups cannot nest")
        self._task_group_begin(group)
        self._open_group = group
        try:
            yield group
        finally:
            self._open_group = None
            self._task_group_end(group)
            self._tasks.append(group)

    @final
    @contextlib.contextmanager
    def task_update(self, group: TaskGroup) -> Iterator[None]:
        """Re-issue the work of ``group`` with new host arguments (issue the same ops in the block)."""
        self._check_update_allowed("task_update()")  # before the lock: see the hook
        with self._lock:  # checked under the lock: a reset() on another thread cannot slip in
            if self._state != "captured":
                raise DevgraphError("task_update() needs a captured graph")
            if group.index >= len(self._tasks) or self._tasks[group.index] is not group:
                raise DevgraphError(f"task group {group.index} ({group.op}) does not belong to this graph")
            self._task_update_begin(group)
            try:
                yield
            except BaseException:
                self._task_update_abort(group)  # keep the task as it was; the caller's error wins
                raise
            self._task_update_end(group)

    @final
    def update(self, host_args: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Give the updatable tasks new host arguments before the next replay.

        Args:
            host_args: a mapping ``{argument name: value}`` applied to every auto-captured task whose
                op takes that argument, or a sequence with one mapping per task in capture order
                (torch_npu's ``cpu_update_input`` shape).
        Raises:
            DevgraphError: a name no task takes, a sequence of the wrong length, or an explicit task
                group (re-issue those with ``task_update``).
        """
        self._check_update_allowed("update()")
        with self._lock:
            if self._state != "captured":
                raise DevgraphError("update() needs a captured graph")
            self._settle_host_args()
            self._update_tasks(host_args)

    # -- debugging (torch.accelerator.Graph's enable_debug_mode / debug_dump) -------------------

    @final
    def enable_debug_mode(self) -> None:
        """Keep what ``debug_dump`` needs; call it before ``capture``.

        Raises:
            DevgraphError: this backend's graphs have no debug dump.
        """
        self._enable_debug_mode()

    @final
    def debug_dump(self, path: str) -> None:
        """Write the captured graph to ``path`` in the runtime's own format (backend-specific).

        Raises:
            DevgraphError: the graph is not captured, or this backend's graphs have no debug dump.
        """
        if self._state != "captured":
            raise DevgraphError("debug_dump() needs a captured graph")
        self._debug_dump(str(path))

    def _no_debug(self) -> DevgraphError:
        return DevgraphError(
            f"{self.device.name} graphs have no debug dump (torch.accelerator.Graph.debug_dump); the "
            "accelerator backend and torch_npu 2.13's NPUGraph have one"
        )

    def _enable_debug_mode(self) -> None:
        raise self._no_debug()

    def _debug_dump(self, path: str) -> None:
        raise self._no_debug()

    @final
    def call_opaque(self, fn: Callable[..., Any], *args: Any, name: str = "opaque") -> Any:
        """Run ``fn(*args)`` as one unit of captured work.

        Stream-capturing backends (cuda, npu) record whatever ``fn`` launches; the CPU reference
        backend, which records dispatcher calls, records ``fn`` as one opaque task replayed on the
        same tensors (for code that bypasses the dispatcher, like inductor's CPU kernels).
        """
        return self._call_opaque(fn, args, name)

    # -- backend hooks: one per decision, what a backend overrides (see _FINAL_HOOKS) ---------------

    def _replay_with_host_args(self, host_args: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """How ``replay(host_args)`` runs, under the graph's lock on a captured graph (default, the
        reference's: ``update(host_args)``, then ``_replay()``). CUDA only notes values its kernels
        read from device tensors; NPU queues the replay and re-issues on its update stream meanwhile."""
        self.update(host_args)
        self._replay()

    def _update_tasks(self, host_args: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """How ``update(host_args)`` gives the tasks new host arguments, under the graph's lock on a
        captured graph (default: each task that ``_needs_reissue`` is re-issued through
        ``task_update``; the others only record the values)."""
        for group, kwargs in apply_host_args(self._tasks, host_args):
            if not self._needs_reissue(group):
                group.remember(kwargs)
                continue
            call = group.call_with(kwargs)
            with self.task_update(group):
                call()
            group.remember(kwargs)

    def _settle_host_args(self) -> None:
        """Record on the tasks any host arguments the backend kept aside (``tasks`` and ``update``
        call it under the graph's lock; default: none are kept aside)."""
        return None

    def _check_update_allowed(self, what: str) -> None:
        """Refuse ``what`` (an update, a task update, a replay with host arguments) before the graph's
        lock is taken, e.g. one nested in another update this thread holds (default: allowed)."""
        return None

    def _call_opaque(self, fn: Callable[..., Any], args: tuple[Any, ...], name: str) -> Any:
        """How ``call_opaque`` runs ``fn(*args)`` (default: as is, stream capture records what it
        launches; under an op recorder, which cannot see into it, as one opaque task)."""
        return record_opaque(fn, args, name)

    def _prepare_task_call(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Any, tuple[Any, ...], dict[str, Any], Callable[[Any], Any] | None]:
        """The call an auto task captures for ``func(*args, **kwargs)``, and what maps its result
        to the caller's (None: the result as is). Runs before the task group opens; a backend whose
        runtime rewrites such calls (torch_npu's handlers swap ``.default`` for ``.out`` with
        pre-allocated outputs) returns the rewritten call. Default: the call as made."""
        return func, args, kwargs, None

    def _updatable_tensor_args(self, func: Any) -> tuple[str, ...]:
        """The tensor arguments of ``func`` (the call an auto task captured) that ``update`` may
        replace all the same: its runtime re-issues them from host memory. Default: none (an update
        gives only the op's non-tensor arguments; the graph reads tensors where they were)."""
        return ()

    @abc.abstractmethod
    def _begin_capture(self, stream: Stream, pool: MemoryPool) -> None: ...

    @abc.abstractmethod
    def _end_capture(self) -> None: ...

    @abc.abstractmethod
    def _abort_capture(self) -> None: ...

    @abc.abstractmethod
    def _replay(self) -> None: ...

    @abc.abstractmethod
    def _reset(self) -> None: ...

    @abc.abstractmethod
    def _task_group_begin(self, group: TaskGroup) -> None: ...

    @abc.abstractmethod
    def _task_group_end(self, group: TaskGroup) -> None: ...

    @abc.abstractmethod
    def _task_update_begin(self, group: TaskGroup) -> None: ...

    @abc.abstractmethod
    def _task_update_end(self, group: TaskGroup) -> None: ...

    def _translate_capture_error(self, exc: BaseException) -> BaseException | None:
        """A clearer error for ``exc`` raised inside a capture (the runtime's own words), or None."""
        return None

    def _task_update_abort(self, group: TaskGroup) -> None:
        """The re-issue block raised: close the update (default: end it, hiding any error of its own
        so the caller's error is the one that propagates)."""
        try:
            self._task_update_end(group)
        except Exception as exc:  # the block's exception is the informative one
            logger.debug("ending an aborted task update failed: %s", exc)

    def _needs_reissue(self, group: TaskGroup) -> bool:
        """Whether new host arguments must be re-issued into the graph (False: the op reads them
        from device tensors, so nothing in the graph depends on the host values)."""
        return True


class Device(abc.ABC):
    """One accelerator (or the CPU reference simulator) and the factories of its objects."""

    #: backend name: "cpu", "cuda", "npu", or a plugin's name.
    name: str = ""
    #: torch dispatch key its tensors use ("CPU", "CUDA", "PrivateUse1").
    dispatch_key: str = ""
    #: hardware streams available to captured graphs (None: no budget to respect).
    capture_stream_budget: int | None = None
    #: capture sizes this device's stack can hold, declared (probed or configured) by the backend;
    #: None: no cap, the stream budget alone limits them (devgraph.compile's planner).
    max_capture_sizes: int | None = None
    #: ops whose calls the runner captures as updatable tasks on this device.
    updatable_ops: tuple[str, ...] = ()
    #: how piecewise mode compiles graph pieces unless the user says otherwise
    #: ("eager", "inductor", "torchair"; see devgraph.compile).
    default_compile_backend: str = "eager"

    def __init__(self, index: int = 0) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"<devgraph.Device {self.name}:{self.index}>"

    def __str__(self) -> str:
        return f"{self.name}:{self.index}"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Device) and (self.name, self.index) == (other.name, other.index)

    def __hash__(self) -> int:
        return hash((self.name, self.index))

    @property
    @abc.abstractmethod
    def torch_device(self) -> torch.device:
        """The ``torch.device`` tensors for this device live on."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Block until all work on every stream of this device has finished."""

    @abc.abstractmethod
    def stream(self, priority: int = 0) -> Stream:
        """A new stream."""

    def capture_lock(self) -> threading.RLock:
        """The lock ``Graph.capture`` holds while capturing on this device."""
        return self._once("_devgraph_capture_lock", threading.RLock)

    def capture_stream(self) -> Stream:
        """The side stream graphs capture on when given none: one per device, because caching
        allocators (CUDA's, torch_npu's) reuse a shared pool's free blocks only on the stream that
        allocated them, so graphs sharing a pool must share the capture stream too."""
        return self._once("_devgraph_capture_stream", self.stream)

    def _once(self, attr: str, make: Callable[[], Any]) -> Any:
        # Made on first use (a stream touches the device), once per device even across threads.
        with _device_state_lock:
            value = getattr(self, attr, None)
            if value is None:
                value = make()
                setattr(self, attr, value)
            return value

    @abc.abstractmethod
    def current_stream(self) -> Stream:
        """The stream work is issued to now."""

    @abc.abstractmethod
    def event(self, enable_timing: bool = False) -> Event:
        """A new event."""

    @abc.abstractmethod
    def graph(self, keep_graph: bool = False) -> Graph:
        """A new, empty graph."""

    @abc.abstractmethod
    def pool(self) -> MemoryPool:
        """A new memory pool handle for graph capture."""

    @abc.abstractmethod
    def memory_stats(self) -> MemoryStats:
        """Allocated / reserved / peak bytes on this device."""

    def weak_ref(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor over the same memory that does not keep it alive (see ``weak_ref_tensors``)."""
        from devgraph.graph._weakref import weak_ref_tensor

        return weak_ref_tensor(tensor)
