"""What one step's task update re-issues, decided (and checked) before anything is queued.

``NpuGraph`` re-issues an attention task whose only new argument is its lengths from the torch_npu
call it launched (``_kernels.Launch``): the lengths are built once per step for every task given the
same list. The common step, ``{"seq_lens_host": lens}`` for every task that takes it, is a
``LengthsStep``: no name matching, no list or dict per task (what vllm-ascend's loop does per
layer, and no more). Any other update is a ``Reissue`` per task; a task without a launch, or given
another argument, runs its op again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from devgraph._errors import DevgraphError
from devgraph.backends.npu import _kernels
from devgraph.graph import TaskGroup, apply_host_args

__all__ = ["FastTasks", "LengthsStep", "Reissue", "fast_tasks", "lengths_step", "plan"]

#: One task's re-issue: the group, its new host arguments, and the lengths its launch is re-issued
#: with (None: run the group's op again).
Reissue = tuple[TaskGroup, Mapping[str, Any], "list[int] | None"]


@attrs.frozen(eq=False)
class FastTasks:
    """The tasks taking the lengths, when every one has a launch of one batch (made once per graph
    and kept until a launch changes)."""

    groups: list[TaskGroup]
    launches: list[_kernels.Launch]
    batch: int
    indices: frozenset[int]


@attrs.frozen(eq=False)
class LengthsStep:
    """A step giving every task of ``fast`` the same lengths, each re-issued from its launch."""

    fast: FastTasks
    lengths: list[int]  # built once, shared by every layer
    given: Any  # the caller's value, what the tasks' ``host_args`` record


def fast_tasks(tasks: Sequence[TaskGroup], launches: Mapping[int, _kernels.Launch]) -> FastTasks | None:
    """The tasks a ``LengthsStep`` re-issues, or None when some task taking the lengths has no
    launch (or the launches differ in batch): such steps are planned task by task."""
    groups = [g for g in tasks if g.is_auto and g.takes(_kernels.LENGTHS)]
    kept = [launches.get(g.index) for g in groups]
    if not groups or any(launch is None for launch in kept):
        return None
    found = [launch for launch in kept if launch is not None]
    if len({launch.batch for launch in found}) != 1:
        return None
    return FastTasks(groups, found, found[0].batch, frozenset(g.index for g in groups))


def _refused(group: TaskGroup, host_args: Mapping[str, Any], exc: ValueError) -> DevgraphError:
    return DevgraphError(
        f"task update of task {group.index} ({group.op}) with {dict(host_args)} failed (ValueError: {exc}). "
        "Nothing was re-issued: every task keeps its previous arguments."
    )


def lengths_step(
    fast: FastTasks | None, host_args: Mapping[str, Any] | Sequence[Mapping[str, Any]]
) -> LengthsStep | None:
    """``host_args`` as a ``LengthsStep`` when it gives only the lengths, one list for every task.

    Raises:
        DevgraphError: the lengths do not fit the tasks' batch (nothing is queued yet).
    """
    if fast is None or not isinstance(host_args, Mapping):
        return None
    if len(host_args) != 1 or _kernels.LENGTHS not in host_args:
        return None
    given = host_args[_kernels.LENGTHS]
    try:
        lengths = _kernels.attention_lengths(given, fast.batch)
    except ValueError as exc:
        raise _refused(fast.groups[0], host_args, exc) from exc
    return LengthsStep(fast, lengths, given)


def plan(
    tasks: Sequence[TaskGroup],
    launches: Mapping[int, _kernels.Launch],
    host_args: Mapping[str, Any] | Sequence[Mapping[str, Any]],
) -> list[Reissue]:
    """Each task's re-issue (``apply_host_args``'s checks), the lengths built once per list given.

    Raises:
        DevgraphError: a name no task takes, a sequence of the wrong length, or lengths that do not
            fit a task's batch (nothing is queued yet).
    """
    built: dict[tuple[int, int], list[int]] = {}
    steps: list[Reissue] = []
    for group, given_args in apply_host_args(tasks, host_args):
        launch = launches.get(group.index)
        if launch is None or given_args.keys() != {_kernels.LENGTHS}:
            steps.append((group, given_args, None))
            continue
        given = given_args[_kernels.LENGTHS]  # alive in given_args: its id stays unique
        lengths = built.get((id(given), launch.batch))
        if lengths is None:
            try:
                lengths = _kernels.attention_lengths(given, launch.batch)
            except ValueError as exc:
                raise _refused(group, given_args, exc) from exc
            built[id(given), launch.batch] = lengths
        steps.append((group, given_args, lengths))
    return steps
