"""Asynchronous streams for the torch_npu simulator: per-stream work queues and a scheduler.

Device work -- a graph replay, the rewrite a task update commits, an event record or wait -- is
not run when the host issues it: it is appended to its stream's queue. A queue runs its work in
order; a wait holds its stream until the event it waits on completes, which makes the stream that
records that event run (as far as it can). When the host runs a queue depends on the mode:

* ``"lazy"``: only when the host synchronises (the device, a stream or an event) or when another
  stream being run waits on it. On a device-wide sync the stream whose oldest pending work is the
  newest runs first, so a stream that is not ordered behind another by a wait overtakes it: a
  missing ``wait_stream`` shows as a result computed with the wrong arguments.
* ``"eager"`` (the default): each queue runs as far as it can as soon as work is queued, so plain
  CPU reads of graph outputs see finished replays. A replay still stops at an external-event wait
  until the event is recorded (replay-then-update works as on hardware).

A host sync that cannot finish because every remaining queue waits on something nothing will
record waits up to ``hang_timeout`` seconds for another host thread to queue it, then raises
``SimulatedHang`` naming the blocked work (for a graph, the task group it waits in front of) and
drops all queued work, as the device would have to be reset. Eager host tensor ops are not queued:
the simulator cannot see them (tensors are plain CPU tensors).
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["MODES", "Call", "Scheduler", "SimulatedHang", "Work"]

MODES = ("eager", "lazy")


class SimulatedHang(RuntimeError):
    """The simulated device would hang: queued work waits on an event nothing will record."""


class Work:
    """One item of a stream's queue. ``step`` runs it as far as it can; True once it is done."""

    name = "work"
    seq = 0  # queue order, device-wide (set by Scheduler.submit)

    def step(self, sched: Scheduler) -> bool:
        raise NotImplementedError

    def blocker(self) -> str:
        """What the work waits on (for hang reports)."""
        return "nothing"


class Call(Work):
    """Run ``fn()`` when the stream reaches it."""

    def __init__(self, name: str, fn: Callable[[], Any]) -> None:
        self.name = name
        self.fn = fn

    def step(self, sched: Scheduler) -> bool:
        self.fn()
        sched.ticks += 1
        return True


class Scheduler:
    """The queues of every simulated stream (by stream id), and when they run."""

    def __init__(self, mode: str = "eager", hang_timeout: float = 2.0) -> None:
        if mode not in MODES:
            raise ValueError(f"simulated stream mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.hang_timeout = float(hang_timeout)
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.queues: dict[int, collections.deque[Work]] = {}
        self.ticks = 0  # grows whenever any work makes progress
        self._seq = itertools.count(1)
        self._running: set[int] = set()  # streams being advanced (a wait cycle must not recurse)

    # -- queueing ------------------------------------------------------------------------------

    def submit(self, stream_id: int, work: Work) -> None:
        """Queue ``work`` on stream ``stream_id`` (run at once as far as possible in eager mode)."""
        with self.lock:
            work.seq = next(self._seq)
            self.queues.setdefault(stream_id, collections.deque()).append(work)
            self.cond.notify_all()
            if self.mode == "eager":
                self.pump()

    def pending(self, stream_id: int) -> bool:
        with self.lock:
            return bool(self.queues.get(stream_id))

    def pending_work(self) -> list[tuple[int, Work]]:
        with self.lock:
            return [(sid, w) for sid, q in self.queues.items() for w in q]

    # -- running ----------------------------------------------------------------------------------

    def advance(self, stream_id: int) -> None:
        """Run stream ``stream_id``'s queue until it is empty or its head is blocked."""
        if stream_id in self._running:
            return
        self._running.add(stream_id)
        try:
            queue = self.queues.get(stream_id)
            while queue:
                try:
                    done = queue[0].step(self)
                except BaseException:
                    queue.popleft()  # failed work is gone (its error goes to the host)
                    raise
                if not done:
                    return
                queue.popleft()
                self.ticks += 1
                self.cond.notify_all()
        finally:
            self._running.discard(stream_id)

    def pump(self) -> None:
        """Run every queue as far as it can (eager mode, after each submit)."""
        while True:
            before = self.ticks
            for sid in self._order():
                self.advance(sid)
            if self.ticks == before:
                return

    def _order(self) -> list[int]:
        """Streams with work, the one whose oldest pending work is the newest first."""
        busy = [sid for sid, q in self.queues.items() if q]
        return sorted(busy, key=lambda sid: -self.queues[sid][0].seq)

    def drive_external(self, event: Any) -> None:
        """Run the streams that hold a pending record of external ``event`` (a waiter needs it)."""
        for sid, queue in list(self.queues.items()):
            if any(getattr(w, "external", None) is event for w in queue):
                self.advance(sid)

    # -- host synchronisation -------------------------------------------------------------------

    def synchronize(self, done: Callable[[], bool], streams: Callable[[], list[int]], what: str) -> None:
        """Run ``streams()`` until ``done()``; wait for other threads, then raise ``SimulatedHang``."""
        deadline = time.monotonic() + self.hang_timeout
        with self.lock:
            while not done():
                before = self.ticks
                for sid in streams():
                    self.advance(sid)
                if done() or self.ticks != before:
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    self._hang(what)
                self.cond.wait(left)

    def synchronize_all(self) -> None:
        self.synchronize(lambda: not any(self.queues.values()), self._order, "synchronize()")

    def synchronize_stream(self, stream_id: int) -> None:
        self.synchronize(
            lambda: not self.queues.get(stream_id), lambda: [stream_id], f"stream {stream_id} synchronize()"
        )

    def _hang(self, what: str) -> None:
        blocked = [
            f"stream {sid}: {q[0].name} waits on {q[0].blocker()} ({len(q)} queued)"
            for sid, q in self.queues.items()
            if q
        ]
        for queue in self.queues.values():
            queue.clear()  # the device would need a reset; let the process go on
        raise SimulatedHang(
            f"simulated NPU would hang: {what} waited {self.hang_timeout:g}s and nothing can run. "
            + "; ".join(blocked)
            + ". Every ExternalEvent a graph waits on must be recorded before (or while) it replays: "
            "update the task (graph_task_update_begin/end, then event.record(update_stream)) or record it."
        )

    def clear(self) -> list[tuple[int, Work]]:
        """Drop all queued work (simulator exit); return what was left."""
        with self.lock:
            left = self.pending_work()
            for queue in self.queues.values():
                queue.clear()
            return left
