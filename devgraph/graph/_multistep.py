"""Several steps captured as one graph, every step's host arguments given with one replay.

Speculative decoding's draft model runs ``k`` small steps per target step, each feeding its token to
the next. vllm-ascend captures all of them as one graph (its ``acl_graph.py``, PR #5940, "Merge the
multi eagle graphs to one graph"): the attention metadata of every step is built on the host before
the replay, and the attention arguments of all steps are updated at once. ``MultiStepGraph`` is that
shape on devgraph's contract: one ``Graph`` whose capture is cut into ``steps`` marked blocks, whose
updatable tasks are grouped by the step that captured them, and whose ``replay`` takes one host
argument mapping per step and hands the graph one mapping per task: one ``Graph.replay(host_args)``,
which every backend runs as one update (the NPU backend: one submission on its update stream, under
its one-submitter-per-device lock, ordered by events; no device-wide sync).

What it refuses (``DevgraphError``), because the replay would otherwise be silently wrong: a capture
with another number of steps than declared, steps whose updatable tasks differ in count or op,
updatable work captured outside every step, explicit task groups (``update`` cannot re-issue them),
and at replay a step given no host arguments, or a task of a step that none of its step's arguments
reach (it would replay with the lengths of an earlier replay).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs

from devgraph._errors import DevgraphError
from devgraph.graph._contract import Device, Graph, MemoryPool, Stream
from devgraph.graph._tasks import TaskGroup, apply_host_args

__all__ = ["MultiStepGraph", "MultiStepStats", "step_lengths"]


def step_lengths(seq_lens: Sequence[int], steps: int) -> list[list[int]]:
    """Each step's sequence lengths when every step appends one token to every row: step ``i`` sees
    ``seq_lens[b] + i`` (``seq_lens``: the lengths at step 0, its own token included)."""
    if steps < 1:
        raise DevgraphError(f"step_lengths needs at least one step, got {steps}")
    return [[int(n) + i for n in seq_lens] for i in range(steps)]


@attrs.define
class MultiStepStats:
    """What a ``MultiStepGraph`` did: ``replays`` (each one ``Graph.replay``) and
    ``update_submissions`` (host-argument updates handed to the graph: one per replay)."""

    replays: int = 0
    update_submissions: int = 0


class MultiStepGraph:
    """``steps`` steps captured as one graph; ``replay`` gives every step its host arguments at once.

    Capture each step inside ``with graph.step(i):``, in order, within ``with graph.capture():``::

        draft = MultiStepGraph(device, steps=3)
        with draft.capture():
            for i in range(3):
                with draft.step(i):
                    logits = model(ids[i], positions[i], ...)  # attention: an updatable task
                    ids[i + 1].copy_(logits.argmax(-1))          # feeds step i + 1 inside the graph
        draft.replay([{"seq_lens_host": lens} for lens in step_lengths(lens0, 3)])

    Tensors (token ids, positions, slots, device lengths) are read where they were at capture: write
    every step's values into them before ``replay``, as for any graph. Host arguments (a host list of
    lengths) are given per step at ``replay``.

    Args:
        device: the device to capture on.
        steps: how many steps the capture holds (``step(0)`` .. ``step(steps - 1)``).
    """

    def __init__(self, device: Device, steps: int) -> None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise DevgraphError(f"MultiStepGraph needs steps >= 1, got {steps!r}")
        self.device = device
        self.steps = steps
        self.graph: Graph = device.graph()
        self.stats = MultiStepStats()
        self._bounds: list[tuple[int, int]] = []  # per step: its tasks' [start, end) in capture order
        self._open: int | None = None
        self._capturing = False
        self._step_tasks: list[tuple[TaskGroup, ...]] = []

    # -- capture ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def capture(
        self,
        stream: Stream | None = None,
        pool: MemoryPool | None = None,
        *,
        auto_update_ops: Sequence[str] | None = None,
        capture_error_mode: str = "default",
    ) -> Iterator[MultiStepGraph]:
        """Capture the block (``Graph.capture``), its steps marked with ``step(i)``.

        Args:
            auto_update_ops: the ops captured as updatable tasks (None: the device's
                ``updatable_ops``, its paged attention among them).
        Raises:
            DevgraphError: after the block, when it did not capture exactly ``steps`` steps in order,
                its steps' updatable tasks differ in count or op, updatable work ran outside every
                step, or it opened an explicit task group; the graph is reset.
        """
        if self._capturing:
            raise DevgraphError("this MultiStepGraph is already capturing; captures cannot nest")
        if self.graph.is_captured():  # checked before its steps are forgotten: it stays replayable
            raise DevgraphError(
                "this MultiStepGraph was already captured; call reset() before capturing again"
            )
        ops = self.device.updatable_ops if auto_update_ops is None else auto_update_ops
        self._bounds, self._step_tasks, self._open = [], [], None
        self._capturing = True
        try:
            with self.graph.capture(stream, pool, auto_update_ops=ops, capture_error_mode=capture_error_mode):
                yield self
                if self._open is not None:
                    raise DevgraphError(f"step {self._open} is still open at the end of the capture")
        finally:
            self._capturing = False
        try:
            self._step_tasks = self._check_steps()
        except DevgraphError:
            self.graph.reset()
            raise

    @contextlib.contextmanager
    def step(self, index: int) -> Iterator[None]:
        """Mark the work of the block as step ``index`` (steps come in order, 0 first)."""
        if not self._capturing:
            raise DevgraphError("MultiStepGraph.step() is only valid inside MultiStepGraph.capture()")
        if self._open is not None:
            raise DevgraphError(f"step {index} opened inside step {self._open}: steps cannot nest")
        if index != len(self._bounds):
            raise DevgraphError(
                f"step {index} captured after {len(self._bounds)} step(s): capture the steps in order, "
                f"step(0) .. step({self.steps - 1})"
            )
        if index >= self.steps:
            raise DevgraphError(
                f"step {index} captured, but this MultiStepGraph was made with steps={self.steps}"
            )
        start = len(self._captured_tasks())
        if start != (self._bounds[-1][1] if self._bounds else 0):
            raise self._outside(start)
        self._open = index
        try:
            yield
        finally:
            self._open = None
        self._bounds.append((start, len(self._captured_tasks())))

    def _captured_tasks(self) -> tuple[TaskGroup, ...]:
        return self.graph.tasks  # the tasks captured so far, in capture order

    def _outside(self, count: int) -> DevgraphError:
        return DevgraphError(
            f"updatable work was captured outside every step (task {count - 1}): a task that belongs to "
            "no step gets no host arguments at replay and would replay stale. Capture it inside one of "
            "the `with graph.step(i):` blocks"
        )

    def _check_steps(self) -> list[tuple[TaskGroup, ...]]:
        tasks = self.graph.tasks
        if len(self._bounds) != self.steps:
            raise DevgraphError(
                f"the capture held {len(self._bounds)} step(s), but this MultiStepGraph was made with "
                f"steps={self.steps}: capture step(0) .. step({self.steps - 1}) once each"
            )
        if self._bounds[-1][1] != len(tasks):
            raise self._outside(len(tasks))
        explicit = [t for t in tasks if not t.is_auto]
        if explicit:
            raise DevgraphError(
                f"task {explicit[0].index} is an explicit task group: a MultiStepGraph gives host arguments "
                "through update(), which only re-issues auto tasks; capture the op with auto_update_ops"
            )
        per_step = [tuple(tasks[a:b]) for a, b in self._bounds]
        first = [t.op for t in per_step[0]]
        for i, step_tasks in enumerate(per_step[1:], start=1):
            ops = [t.op for t in step_tasks]
            if ops != first:
                raise DevgraphError(
                    f"step {i} captured {len(ops)} updatable task(s) {ops}, step 0 captured {len(first)} "
                    f"{first}: every step of a MultiStepGraph must capture the same updatable ops in the "
                    "same order (the same draft forward per step)"
                )
        return per_step

    # -- replay -----------------------------------------------------------------------------------

    @property
    def tasks_per_step(self) -> int:
        """How many updatable tasks each step captured (the draft's attention layers)."""
        self._check_captured("tasks_per_step")
        return len(self._step_tasks[0])

    def step_tasks(self, index: int) -> tuple[TaskGroup, ...]:
        """The updatable tasks step ``index`` captured, in capture order."""
        self._check_captured("step_tasks()")
        return self._step_tasks[index]

    def host_args(self, step_host_args: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """One host-argument mapping per task (what ``Graph.replay`` takes) from one per step.

        Each step's mapping goes to every task of that step whose op takes the name (as
        ``Graph.update`` broadcasts one mapping over a graph's tasks).

        Raises:
            DevgraphError: not one mapping per step, a step given none, a name no task of its step
                takes, or a task of a step that none of the step's names reach.
        """
        self._check_captured("host_args()")
        if isinstance(step_host_args, Mapping) or len(step_host_args) != self.steps:
            count = (
                "one mapping" if isinstance(step_host_args, Mapping) else f"{len(step_host_args)} mapping(s)"
            )
            raise DevgraphError(
                f"MultiStepGraph.replay() got {count} for {self.steps} steps: pass one host-argument "
                "mapping per step, in step order (step_lengths() builds growing lengths)"
            )
        flat: list[dict[str, Any]] = []
        for i, (step_tasks, given) in enumerate(zip(self._step_tasks, step_host_args)):
            if not step_tasks:
                if given:
                    raise DevgraphError(
                        f"step {i} got host arguments {sorted(given)}, but its steps captured no updatable task"
                    )
                continue
            if not given:
                raise DevgraphError(
                    f"step {i} got no host arguments; its {len(step_tasks)} updatable task(s) would replay "
                    "with the arguments of an earlier replay. Give every step its own (its lengths grow by "
                    "one per step: step_lengths())"
                )
            try:
                pairs = dict((t.index, kw) for t, kw in apply_host_args(step_tasks, given))
            except DevgraphError as exc:
                raise DevgraphError(f"step {i}: {exc}") from exc
            missing = [t for t in step_tasks if t.index not in pairs]
            if missing:
                raise DevgraphError(
                    f"step {i}: task {missing[0].index} ({missing[0].op}) takes none of {sorted(given)}; its host "
                    f"arguments are {list(missing[0].host_names)}. It would replay stale"
                )
            flat.extend(pairs[t.index] for t in step_tasks)
        return flat

    def replay(self, step_host_args: Sequence[Mapping[str, Any]] | None = None) -> None:
        """Replay every step, each with its host arguments: one ``Graph.replay(host_args)``, one update.

        Args:
            step_host_args: one mapping per step (``{"seq_lens_host": lens}``); may be None only when
                the capture holds no updatable task.
        Raises:
            DevgraphError: see ``host_args``; nothing is replayed then.
        """
        self._check_captured("replay()")
        if step_host_args is None:
            if any(self._step_tasks):
                raise DevgraphError(
                    f"MultiStepGraph.replay() without host arguments, but its steps hold {self.tasks_per_step} "
                    "updatable task(s) each: they would replay with the arguments of an earlier replay. Pass "
                    "one mapping per step"
                )
            self.graph.replay()
            self.stats.replays += 1
            return
        flat = self.host_args(step_host_args)
        if not flat:
            self.graph.replay()
        else:
            self.graph.replay(host_args=flat)
            self.stats.update_submissions += 1
        self.stats.replays += 1

    def reset(self) -> None:
        """Drop the captured work; capture again with ``capture``."""
        self.graph.reset()
        self._bounds, self._step_tasks = [], []

    def _check_captured(self, what: str) -> None:
        if not self._step_tasks or not self.graph.is_captured():
            raise DevgraphError(f"MultiStepGraph.{what} needs a captured graph: capture it first")
