"""Per-piece graphs: every piece of a split model gets its own captured graph per size.

``PiecewiseModule`` installs a ``PieceRunner`` in place of each compiled piece of the split module
and a plain eager call for each splitting op, then runs the split module in one of three phases:

* ``eager``: the compiled pieces run as they are (warm-up, and sizes that were not captured);
* ``capture``: each piece is captured into its own graph for the current size; the splitting ops
  run eagerly between the captures (on the capture stream, outside any graph);
* ``replay``: each piece replays its graph; the splitting ops run eagerly in between.

Replay needs a piece's inputs at their capture-time addresses. The first piece reads the runner's
static buffers, later pieces read earlier pieces' outputs (graph memory, stable by construction),
so those match; an input produced by an eager splitting op (a fresh tensor every call) is copied
into the tensor the graph was captured with. Outputs are kept by weak reference (the pool owns
the memory, as in vLLM's piecewise backend): the last piece's outputs already inside its capture,
so its memory is free for the next capture.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_map

from devgraph._contract import Device, Graph, MemoryPool, Stream
from devgraph._errors import DevgraphError
from devgraph.compile._backends import CompiledPiece
from devgraph.compile._ops import host_values
from devgraph.compile._split import Piece, SplitGraph

__all__ = ["PieceRunner", "PiecewiseModule"]

logger = logging.getLogger("devgraph.compile")


@attrs.define
class _State:
    """What the runner tells every piece about the current run (shared by the pieces)."""

    phase: str = "eager"
    size: int | None = None
    pool: MemoryPool | None = None
    stream: Stream | None = None
    host: Mapping[str, Any] | None = None
    pool_storages: set[int] = attrs.field(factory=set)  # piece outputs of the current capture pass


@attrs.define
class _Entry:
    """One piece captured for one size."""

    graph: Graph
    tensors: list[tuple[int, torch.Tensor, int]]  # (argument index, capture-time tensor, its address)
    scalars: list[tuple[int, Any]]
    output: Any
    host_names: tuple[str, ...]


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


class PieceRunner:
    """Runs one piece: compiled eagerly, captured per size, or replayed (see the module docstring)."""

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
        self.copies = 0  # inputs copied into capture-time tensors at replay (eager-produced inputs)

    def __call__(self, *args: Any) -> Any:
        state = self.state
        if state.phase == "eager" or not self.piece.does_work:
            out = self.compiled.fn(*args)
        elif state.phase == "capture":
            out = self._capture(args)
        else:
            out = self._replay(args)
        if state.phase == "capture":
            state.pool_storages.update(_storage(t) for t in _tensors(out))
        return out

    def _run(self, graph: Graph, args: Sequence[Any]) -> Any:
        if self.compiled.opaque:
            return graph.call_opaque(
                self.compiled.fn, *args, name=f"{self.piece.name} ({self.compiled.backend})"
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
        tensors, scalars = [], []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                # Graph memory of an earlier piece is kept weakly (the pool owns it); anything else
                # (static buffers, weights, outputs of eager splitting ops) strongly, to copy into.
                keep = self.device.weak_ref(a) if _storage(a) in state.pool_storages else a
                tensors.append((i, keep, a.data_ptr()))
            elif not isinstance(a, (list, tuple)):
                scalars.append((i, a))
        graph = self.device.graph()
        with graph.capture(stream=state.stream, pool=state.pool, auto_update_ops=self.device.updatable_ops):
            out = self._run(graph, args)
            if self.last:
                # Nothing after the last piece reads its outputs: let the pool have them back now.
                # (Outside the dispatch modes: building the weak tensors is not work to record.)
                with _disable_current_modes():
                    out = _weak(self.device, out)
        host = tuple(
            name for name in (state.host or {}) if any(t.is_auto and t.takes(name) for t in graph.tasks)
        )
        self.entries[state.size] = _Entry(graph, tensors, scalars, _weak(self.device, out), host)
        return out

    def _replay(self, args: Sequence[Any]) -> Any:
        state = self.state
        entry = self.entries.get(state.size)  # type: ignore[arg-type]
        if entry is None:
            raise DevgraphError(
                f"{self.piece.name} has no graph for size {state.size}; captured: {sorted(self.entries)}"
            )
        for i, kept, address in entry.tensors:
            arg = args[i]
            if arg.data_ptr() != address:
                if arg.shape != kept.shape or arg.dtype != kept.dtype:
                    raise DevgraphError(
                        f"input {i} of {self.piece.name} is {arg.dtype} {tuple(arg.shape)}, captured as "
                        f"{kept.dtype} {tuple(kept.shape)} for size {state.size}"
                    )
                kept.copy_(arg)
                self.copies += 1
        for i, value in entry.scalars:
            if args[i] != value:
                raise DevgraphError(
                    f"input {i} of {self.piece.name} is {args[i]!r}, captured as {value!r} for size {state.size}; "
                    "a captured piece cannot take other host values"
                )
        host = {n: state.host[n] for n in entry.host_names} if entry.host_names and state.host else None
        entry.graph.replay(host)
        return entry.output

    def reset(self) -> None:
        for entry in self.entries.values():
            entry.graph.reset()
        self.entries.clear()


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
    from devgraph.compile._ops import is_host_arg_node, op_names_of

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
    argument names to this call's host lists (see ``devgraph.compile._ops.host_arg``).
    """

    def __init__(self, split: SplitGraph, compiled: Mapping[str, CompiledPiece], device: Device) -> None:
        self.split = split
        self.device = device
        self.state = _State()
        captured = split.captured
        _check_host_args(split, device)
        self.runners: list[PieceRunner] = []
        for piece in split.pieces:
            if piece.is_splitting_op:
                runner: Any = _SplitOpRunner(piece)
            else:
                runner = PieceRunner(
                    piece,
                    compiled[piece.name],
                    device,
                    self.state,
                    first=bool(captured) and piece is captured[0],
                    last=bool(captured) and piece is captured[-1],
                    count=len(captured),
                )
                self.runners.append(runner)
            # The split module calls self.<name>(...): an instance attribute wins over the submodule.
            split.module.__dict__[piece.name] = runner

    @property
    def captured_pieces(self) -> int:
        """How many pieces get a graph per size."""
        return len(self.split.captured)

    @property
    def input_copies(self) -> int:
        """Inputs copied into capture-time tensors at replay so far (eager splitting-op outputs)."""
        return sum(r.copies for r in self.runners)

    def graphs(self, size: int) -> list[Graph]:
        """The captured graphs of ``size``, one per captured piece, in order."""
        return [r.entries[size].graph for r in self.runners if size in r.entries]

    def _run(
        self, inputs: Sequence[Any], phase: str, size: int | None, host: Mapping[str, Any] | None
    ) -> Any:
        state = self.state
        state.phase, state.size, state.host = phase, size, host
        try:
            with host_values(host):
                return self.split.module(*inputs)
        finally:
            state.phase, state.size, state.host = "eager", None, None
            state.pool_storages = set()

    def __call__(self, *inputs: Any, host: Mapping[str, Any] | None = None) -> Any:
        return self._run(inputs, "eager", None, host)

    def capture(
        self,
        inputs: Sequence[Any],
        size: int,
        pool: MemoryPool,
        stream: Stream,
        host: Mapping[str, Any] | None,
    ) -> Any:
        """Capture every piece for ``size`` (inputs already padded to it) into ``pool`` on ``stream``."""
        self.state.pool, self.state.stream = pool, stream
        try:
            with stream:
                return self._run(inputs, "capture", size, host)
        finally:
            self.state.pool, self.state.stream = None, None

    def replay(self, inputs: Sequence[Any], size: int, host: Mapping[str, Any] | None) -> Any:
        """Replay the graphs of ``size``, running the splitting ops eagerly in between."""
        return self._run(inputs, "replay", size, host)

    def reset(self) -> None:
        """Drop every captured graph."""
        for runner in self.runners:
            runner.reset()
