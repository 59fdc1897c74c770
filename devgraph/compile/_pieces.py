"""Per-piece graphs: every piece of a split model gets its own captured graph per size.

``PiecewiseModule`` installs a ``PieceGraphs`` (one piece's graphs, one per size) in place of each
compiled piece of the split module and a plain eager call for each splitting op, then runs the
split module in one of three phases:

* ``eager``: the compiled pieces run as they are (warm-up, and sizes that were not captured);
* ``capture``: each piece is captured into its own graph for the current size; the splitting ops
  run eagerly between the captures (on the capture stream, outside any graph);
* ``replay``: each piece replays its graph; the splitting ops run eagerly in between.

Replay needs a piece's inputs at their capture-time addresses. Four kinds of input, and what
each replay does about them:

* the module's own inputs (the runner's static buffers, static arguments, weights): the same
  memory every call, held as they are. Their addresses are checked only in debug mode
  (``debug=True`` / ``DEVGRAPH_DEBUG=1``), as vLLM does: the buffers are the runner's own, a
  static argument's address is part of the call's template (checked every call), and weights
  are checked by the runner in debug mode, as in full mode;
* pool memory: outputs produced inside an earlier piece's capture, held by weak reference (as
  vLLM's piecewise backend does) so the pool can reuse them for the next size, and an eager
  splitting op's output that writes into such memory (devgraph's attention ops do). Checked at
  every replay, a cheap check (one or two per piece): an eager op may hand back other memory
  than at capture, and the piece would then read stale memory without a word;
* another piece's output passed as it is, in whatever memory (pool, a module input, or a view of
  that piece's staging buffer: an attention output transposed between two attention calls): that
  piece's graph hands back this very tensor at every replay, so it is read where it lies (held
  weakly where the pool owns it), checked only in debug mode. Staging it would copy it once, at
  capture, and the piece would read that copy ever after;
* anything else, i.e. what an eager splitting op made (a fresh tensor every call) or a view of it:
  the piece is captured reading a *staging* tensor instead, one buffer per (piece, argument) sized
  by the largest size and shared by every size, and each replay copies the call's value into it.
  Nothing else keeps that memory alive, so it is never held weakly.

The last piece's outputs are made weak inside its capture, so their memory is free for the next
capture.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_map

from devgraph._errors import DevgraphError
from devgraph.compile._compilers import CompiledPiece
from devgraph.compile._split import Piece, SplitGraph
from devgraph.compile._splitting_ops import host_values
from devgraph.graph import Device, Graph, GraphSet, SharedPool, tensor_leaves

__all__ = ["PieceGraphs", "PiecewiseModule"]

logger = logging.getLogger("devgraph.compile")


@attrs.define
class _State:
    """What the runner tells every piece about the current run (shared by the pieces)."""

    phase: str = "eager"
    size: int | None = None
    debug: bool = False  # replay checks every input's address, not only those that may move
    shared: SharedPool | None = None  # the pool and stream of the current capture
    host: Mapping[str, Sequence[Any]] | None = None  # op argument -> this call's host list
    # Storages of the current capture pass: the module's inputs (stable), and the outputs the pieces'
    # captures allocated (owned by the pool).
    stable_storages: set[int] = attrs.field(factory=set)
    pool_storages: set[int] = attrs.field(factory=set)
    # The tensors the pieces' captures returned, by id (held, so no id is reused in the pass): a
    # piece input that is one of them replays as that piece's output, at the same address.
    piece_outputs: dict[int, torch.Tensor] = attrs.field(factory=dict)


@attrs.define
class _Entry:
    """What a replay of one piece at one size checks (its graph is in the piece's ``GraphSet``)."""

    tensors: list[tuple[int, torch.Tensor, int]]  # (argument index, capture-time tensor, its address)
    scalars: list[tuple[int, Any]]
    # The subset of ``tensors`` checked at every replay (pool memory and staging); the rest only
    # in debug mode (see the module docstring).
    moving: list[tuple[int, torch.Tensor, int]]
    host_names: tuple[str, ...]


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _extent(shape: Sequence[int], stride: Sequence[int]) -> int:
    """Elements a tensor of this shape and stride spans from its first element."""
    if any(n == 0 for n in shape):
        return 0
    return 1 + sum((n - 1) * st for n, st in zip(shape, stride))


def _layout(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s strides when they are dense and non-overlapping (a layout one can copy into, as the
    piece was traced with), else contiguous strides (an expanded tensor, say)."""
    expected = 1
    dims = sorted((st, n) for n, st in zip(t.shape, t.stride()) if n != 1)
    for st, n in dims:
        if st != expected:
            break
        expected *= n
    else:
        return tuple(t.stride())
    contiguous, acc = [], 1
    for n in reversed(t.shape):
        contiguous.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(contiguous))


class PieceGraphs:
    """One piece's graphs, one per size: it runs the piece compiled eagerly, captures it per size, or
    replays the graph of the current size (see the module docstring)."""

    def __init__(
        self,
        piece: Piece,
        compiled: CompiledPiece,
        device: Device,
        state: _State,
        *,
        first: bool,
        last: bool,
        count: int,
    ) -> None:
        self.piece = piece
        self.compiled = compiled
        self.device = device
        self.state = state
        self.first = first
        self.last = last
        self.count = count
        self.entries: dict[int, _Entry] = {}
        # The graph and (weak) outputs per size; its shared pool is the runner's, set at capture.
        self.graphs: GraphSet[int, Graph] = GraphSet(device, weaken=lambda out: _weak(device, out))
        # Argument index -> staging buffer (flat) for inputs made outside the graphs, shared by sizes.
        self.staging: dict[int, torch.Tensor] = {}
        self.copies = 0  # inputs copied into capture-time tensors at replay (eager-produced inputs)

    def __call__(self, *args: Any) -> Any:
        state = self.state
        if state.phase != "replay":
            return self.compiled.fn(*args) if state.phase == "eager" else self._capture(args)
        # Replay, the hot path (once per piece per step): copy inputs that moved into the
        # capture-time tensors (staging), check host values, replay, return the graph's outputs.
        entry = self.entries.get(state.size)  # type: ignore[arg-type]
        if entry is None:
            return self._uncaptured(args)
        for i, kept, address in entry.tensors if state.debug else entry.moving:
            if args[i].data_ptr() != address:
                self._copy_in(i, args[i], kept)
        for i, value in entry.scalars:
            if args[i] != value:
                raise DevgraphError(
                    f"input {i} of {self.piece.name} is {args[i]!r}, captured as {value!r} for size {state.size}; "
                    "a captured piece cannot take other host values"
                )
        host = {n: state.host[n] for n in entry.host_names} if entry.host_names and state.host else None
        return self.graphs.replay(state.size, host)  # type: ignore[arg-type]

    def _staged(self, index: int, arg: torch.Tensor) -> torch.Tensor:
        """A tensor shaped like ``arg`` over this argument's staging buffer (grown if too small)."""
        stride = _layout(arg)
        need = max(1, _extent(arg.shape, stride))
        buf = self.staging.get(index)
        if buf is None or buf.dtype != arg.dtype or buf.device != arg.device or buf.numel() < need:
            # Sizes are captured largest first, so this happens once per argument; a smaller size
            # that needed more would get a new buffer, the old one kept alive by its own captures.
            buf = torch.empty(need, dtype=arg.dtype, device=arg.device)
            self.staging[index] = buf
        return buf.as_strided(arg.shape, stride)

    def _run(self, graph: Graph, args: Sequence[Any]) -> Any:
        if self.compiled.opaque:
            return graph.call_opaque(
                self.compiled.fn, *args, name=f"{self.piece.name} ({self.compiled.compiler})"
            )
        return self.compiled.fn(*args)

    def _capture(self, args: Sequence[Any]) -> Any:
        state = self.state
        assert state.size is not None
        if state.size in self.entries:
            raise DevgraphError(f"{self.piece.name} is already captured for size {state.size}; reset() first")
        if self.first:
            # One line per size, not one per piece (vLLM logs from its first piece only, too).
            logger.debug("devgraph: capturing %d pieces for size %d", self.count, state.size)
        if not self.piece.does_work:
            return self.compiled.fn(*args)  # views only: run as they are (their outputs alias their inputs)
        inputs = list(args)
        tensors, scalars, moving = [], [], []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                storage = _storage(a)
                stable = storage in state.stable_storages and storage not in state.pool_storages
                # Another piece's output, passed as it is: that piece's graph hands back this very
                # tensor at every replay (at its capture-time address), whatever memory it lies in:
                # the pool's, a module input's, or (a view of its input) that piece's staging buffer.
                direct = state.piece_outputs.get(id(a)) is a
                if storage in state.pool_storages:
                    keep = self.device.weak_ref(a)  # graph memory of an earlier piece: the pool owns it
                    moves = not direct  # an eager op's output in pool memory may come back elsewhere
                elif stable or direct:
                    # The runner's buffers, static arguments, weights; or an earlier piece's output
                    # outside the pool (a view of its staging buffer: DiffLlama's first attention
                    # output, transposed between its two attention calls). Read where it lies:
                    # staged, it would be copied once, at capture, and read stale ever after.
                    keep = a
                    moves = False
                else:
                    # Made outside the graphs (an eager splitting op): fresh memory every call that
                    # nothing else keeps. Capture on the staging tensor; every replay copies into it.
                    keep = self._staged(i, a)
                    keep.copy_(a)
                    inputs[i] = keep
                    moves = True
                tensors.append((i, keep, keep.data_ptr()))
                if moves:
                    moving.append(tensors[-1])
            elif not isinstance(a, (list, tuple)):
                scalars.append((i, a))

        def body(graph: Graph) -> Any:
            out = self._run(graph, inputs)
            if self.last:
                # Nothing after the last piece reads its outputs: let the pool have them back now.
                # (Outside the dispatch modes: building the weak tensors is not work to record.)
                with _disable_current_modes():
                    out = _weak(self.device, out)
            return out

        assert state.shared is not None
        self.graphs.shared = state.shared
        out = self.graphs.capture(state.size, body)
        graph = self.graphs.graph(state.size)
        host = tuple(
            name for name in (state.host or {}) if any(t.is_auto and t.takes(name) for t in graph.tasks)
        )
        self.entries[state.size] = _Entry(tensors, scalars, moving, host)
        # What the capture allocated belongs to the pool; an output that aliases an input does not
        # (unless that input is pool memory already).
        outside = {_storage(t) for t in tensor_leaves(inputs)} - state.pool_storages
        state.pool_storages.update(_storage(t) for t in tensor_leaves(out) if _storage(t) not in outside)
        state.piece_outputs.update((id(t), t) for t in tensor_leaves(out))
        return out

    def _uncaptured(self, args: Sequence[Any]) -> Any:
        """Replay phase, no graph of this size: a piece of views runs as it is; else an error."""
        if not self.piece.does_work:
            return self.compiled.fn(*args)
        raise DevgraphError(
            f"{self.piece.name} has no graph for size {self.state.size}; captured: {sorted(self.entries)}"
        )

    def _copy_in(self, i: int, arg: torch.Tensor, kept: torch.Tensor) -> None:
        """Input ``i`` is not at its capture-time address: copy it into the capture-time tensor."""
        if arg.shape != kept.shape or arg.dtype != kept.dtype:
            raise DevgraphError(
                f"input {i} of {self.piece.name} is {arg.dtype} {tuple(arg.shape)}, captured as "
                f"{kept.dtype} {tuple(kept.shape)} for size {self.state.size}"
            )
        kept.copy_(arg)
        self.copies += 1

    def reset(self) -> None:
        self.graphs.reset()
        self.entries.clear()
        self.staging.clear()


def _weak(device: Device, value: Any) -> Any:
    return tree_map(lambda t: device.weak_ref(t) if isinstance(t, torch.Tensor) else t, value)


class _SplitOpRunner:
    """Runs a splitting op's submodule eagerly, in every phase."""

    def __init__(self, piece: Piece) -> None:
        self.piece = piece
        self.calls = 0

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        return self.piece.graph_module(*args)


def _check_host_args(split: SplitGraph, device: Device) -> None:
    """A host list may only reach splitting ops (run eagerly) or ops the device updates at replay."""
    from devgraph.compile._splitting_ops import is_host_arg_node, op_names_of

    for piece in split.captured:
        for node in piece.graph_module.graph.nodes:
            if not is_host_arg_node(node):
                continue
            for user in node.users:
                names = op_names_of(user.target)
                if not any(n in device.updatable_ops for n in names):
                    op = names[0] if names else str(user.target)
                    raise DevgraphError(
                        f"host argument {node.args[0]!r} reaches {op} inside captured piece {piece.name}, and "
                        f"{device.name} does not update {op} at replay (updatable: {list(device.updatable_ops)}), "
                        f"so its values would freeze at capture. Add '{op}' to splitting_ops to run it eagerly"
                    )


class PiecewiseModule:
    """A split model whose pieces run compiled, captured per size, or replayed.

    Call it with the traced graph's inputs (tensors, in placeholder order). ``host`` maps op
    argument names to this call's host lists (see ``devgraph.compile._splitting_ops.host_arg``).
    """

    def __init__(self, split: SplitGraph, compiled: Mapping[str, CompiledPiece], device: Device) -> None:
        self.split = split
        self.device = device
        self.state = _State()
        captured = split.captured
        _check_host_args(split, device)
        self.piece_graphs: list[PieceGraphs] = []
        for piece in split.pieces:
            stand_in: PieceGraphs | _SplitOpRunner
            if piece.is_splitting_op:
                stand_in = _SplitOpRunner(piece)
            else:
                stand_in = PieceGraphs(
                    piece,
                    compiled[piece.name],
                    device,
                    self.state,
                    first=bool(captured) and piece is captured[0],
                    last=bool(captured) and piece is captured[-1],
                    count=len(captured),
                )
                self.piece_graphs.append(stand_in)
            # The split module calls self.<name>(...): an instance attribute wins over the submodule.
            split.module.__dict__[piece.name] = stand_in

    @property
    def captured_pieces(self) -> int:
        """How many pieces get a graph per size."""
        return len(self.split.captured)

    @property
    def input_copies(self) -> int:
        """Inputs copied into capture-time tensors at replay so far (eager splitting-op outputs)."""
        return sum(g.copies for g in self.piece_graphs)

    def graphs(self, size: int) -> list[Graph]:
        """The captured graphs of ``size``, one per captured piece, in order."""
        return [g.graphs.graph(size) for g in self.piece_graphs if size in g.graphs]

    def _run(
        self, inputs: Sequence[Any], phase: str, size: int | None, host: Mapping[str, Sequence[Any]] | None
    ) -> Any:
        state = self.state
        state.phase, state.size, state.host = phase, size, host
        try:
            with host_values(host):
                return self.split.module(*inputs)
        finally:
            state.phase, state.size, state.host = "eager", None, None
            state.pool_storages, state.stable_storages, state.piece_outputs = set(), set(), {}

    def __call__(self, *inputs: Any, host: Mapping[str, Sequence[Any]] | None = None) -> Any:
        return self._run(inputs, "eager", None, host)

    def capture(
        self,
        inputs: Sequence[Any],
        size: int,
        shared: SharedPool,
        host: Mapping[str, Sequence[Any]] | None,
    ) -> Any:
        """Capture every piece for ``size`` (inputs already padded to it) into ``shared``'s pool, on
        its stream (the device's capture stream when it names none)."""
        self.state.shared = shared
        self.state.stable_storages = {_storage(t) for t in tensor_leaves(list(inputs))}
        try:
            with shared.stream or self.device.capture_stream():
                return self._run(inputs, "capture", size, host)
        finally:
            self.state.shared = None

    def replay(
        self,
        inputs: Sequence[Any],
        size: int,
        host: Mapping[str, Sequence[Any]] | None,
        *,
        debug: bool = False,
    ) -> Any:
        """Replay the graphs of ``size``, running the splitting ops eagerly in between; ``debug``:
        check the address of every piece input, the module's own inputs included."""
        self.state.debug = debug
        try:
            return self._run(inputs, "replay", size, host)
        finally:
            self.state.debug = False

    def reset(self) -> None:
        """Drop every captured graph."""
        for graphs in self.piece_graphs:
            graphs.reset()
