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
    _host_names: frozenset[str] = attrs.field(default=frozenset(), repr=False)

    @classmethod
    def for_call(
        cls,
        index: int,
        func: OpOverload,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        updatable_tensors: Sequence[str] = (),
    ) -> TaskGroup:
        """A group for one auto-captured call of the torch op ``func``.

        Its host arguments (what ``update`` may give it) are the op's non-tensor arguments, and
        ``updatable_tensors``: tensor arguments the backend's runtime re-issues from host memory
        (torch_npu's handler registry updates ``_npu_paged_attention``'s ``context_lens``).
        """
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
            host_names=frozenset(a.name for a in func._schema.arguments if not _holds_tensor_type(a.type))
            | frozenset(updatable_tensors),
        )

    @property
    def is_auto(self) -> bool:
        return self._func is not None

    def takes(self, name: str) -> bool:
        """Whether ``update`` may give this task a new ``name``: one of its op's host arguments
        (``host_names``), never a tensor argument (the graph reads tensors where they were)."""
        return name in self._host_names

    @property
    def argument_names(self) -> tuple[str, ...]:
        """The op's argument names, tensors included (auto tasks; empty for explicit groups)."""
        return self._names

    @property
    def host_names(self) -> tuple[str, ...]:
        """The op's host (non-tensor) argument names, in the op's order: what ``update`` may give
        this task (auto tasks; empty for explicit groups)."""
        return tuple(n for n in self._names if n in self._host_names)

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


def _holds_tensor_type(schema_type: Any) -> bool:
    """Whether an op schema argument's type is or holds a tensor (``Tensor``, ``Tensor?``,
    ``Tensor[]``, ``Tensor?[]``)."""
    return "Tensor" in str(schema_type)


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
            raise _unknown(sorted(unused), tasks)
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
            raise DevgraphError(
                f"task {task.index} ({task.op}) takes no host argument(s) {bad}; its host arguments are "
                f"{list(task.host_names)}" + _tensor_note(bad, [task])
            )
        yield task, dict(given)


def _unknown(names: list[str], tasks: Sequence[TaskGroup]) -> DevgraphError:
    """The error for ``update`` names that no updatable task takes as a host argument."""
    auto = [t for t in tasks if t.is_auto]
    ops = sorted({t.op for t in tasks}) or ["<none captured>"]
    valid = sorted({n for t in auto for n in t.host_names})
    return DevgraphError(
        f"no updatable task takes host argument(s) {names}; the graph's updatable ops are {ops}, whose host "
        f"arguments are {valid or 'none'}"
        + _tensor_note(names, auto)
        + ". Pass one of those names, or capture with auto_update_ops=[...] naming the op that takes them."
    )


def _tensor_note(names: Sequence[str], tasks: Sequence[TaskGroup]) -> str:
    """A clause for names that are tensor arguments of the tasks' ops (an update cannot replace those)."""
    tensors = sorted({n for n in names for t in tasks if n in t.argument_names})
    if not tensors:
        return ""
    return (
        f" ({tensors} {'is a tensor argument' if len(tensors) == 1 else 'are tensor arguments'}: a graph reads "
        "tensors where they were at capture, so write new values into that tensor in place instead)"
    )
