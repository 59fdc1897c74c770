"""Flattening an op's arguments and results, fast: the per-op hot path of the CPU reference's
recorder and of a device capture's host-compute check.

An op's arguments and results are flat by schema (tensors, scalars, lists of them, ``None``; keyword
arguments a dict), so plain recursion over tuples, lists and dicts visits them in the order
``torch.utils._pytree`` does (sequences in order, dicts in insertion order), several times faster: the
CPU reference spent about a quarter of a capture in pytree (an SGLang engine start, profiled).
Only for what an op's schema makes flat: a break's or a user's call may hold containers registered
with pytree, which only ``torch.utils._pytree`` visits (``_break_calls.tensors``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["leaves", "map_leaves", "tensor_leaves", "tree_tensors"]


def leaves(tree: Any) -> list[Any]:
    """Every leaf of ``tree`` (anything but a tuple, list or dict), in pytree order."""
    out: list[Any] = []
    _collect(tree, out)
    return out


def _collect(tree: Any, out: list[Any]) -> None:
    if isinstance(tree, (tuple, list)):
        for x in tree:
            if isinstance(x, (tuple, list, dict)):
                _collect(x, out)
            else:
                out.append(x)
    elif isinstance(tree, dict):
        for x in tree.values():
            if isinstance(x, (tuple, list, dict)):
                _collect(x, out)
            else:
                out.append(x)
    else:
        out.append(tree)


_tensor: Any = None  # torch.Tensor, imported on first use (`import devgraph` imports no torch)


def tensor_leaves(tree: Any) -> list[Any]:
    """The tensors among ``tree``'s leaves, in pytree order."""
    global _tensor
    if _tensor is None:
        import torch

        _tensor = torch.Tensor
    tensor = _tensor
    return [x for x in leaves(tree) if isinstance(x, tensor)]


def tree_tensors(tree: Any) -> list[Any]:
    """The tensors among ``tree``'s leaves as ``torch.utils._pytree`` flattens it: containers registered
    with pytree (a model's output dataclasses, ``torch.return_types``) included, which
    ``tensor_leaves`` (tuples, lists and dicts only, faster) does not open."""
    import torch
    from torch.utils._pytree import tree_flatten

    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


def map_leaves(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``tree`` with every leaf replaced by ``fn(leaf)``: tuples (``torch.return_types`` too), lists
    and dicts rebuilt as their own type."""
    if isinstance(tree, list):
        return [map_leaves(fn, x) for x in tree]
    if isinstance(tree, tuple):
        mapped = [map_leaves(fn, x) for x in tree]
        if type(tree) is tuple:
            return tuple(mapped)
        return type(tree)(*mapped) if hasattr(tree, "_make") else type(tree)(mapped)  # namedtuple / structseq
    if isinstance(tree, dict):
        return {k: map_leaves(fn, v) for k, v in tree.items()}
    return fn(tree)
