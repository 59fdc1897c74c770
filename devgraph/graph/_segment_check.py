"""What a segment of a breakable capture refuses: ops whose result depends on what a graph cannot see.

``refusal`` names why an op (not a break) cannot be captured in a segment: a custom op given a
non-empty host list or, on a device that is not the CPU, a CPU tensor. ``MARK_REMEDY`` is the
remedy every such refusal gives. See ``_breakable``.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from devgraph.graph._break_calls import tensors
from devgraph.graph._opnames import TORCH_NAMESPACES

__all__ = ["MARK_REMEDY", "TORCH_NAMESPACES", "refusal"]

MARK_REMEDY = (
    "mark it as a break so it runs eagerly between the graphs with each call's values: "
    "devgraph.mark_break({op!r}) (or breaks=[{op!r}]); if the value is the same on every call, "
    "static_ops=[{op!r}]"
)


def _host_list_args(func: Any) -> list[tuple[int, str]]:
    """(position, name) of the arguments of ``func``'s schema that are lists of host scalars."""
    import torch

    found = []
    for i, arg in enumerate(func._schema.arguments):
        kind = arg.type
        if isinstance(kind, torch._C.OptionalType):
            kind = kind.getElementType()
        if isinstance(kind, torch._C.ListType) and not isinstance(
            kind.getElementType(), (torch._C.TensorType, torch._C.OptionalType)
        ):
            found.append((i, arg.name))
    return found


_LISTS: dict[Any, list[tuple[int, str]]] = {}


def refusal(
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    allowed: Collection[str],
    device_type: str,
) -> str | None:
    """Why op ``func`` (not a break) cannot be captured in a segment, or None (see the module docstring)."""
    name = func._schema.name
    namespace = name.partition("::")[0]
    if namespace in TORCH_NAMESPACES or name in allowed:
        return None
    lists = _LISTS.get(func)
    if lists is None:
        lists = _LISTS[func] = _host_list_args(func)
    for i, arg in lists:
        value = args[i] if i < len(args) else kwargs.get(arg)
        if isinstance(value, (list, tuple)) and len(value) > 0:
            return (
                f"{name} reads the host list {arg}={list(value)!r}, which a graph freezes at capture: "
                "the values of later calls would be ignored"
            )
    if device_type != "cpu":
        for t in tensors((args, kwargs)):
            if t.device.type == "cpu":
                return (
                    f"{name} reads a CPU tensor {tuple(t.shape)} on the host at launch, once: a graph "
                    "freezes what it read"
                )
    return None
