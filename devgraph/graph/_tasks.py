"""Updatable tasks: captured work whose host arguments can change between replays.

DESIGN.md, graph contract point 3. A ``TaskGroup`` is the handle of one such piece of work. Auto
tasks (every call of a named op during capture) also remember the call so ``Graph.update`` can
re-issue it with new host arguments; explicit groups are re-issued by the caller inside
``Graph.task_update``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import attrs

from devgraph._errors import DevgraphError

if TYPE_CHECKING:  # torch is imported when first needed
    from torch._ops import OpOverload

__all__ = ["TaskGroup", "apply_host_args"]


@attrs.define(eq=False)
class TaskGroup:
    """Handle of one updatable task captured in a graph.

    Attributes:
        index: position among the graph's tasks (capture order).
        op: qualified op name for auto tasks, ``"<explicit>"`` for explicit groups.
        host_args: the host arguments the task holds now (frozen at capture, changed by update).
        handle: the backend's own handle (torch_npu's task-group handle on NPU).
    """

    index: int
    op: str
    host_args: dict[str, Any] = attrs.field(factory=dict)
    handle: Any = None  # whatever the backend's runtime hands back
    _func: OpOverload | None = attrs.field(default=None, repr=False)
    _args: tuple[Any, ...] = attrs.field(default=(), repr=False)
    _kwargs: dict[str, Any] = attrs.field(factory=dict, repr=False)
    _names: tuple[str, ...] = attrs.field(default=(), repr=False)

    @classmethod
    def for_call(
        cls, index: int, func: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> TaskGroup:
        """A group for one auto-captured call of the torch op ``func``."""
        names = tuple(a.name for a in func._schema.arguments)
        host: dict[str, Any] = {}
        for i, name in enumerate(names):
            value = args[i] if i < len(args) else kwargs.get(name)
            if value is not None and not holds_tensor(value):
                host[name] = value
        from torch.utils._python_dispatch import _disable_current_modes

        from devgraph.graph._weakref import weak_ref_tensors

        # Weak references, as vllm-ascend keeps its attention update parameters: the task must not
        # keep capture-time intermediates alive, or graphs sharing a pool could not reuse them.
        with _disable_current_modes():  # building the weak tensors is not part of the captured work
            weak_args, weak_kwargs = tuple(weak_ref_tensors(list(args))), weak_ref_tensors(dict(kwargs))
        return cls(
            index=index,
            op=func._schema.name,
            host_args=host,
            func=func,
            args=weak_args,
            kwargs=weak_kwargs,
            names=names,
        )

    @property
    def is_auto(self) -> bool:
        return self._func is not None

    def takes(self, name: str) -> bool:
        return name in self._names

    @property
    def argument_names(self) -> tuple[str, ...]:
        """The op's argument names (auto tasks; empty for explicit groups)."""
        return self._names

    def call_with(self, new_host_args: Mapping[str, Any]) -> Callable[[], Any]:
        """A thunk that re-issues the captured call with ``new_host_args`` replacing host values."""
        args = list(self._args)
        kwargs = dict(self._kwargs)
        for name, value in new_host_args.items():
            i = self._names.index(name)
            if i < len(args):
                args[i] = value
            else:
                kwargs[name] = value
        func = cast("OpOverload", self._func)  # an auto task's (the caller re-issues explicit groups)
        return lambda: func(*args, **kwargs)

    def remember(self, new_host_args: Mapping[str, Any]) -> None:
        self.host_args.update(new_host_args)


def holds_tensor(value: Any) -> bool:
    """True when ``value`` is a tensor or a (nested) list/tuple/dict holding one."""
    import torch

    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (list, tuple)):
        return any(holds_tensor(v) for v in value)
    if isinstance(value, dict):
        return any(holds_tensor(v) for v in value.values())
    return False


def apply_host_args(
    tasks: Sequence[TaskGroup], host_args: Mapping[str, Any] | Sequence[Mapping[str, Any]]
) -> Iterator[tuple[TaskGroup, dict[str, Any]]]:
    """Pair each task with the host arguments ``host_args`` gives it, validating names."""
    if isinstance(host_args, Mapping):
        unused = set(host_args)
        pairs = []
        for task in tasks:
            kwargs = {k: v for k, v in host_args.items() if task.is_auto and task.takes(k)}
            if kwargs:
                unused -= set(kwargs)
                pairs.append((task, kwargs))
        if unused:
            ops = sorted({t.op for t in tasks}) or ["<none captured>"]
            raise DevgraphError(
                f"no updatable task takes host argument(s) {sorted(unused)}; the graph's updatable "
                f"ops are {ops}. Capture with auto_update_ops=[...] naming the op that takes them."
            )
        yield from pairs
        return
    per_task = list(host_args)
    if len(per_task) != len(tasks):
        raise DevgraphError(
            f"update() got {len(per_task)} host-argument mappings for {len(tasks)} updatable tasks; "
            "pass one per task in capture order, or a single mapping to broadcast"
        )
    for task, given in zip(tasks, per_task):
        if not given:
            continue
        if not task.is_auto:
            raise DevgraphError(
                f"task {task.index} is an explicit task group; re-issue its work inside "
                "`with graph.task_update(group):` instead of update()"
            )
        bad = [k for k in given if not task.takes(k)]
        if bad:
            raise DevgraphError(f"task {task.index} ({task.op}) takes no argument(s) {bad}")
        yield task, dict(given)
