"""The op recorder behind the CPU reference backend (and the torch_npu simulator's graphs).

Capture runs the work eagerly under a ``TorchDispatchMode`` that appends one entry per aten op.
An entry remembers the op, its host (non-tensor) arguments as they were, and for every tensor
argument either a weak reference to its memory (from outside the capture: weights, static inputs;
replay raises naming one that was freed) or a reference into a pool block (memory allocated during
the capture); see ``_held``. Fresh outputs are moved into
pool blocks so that replay re-runs every op on the very same memory: inputs are read from the
capture-time tensors, outputs land in the capture-time outputs.

Composite ops (``CompositeImplicitAutograd``: ``to``, ``reshape``, ``contiguous``, ``type_as``...)
are recorded as what they decompose into, whatever the grad mode: under ``no_grad`` and grad mode
the autograd layer decomposes them before they reach a dispatch mode, but under
``torch.inference_mode()`` they arrive whole, and whether ``reshape`` copies or ``to`` converts is
only known from what they do. Whether an op's result is a view is decided from what it returned:
an output sharing storage with an input is an alias (no entry when that is all the op did), any
other output is fresh memory and goes to the pool.

``empty``-style factories are not re-run (their contents are undefined anyway). Random ops are
re-run on their generator, drawing the stream's next numbers; a generator re-seeded inside the
capture is refused (``_rng``), and so are quantized and nested tensors, which a storage, dtype and
strides cannot describe.

``torch.distributed`` collectives are recorded as one entry each and re-issued on the capture-time
buffers at replay, then waited (``_collectives``). Only the capturing thread's ops are recorded.

A ``Tape`` is one graph's list of segments and the recorder filling them: capture, task groups,
the swap of a re-issued group, replay. The reference backend's ``CpuGraph`` and the torch_npu
simulator's ``NPUGraph`` both hold one, so they capture and replay the same way.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from devgraph._errors import CaptureError, DevgraphError
from devgraph._source import user_source_line
from devgraph.backends.cpu._collectives import (
    IDENTITY,
    NOT_RECORDED,
    POINT_TO_POINT,
    completion,
    issued_by_torch_distributed,
    refuse_async_with_work_in_wait,
)
from devgraph.backends.cpu._held import _External, _Ref, _Strong, describe, materialise
from devgraph.backends.cpu._pool import BlockPool, tensor_bytes
from devgraph.backends.cpu._rng import RngWatch, is_random
from devgraph.graph import (
    flat_leaves,
    has_python_kernel,
    is_collective,
    is_view,
    map_leaves,
    raise_refusal,
    refuse_collective,
    refuse_unrecorded,
    tensor_leaves,
    written_tensors,
)

__all__ = ["Entry", "Recorder", "Segment", "Tape", "finish_deferred", "refuse_collective_in_task"]

_UNINITIALISED = {
    "aten::empty",
    "aten::empty_strided",
    "aten::empty_like",
    "aten::new_empty",
    "aten::new_empty_strided",
}


class Entry:
    """One recorded call: ``func(*args, **kwargs)`` with fresh outputs copied into ``outs``."""

    __slots__ = ("args", "deferred", "finish", "func", "kwargs", "name", "outs", "rerun")

    def __init__(
        self, func: Callable[..., Any], name: str, args: Any, kwargs: Any, rerun: bool = True
    ) -> None:
        self.func = func
        self.name = name

        def held(x: Any) -> Any:
            return describe(x, name) if isinstance(x, torch.Tensor) else x

        self.args = map_leaves(held, args)
        self.kwargs = map_leaves(held, kwargs)
        self.outs: list[tuple[int, _Ref]] = []  # (leaf index in the flattened result, destination)
        self.rerun = rerun
        #: called with the result before the outputs are copied (waits for a collective to finish)
        self.finish: Callable[[Any], None] | None = None
        #: ``finish`` is left to the segment, which waits a run of point-to-point ops together
        self.deferred = False

    def run(self) -> Any:
        if not self.rerun:
            return None
        args = map_leaves(materialise, self.args)
        kwargs = map_leaves(materialise, self.kwargs)
        result = self.func(*args, **kwargs)
        if self.finish is not None and not self.deferred:
            self.finish(result)
        if self.outs:
            leaves = flat_leaves(result)
            for i, ref in self.outs:
                dst = ref.get()
                if leaves[i].shape != dst.shape:
                    # Never broadcast a result of another shape into the captured output (a silent
                    # wrong value): an op capture should have refused as data-dependent.
                    raise DevgraphError(
                        f"{self.name} returned shape {tuple(leaves[i].shape)} at replay, {tuple(dst.shape)} at "
                        "capture: its output shape depends on data, which a graph cannot replay; "
                        "please report this op to devgraph so capture refuses it"
                    )
                dst.copy_(leaves[i])
        return result

    def own(self, index: int) -> None:
        """Hold positional argument ``index`` strongly: a copy made for this task alone."""
        held = self.args[index]
        if isinstance(held, _External):
            self.args = (*self.args[:index], _Strong(held.get()), *self.args[index + 1 :])

    def externals(self) -> list[_External]:
        """The tensors from outside the capture this entry reads and writes."""
        return [x for x in flat_leaves((self.args, self.kwargs)) if isinstance(x, _External)]

    def __repr__(self) -> str:
        return f"<Entry {self.name}>"


class Segment:
    """A run of entries; an updatable task group is one segment of its own."""

    def __init__(self, group_index: int | None = None) -> None:
        self.group_index = group_index
        self.entries: list[Entry] = []
        self.fresh: list[_Ref] = []  # fresh outputs in order (targets when the group is re-issued)

    def run(self) -> None:
        # Consecutive point-to-point ops are all issued before any is waited, as a ring exchange
        # (isend to one peer, irecv from another) must be: a gloo send completes only once its peer
        # has posted the matching recv. They are waited before the next entry, which may read them.
        pending: list[tuple[Entry, Any]] = []
        for entry in self.entries:
            if entry.deferred:
                pending.append((entry, entry.run()))
                continue
            finish_deferred(pending)
            entry.run()
        finish_deferred(pending)


def finish_deferred(pending: list[tuple[Entry, Any]]) -> None:
    """Wait the point-to-point ops issued so far (``Entry.deferred``: ``(entry, its result)``), in order."""
    for entry, result in pending:
        assert entry.finish is not None
        entry.finish(result)
    pending.clear()


def _fresh_returns(func: Any) -> list[bool]:
    return [r.alias_info is None for r in func._schema.returns]


def _is_view(func: Any) -> bool:
    return is_view(func._schema)


_COMPOSITE: dict[Any, bool] = {}
_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


def _is_python_bodied(func: Any) -> bool:
    """True for a custom op whose CPU kernel is a Python function (see ``has_python_kernel``).

    Re-running such a body at replay would see today's Python state where a device graph replays
    what the body launched at capture, so the recorder records what it launches instead.
    """
    return has_python_kernel(func, "CPU")


def _is_composite(func: Any) -> bool:
    """True for an op with a ``CompositeImplicitAutograd`` kernel (one that calls other ops)."""
    known = _COMPOSITE.get(func)
    if known is None:
        known = _COMPOSITE[func] = torch._C._dispatch_has_kernel_for_dispatch_key(
            func.name(), torch._C.DispatchKey.CompositeImplicitAutograd
        )
    return known


def _storages(tree: Any) -> set[int]:
    """Data pointers of the storages of the (non-empty) tensors in ``tree``."""
    return {
        t.untyped_storage().data_ptr()
        for t in tensor_leaves(tree)
        if t.device.type != "meta" and t.untyped_storage().nbytes()
    }


def _refuse_unstrided(func: Any, tree: Any) -> None:
    """Refuse sparse and other non-strided tensors: the recorder places and rebuilds strided memory."""
    for t in tensor_leaves(tree):
        if t.layout != torch.strided:
            raise CaptureError(
                f"the CPU reference backend cannot record {t.layout} tensors (it replays strided memory)",
                op=func._schema.name,
                source=user_source_line(),
                remedy="keep sparse work outside the captured region (before capture or after replay)",
            )


def refuse_unrecordable_kinds(func: Any, tree: Any) -> None:
    """Refuse quantized and nested tensors: the recorder rebuilds a tensor from its storage, dtype and
    strides, which loses a quantized tensor's quantizer (replay would fail inside torch) and cannot
    describe a nested tensor's ragged parts."""
    for t in tensor_leaves(tree):
        kind = "quantized" if t.is_quantized else "nested" if t.is_nested else None
        if kind is not None:
            raise CaptureError(
                f"the CPU reference backend cannot record {kind} tensors (it rebuilds every tensor from "
                f"its storage, dtype and strides, which a {kind} tensor does not fully describe)",
                op=func._schema.name,
                source=user_source_line(),
                remedy=(
                    "dequantize weights before capture (keep float copies as the graph's inputs)"
                    if kind == "quantized"
                    else "pad nested tensors to a dense tensor before capture (to_padded_tensor) and pass that in"
                ),
            )


def _pairs(
    args: Any, kwargs: Any, scratch: dict[int, torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(real tensor, its scratch copy) for every tensor argument that has one."""
    leaves = tree_flatten((args, kwargs))[0]
    return [(t, scratch[id(t)]) for t in leaves if isinstance(t, torch.Tensor) and id(t) in scratch]


def _aliases(t: Any, inputs: set[int]) -> bool:
    return isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in inputs


def refuse_collective_in_task(name: str) -> None:
    """Refuse collective ``name`` inside an updatable task group.

    A task update re-issues its group on one rank alone: the other ranks would never join it.
    """
    raise CaptureError(
        "a collective inside an updatable task group: a task update re-issues the group on one rank, "
        "and the other ranks would never join the collective",
        op=name,
        source=user_source_line(),
        remedy="issue the collective outside the updatable op (before or after it)",
    )


class Recorder(TorchDispatchMode):
    """Records the aten ops issued while it is the active dispatch mode into ``segment``.

    Args:
        pool: where fresh outputs are placed.
        segment: the segment entries are appended to (assign it to switch segments).
        reissue: when re-issuing a task group, the group's original fresh outputs: the new call's
            fresh outputs are written into them instead of new pool blocks.
    """

    def __init__(self, pool: BlockPool, segment: Segment, reissue: list[_Ref] | None = None) -> None:
        super().__init__()
        self.pool = pool
        self.segment = segment
        self.reissue = reissue
        self._reissued = 0
        self._paused = 0
        self._opaque = 0  # inside record_call: the call is recorded whole
        # The thread that captures. torch hands the dispatch mode stack to threads that run work for
        # it (gloo runs a collective's copies on its worker thread): their ops belong to the
        # collective, which replay re-issues whole, not to the capture.
        self._thread = threading.get_ident()
        self._collectives = 0  # collectives recorded so far
        self.rng = RngWatch()  # refuses generators re-seeded inside the capture
        self.seen = 0  # ops this recorder saw (a composite that decomposes into none is invisible)

    #: higher-order ops reach the recorder only from compiled graphs, while it is paused
    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Let Dynamo run compiled code under the recorder (it skips compiled frames under any other
        # dispatch mode); devgraph.graph._compiled_regions has each compiled graph recorded whole.
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._paused or threading.get_ident() != self._thread:
            return func(*args, **kwargs)  # a compiled graph runs (recorded whole), or a worker thread
        self.seen += 1
        if is_collective(func._schema.name):
            return self._collective(func, args, kwargs)
        if self._collectives and issued_by_torch_distributed():
            return func(*args, **kwargs)  # torch.distributed's own work around a collective
        arg_tensors = tensor_leaves((args, kwargs))  # flattened once for the checks below
        refuse_unrecordable_kinds(func, arg_tensors)
        if _is_python_bodied(func):
            with self:  # what the body launches comes back here, op by op
                return func.redispatch(_CPU_KEYS, *args, **kwargs)
        if _is_composite(func):
            # Record what it launches (as grad mode would show it), never the composite whole: under
            # inference_mode ``to``/``reshape``/``contiguous`` arrive here and may copy or alias.
            seen = self.seen
            with self:
                result = func.decompose(*args, **kwargs)
            if result is not NotImplemented:
                if self.seen == seen:
                    refuse_unrecorded(func, args, kwargs)  # it computed without an op: nothing recorded
                return result
        # What the capture check refuses, checked again here: the check does not see the ops a
        # composite decomposes into (argwhere -> nonzero under inference_mode).
        raise_refusal(func, args, kwargs)
        _refuse_unstrided(func, arg_tensors)
        name = func._schema.name
        entry = Entry(func, name, args, kwargs, rerun=name not in _UNINITIALISED)
        inputs = _storages(arg_tensors)
        random = is_random(func)
        gen = self.rng.before(func, args, kwargs) if random else None
        result = self._run(func, args, kwargs)
        if random:
            self.rng.after(func, args, kwargs, gen)
        leaves = tensor_leaves(result)
        _refuse_unstrided(func, leaves)
        refuse_unrecordable_kinds(func, leaves)
        if _is_view(func) and all(_aliases(t, inputs) or not tensor_bytes(t) for t in leaves):
            return result  # metadata over memory that is already referenced: nothing to replay
        result = self._place_outputs(func, entry, result, inputs)
        self.segment.entries.append(entry)
        return result

    def _collective(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Record a ``torch.distributed`` op: re-issued on the same buffers at replay, then waited
        (see ``devgraph.backends.cpu._collectives``)."""
        name = func._schema.name
        if name in NOT_RECORDED:
            return func(*args, **kwargs)
        if name in IDENTITY:
            return args[0] if args else kwargs["input"]
        refuse_collective(func, args, kwargs, None, user_source_line)
        refuse_async_with_work_in_wait(func, args, kwargs)
        if self.reissue is not None or self.segment.group_index is not None:
            refuse_collective_in_task(name)
        entry = Entry(func, name, args, kwargs)
        entry.finish = completion(name)
        entry.deferred = name in POINT_TO_POINT
        inputs = _storages((args, kwargs))
        result = func(*args, **kwargs)
        # Complete it now, while this mode is off: what the wait runs (gloo copies a reduce-scatter's
        # result out of its scratch buffer in ``Work.wait``) belongs to the collective, and a
        # functional collective's output must be final before it is copied into the pool. Not a
        # send or recv: the caller waits its Work, and a gloo send or recv waited twice never returns
        # (nor could it be waited here before the peer's matching op is posted).
        if not entry.deferred:
            entry.finish(result)
        result = self._place_outputs(func, entry, result, inputs)
        self.segment.entries.append(entry)
        self._collectives += 1
        return result

    def record_call(self, fn: Callable[..., Any], args: tuple[Any, ...], name: str) -> Any:
        """Run ``fn(*args)`` (not recorded op by op) and record it as one opaque entry."""
        entry = Entry(fn, name, args, {})
        self._opaque += 1
        try:
            result = fn(*args)
        finally:
            self._opaque -= 1
        leaves, spec = tree_flatten(result)
        placed = [
            self._place(entry, i, leaf) if isinstance(leaf, torch.Tensor) else leaf
            for i, leaf in enumerate(leaves)
        ]
        self.segment.entries.append(entry)
        self.rng.resync()  # what ``fn`` drew (inductor's seeds) is replayed with it
        return tree_unflatten(placed, spec)

    @property
    def records_whole(self) -> bool:
        """True while what runs is recorded as one task (a compiled graph, an opaque call), whose replay
        runs every kernel in it whether the dispatcher saw it or not."""
        return self._paused > 0 or self._opaque > 0

    def pause_recording(self) -> None:
        """Stop recording ops until ``resume_recording`` (a compiled graph runs; it is recorded whole)."""
        self._paused += 1

    def resume_recording(self) -> None:
        self._paused -= 1
        self.rng.resync()  # what the paused (compiled) work drew is replayed with it

    def check_generators(self) -> None:
        """Refuse generators re-seeded inside the recording (see ``RngWatch``); call when it ends."""
        self.rng.finish()

    def record_compiled(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], result: Any, name: str
    ) -> None:
        """Record a call ``fn(*args, **kwargs) -> result`` that already ran as one entry: replay runs
        ``fn`` again on the same tensors and copies its results into ``result``'s tensors."""
        entry = Entry(fn, name, args, kwargs)
        leaves, _ = tree_flatten(result)
        # The outputs stay where the compiled code put them (held here); replay copies into them.
        outs = [(i, _Strong(t)) for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
        entry.outs = outs  # type: ignore[assignment]
        self.segment.entries.append(entry)

    def _run(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run ``func`` to record it; in a task re-issue, leave graph memory untouched.

        A device's task update rewrites the task's parameters and runs nothing until the next
        replay, so an update must not change what the graph's tensors hold, not even for a moment:
        another thread may be reading the last replay's outputs. What the op would write in place
        it writes into scratch copies (results that are those copies come back as the real
        tensors); its fresh outputs are not copied into the graph's (``_place``).
        """
        if self.reissue is None:
            return func(*args, **kwargs)
        scratch = {id(t): t.clone() for t in written_tensors(func, args, kwargs)}
        if not scratch:
            return func(*args, **kwargs)
        real = {c.untyped_storage().data_ptr(): t for t, c in _pairs(args, kwargs, scratch)}

        def swap_in(x: Any) -> Any:
            return scratch.get(id(x), x) if isinstance(x, torch.Tensor) else x

        def swap_back(x: Any) -> Any:
            if not isinstance(x, torch.Tensor) or not x.untyped_storage().nbytes():
                return x
            t = real.get(x.untyped_storage().data_ptr())
            return x if t is None else t.as_strided(x.shape, x.stride(), x.storage_offset())

        result = func(*tree_map(swap_in, args), **tree_map(swap_in, kwargs))
        return tree_map(swap_back, result)

    def _place_outputs(self, func: Any, entry: Entry, result: Any, inputs: set[int] | None = None) -> Any:
        """Move the fresh outputs into pool blocks: those the schema declares fresh, and those a view
        op returned without sharing an input's storage (a view op that copied)."""
        fresh = [f or _is_view(func) for f in _fresh_returns(func)]
        if not fresh or not any(fresh):
            return result
        single = len(fresh) == 1
        values = [result] if single else list(result)
        leaf_index = 0
        out = []
        for value, is_fresh in zip(values, fresh):
            leaves, spec = tree_flatten(value)
            placed = []
            for leaf in leaves:
                if is_fresh and isinstance(leaf, torch.Tensor) and not _aliases(leaf, inputs or set()):
                    leaf = self._place(entry, leaf_index, leaf)
                placed.append(leaf)
                leaf_index += 1
            out.append(tree_unflatten(placed, spec))
        return out[0] if single else type(result)(out) if isinstance(result, (tuple, list)) else tuple(out)

    def _place(self, entry: Entry, leaf_index: int, t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cpu":
            return t
        if self.reissue is not None:
            if self._reissued >= len(self.reissue):
                raise DevgraphError(
                    f"re-issued task produced more outputs than at capture ({entry.name}); "
                    "re-issue exactly the calls that were captured"
                )
            ref = self.reissue[self._reissued]
            self._reissued += 1
            if ref.size != tuple(t.shape) or ref.dtype != t.dtype:
                raise DevgraphError(
                    f"re-issued task output {entry.name} has shape {tuple(t.shape)} {t.dtype}, "
                    f"captured {ref.size} {ref.dtype}; tensor arguments must be the captured ones"
                )
        else:
            nbytes = tensor_bytes(t)
            if nbytes == 0:
                return t
            block = self.pool.allocate(nbytes)
            ref = _Ref(block, torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta"))
            ref.offset = 0
        dst = ref.get()
        if self.reissue is None:  # a re-issue writes nothing now: replay computes into dst
            dst.copy_(t)
        entry.outs.append((leaf_index, ref))
        self.segment.fresh.append(ref)
        return dst


class Tape:
    """One graph's segments in replay order, and the recorder filling them while it captures.

    ``segments`` is empty until ``begin`` and again after ``abandon``; a capture always has at least
    one segment. A task update records into a segment of its own (with its own recorder) and swaps
    it in with ``replace``.
    """

    def __init__(self) -> None:
        self.segments: list[Segment] = []
        self.recorder: Recorder | None = None

    def begin(
        self, pool: BlockPool, recorder_cls: Callable[[BlockPool, Segment], Recorder] = Recorder
    ) -> Recorder:
        """Start recording into a fresh first segment (placing fresh outputs in ``pool``)."""
        self.segments = [Segment()]
        self.recorder = recorder_cls(pool, self.segments[0])
        self.recorder.__enter__()
        return self.recorder

    def end(self) -> None:
        """Stop recording; the segments stay, ready to replay.

        Raises:
            CaptureError: a tensor the captured work reads from outside the graph's memory was
                already freed when the capture ended (a temporary made inside the block without
                going through an op, ``torch.from_numpy(...)`` say): a device graph would read
                freed memory at every replay. The segments are dropped.
        """
        recorder = self.recorder
        assert recorder is not None
        recorder.__exit__(None, None, None)
        self.recorder = None
        try:
            recorder.check_generators()
        except CaptureError:
            self.segments = []
            raise
        for segment in self.segments:
            for entry in segment.entries:
                if not isinstance(entry, Entry):
                    continue  # a step of the simulator's own (event wait, record)
                gone = [x for x in entry.externals() if not x.alive()]
                if gone:
                    self.segments = []
                    raise CaptureError(
                        f"{gone[0].describe()} was made inside the capture outside the graph's memory "
                        "and freed when the capture ended; a device graph would read freed memory",
                        op=entry.name,
                        source=gone[0].source,
                        remedy="create the tensor before capture and keep it alive while the graph is "
                        "replayed (copy new values into it), or make it with torch ops inside the block",
                    )

    def abandon(self) -> None:
        """Stop recording if it still is, and forget the segments."""
        if self.recorder is not None:
            self.recorder.__exit__(None, None, None)
            self.recorder = None
        self.segments = []

    def open_group(self, group_index: int) -> Segment:
        """Record what follows into a new segment of its own: task group ``group_index``."""
        assert self.recorder is not None
        segment = Segment(group_index)
        self.segments.append(segment)
        self.recorder.segment = segment
        return segment

    def close_group(self) -> None:
        """Record what follows into a new (ungrouped) segment after the group."""
        assert self.recorder is not None
        tail = Segment()
        self.segments.append(tail)
        self.recorder.segment = tail

    def replace(self, old: Segment, new: Segment) -> None:
        """Put ``new`` (a re-issue of group ``old``, written into its outputs) in ``old``'s place."""
        new.fresh = old.fresh
        self.segments[self.segments.index(old)] = new

    def replay(self) -> None:
        """Re-run every segment, in order."""
        with torch.inference_mode():
            for segment in self.segments:
                segment.run()

    @property
    def ops(self) -> list[str]:
        """Names of the recorded entries, in replay order."""
        return [e.name for s in self.segments for e in s.entries]
