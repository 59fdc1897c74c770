"""The op probe: a dispatch mode that keeps a copy of every op's output, in order.

Entered *inside* a graph capture it is the innermost mode, so the copies it makes are ordinary ops
of the captured work: the capture records them (on the CPU reference its op recorder, on CUDA and
NPU the capture stream), they land in the graph's pool, and every replay refills them with the
replayed values. That is what makes the probe backend-neutral: it asks nothing of a backend but the
graph contract. Entered around an eager run it keeps the eager values, and it fills the memory of
ops that return it uninitialised (``empty``) with a marked NaN (``_poison``), so a later read of
memory no op wrote shows as a difference instead of passing by chance.

Compiled code (``torch.compile``) runs compiled under the probe, as it runs in the graph: a compiled
graph is recorded whole, as one ``COMPILED`` record holding its outputs (its fused kernels have no
op to copy; ``devgraph.debug._compiled`` descends into it). An eager run runs it as its original code
(``truly_eager``), op by op.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from typing import Any

import attrs
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from devgraph._source import is_user_path, meta_source, render, skip_dirs
from devgraph.debug._poison import fill_poison
from devgraph.frontend import node_meta_at
from devgraph.graph import CompiledRegions, is_view, tree_tensors, written_tensors

__all__ = ["COMPILED", "OpRecord", "OpProbe", "module_names"]

#: the op name of a compiled graph's record (recorded whole: see the module docstring)
COMPILED = "torch.compile'd graph"

#: ops whose output memory is uninitialised: nothing to compare, and eager fills them (``poison``)
UNINITIALISED = frozenset(
    {
        "aten::empty",
        "aten::empty_strided",
        "aten::empty_like",
        "aten::new_empty",
        "aten::new_empty_strided",
        "aten::empty_permuted",
    }
)


@attrs.define(eq=False)
class OpRecord:
    """One op of a run: its name, where the user's code called it, and copies of its outputs."""

    index: int
    op: str
    source: str | None
    module: str | None
    outputs: list[torch.Tensor]


def module_names(target: Any) -> dict[int, str]:
    """``id(submodule) -> qualified name`` of every submodule of ``target`` (empty for a plain callable)."""
    named = getattr(target, "named_modules", None)
    if named is None:
        return {}
    return {id(m): (name or type(m).__name__) for name, m in named()}


def meta_module(meta: Mapping[str, Any]) -> str | None:
    """The module path of an FX node's ``nn_module_stack``, under the traced root."""
    stack = meta.get("nn_module_stack") or {}
    if not stack:
        return None
    path, cls = list(stack.values())[-1]
    # Dynamo names modules by how it reached them (L['self'].layers[0], G['model']._orig_mod.x):
    # keep the attribute path under the traced root.
    path = re.sub(r"^[LG]\['[^']*'\]", "", str(path))
    path = path.replace("._orig_mod", "").lstrip(".")
    return re.sub(r"\[(\d+)\]", r".\1", path).lstrip(".") or getattr(cls, "__name__", None)


def _fx_node_meta() -> Mapping[str, Any] | None:
    """The meta of the FX node an interpreter is running (Dynamo's graphs run node by node in a
    bisect, so each op is named at the user's line the node came from), or None."""
    from torch.fx import traceback as fx_traceback

    if not fx_traceback.has_preserved_node_meta():
        return None
    meta = fx_traceback.get_current_meta()
    return meta if meta and meta.get("stack_trace") else None


def _where(modules: Mapping[int, str], skip: tuple[str, str]) -> tuple[str | None, str | None]:
    """The user's source line and the innermost ``nn.Module`` of ``modules`` on the current stack
    (of the FX node being interpreted, for a graph Dynamo traced)."""
    meta = _fx_node_meta()
    if meta is not None:
        return meta_source(meta), meta_module(meta)
    source = module = None
    frame = sys._getframe(2)
    while frame is not None and (source is None or (modules and module is None)):
        if source is None:
            name = frame.f_code.co_filename
            if name.startswith("<eval_with_key>"):  # a Dynamo graph's code run (pieces): its node's line
                outer = node_meta_at(name, frame.f_lineno)
                source = meta_source(outer) if outer is not None else None
            elif is_user_path(os.path.abspath(name), skip):
                source = render(os.path.abspath(name), frame.f_lineno)
        if modules and module is None:
            owner = frame.f_locals.get("self") if "self" in frame.f_code.co_varnames else None
            if owner is not None:
                module = modules.get(id(owner))
        frame = frame.f_back  # type: ignore[assignment]
    return source, module


class OpProbe(TorchDispatchMode):
    """Keep a copy of every op's tensor outputs in ``records`` (see the module docstring).

    Args:
        modules: ``id(submodule) -> name`` (``module_names``) for the records' module path.
        poison: the run number (``_poison.new_run``) whose marked NaN fills uninitialised outputs;
            0 leaves them (eager runs poison; never inside a capture, where the fill would be
            captured and hide what a replay leaves in that memory).
        records: the list to append to (default: a new one).
    """

    def __init__(
        self,
        modules: Mapping[int, str] | None = None,
        *,
        poison: int = 0,
        records: list[OpRecord] | None = None,
    ) -> None:
        super().__init__()
        #: shared by the probes of one run's several captures (the pieces of a piecewise graph)
        self.records: list[OpRecord] = [] if records is None else records
        self.modules = dict(modules or {})
        self.poison = poison
        self._skip = skip_dirs()
        self._paused = 0  # inside a compiled graph (recorded whole), or copying its outputs
        self._regions: CompiledRegions | None = None

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Dynamo skips compiled code under any other dispatch mode: the probe would see the eager ops
        # of code the graph runs compiled, and compare eager with eager.
        return True

    def __enter__(self) -> OpProbe:
        super().__enter__()
        self._regions = CompiledRegions([self])
        self._regions.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        regions, self._regions = self._regions, None
        try:
            if regions is not None:
                regions.__exit__(*exc)
        finally:
            super().__exit__(*exc)

    # -- a compiled graph is recorded whole (CompiledRegions calls these) ----------------------

    def pause_recording(self) -> None:
        self._paused += 1

    def resume_recording(self) -> None:
        self._paused -= 1

    def record_compiled(self, fn: Any, args: Any, kwargs: Any, result: Any, name: str) -> None:
        leaves = tree_tensors(result)
        self._paused += 1  # the copies are captured work, not ops of the run
        try:
            copies = [t.detach().clone() for t in leaves]
        finally:
            self._paused -= 1
        source = name.partition(" called at ")[2] or None
        self.records.append(OpRecord(len(self.records), COMPILED, source, None, copies))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self._paused:
            return out
        if not isinstance(func, torch._ops.OpOverload) or is_view(func._schema):
            return out  # a view computes nothing: its base's op was compared
        name = func._schema.name
        leaves = [t for t in tree_tensors(out) if t.device.type != "meta"]
        if not leaves:  # an op that writes its arguments and returns nothing (a kernel given ``out``)
            leaves = written_tensors(func, args, kwargs or {})
        if not leaves:
            return out
        if name in UNINITIALISED:
            if self.poison:
                for t in leaves:
                    fill_poison(t, self.poison)
            return out
        source, module = _where(self.modules, self._skip)
        copies = [t.detach().clone() for t in leaves]
        self.records.append(OpRecord(len(self.records), name, source, module, copies))
        return out
