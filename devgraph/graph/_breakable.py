"""Breakable capture: one capture over a whole callable, cut into segment graphs at break ops.

SGLang's prefill default, vLLM's ``VLLM_USE_BREAKABLE_CUDAGRAPH`` and vllm-ascend's
``BreakableACLGraphWrapper`` work this way; here it is built on the graph contract alone, so every
backend (cuda, npu, the accelerator backend, the CPU reference) gets it with no code of its own.

Capture. ``with bg.capture(): out = model(...)`` opens a ``Graph`` capture (segment 0). When the
code calls a break op (``devgraph.graph.break_ops``: devgraph's attention ops, ops marked with
``mark_break``, ops plugins contribute), the current segment's capture ends, the op runs eagerly
on the capture stream outside any graph, and capture resumes in a new ``Graph`` on the same stream
and ``MemoryPool``. Nothing is traced or compiled.

Replay. ``bg.replay(host_args=...)`` replays the segment graphs in order and re-runs each break
eagerly in between, on the tensors it read at capture (static memory: outputs of earlier segments,
or static inputs), with the call's new host arguments (by argument name, as ``Graph.replay``). A
break that writes its result into a tensor it was given (devgraph's attention ops: ``out``) needs
nothing more; a break that returns fresh tensors had buffers allocated for them in the pool at
capture, before its segment ended (their shapes from the op's fake impl), was handed those buffers
instead of its own result, and at replay its result is copied into them. Tensors the pool owns are
held weakly (``Device.weak_ref``), as vllm-ascend holds its attention parameters: they stay pool
memory that later captures may reuse, which is sound because a replay runs in capture order. Tensors
from outside the graphs (weights, the KV cache, static inputs) are held as they are. A break whose
result shape has no fake impl keeps the eager result of capture time (outside the pool) and copies
into that.

How a break is intercepted, and why there. Each segment's ``Graph.capture`` pushes modes: the
host-sync check (a ``TorchFunctionMode``), devgraph's capture dispatch mode and, on the CPU
reference and the NPU simulator, the backend's op recorder (``TorchDispatchMode``\\s). Cutting a
capture means popping those modes and pushing the next segment's, which is only sound from a place
where they sit on top of their stacks in order. A dispatch mode is the wrong place: the host-sync
check is held aside while the call it let through is being dispatched, so popping it there pops
something else. ``BreakMode`` is a ``TorchFunctionMode`` entered *above* the first segment's modes
(torch function modes see ``torch.ops`` calls, custom ops included, and torch functions such as
``F.scaled_dot_product_attention``, before any dispatch). While it handles a call torch holds it
aside and puts it back on top afterwards, so it can close segment ``k`` (its modes are then the top
of both stacks), run the break, open segment ``k+1``, and return; torch re-pushes it above the new
segment's modes. It checks both stack depths first, and refuses a break it finds below another
mode's handler. It sees top-level Python calls only: a break called from C++, from inside another
torch function or op (a Python-bodied custom op's body) or from compiled code reaches the segment's
capture instead, where the capture check's ``op_check`` hook (``_capture.op_check``, which sees
every op the capture dispatch mode sees, bodies included) refuses it by name rather than capture it.

Equal or refused. The same check refuses, by op and source line, an op that is not a break but
whose result depends on what a graph cannot see, with the remedy "mark it as a break": a custom
op (outside torch's own namespaces) given a non-empty host list (``int[]``, ``float[]``...: per-call
lengths, torchtitan #3685's varlen attention) unless it is captured as an updatable task
(``auto_update_ops``) or declared ``static_ops``; a custom op given a CPU tensor on a device that
is not the CPU (the host memory is read at launch, once); and, in ``BreakMode``, any torch call
given one of the capture's declared per-call host values (``host_args=`` at capture).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any

from devgraph._errors import CaptureError, DevgraphError
from devgraph._source import user_source_line
from devgraph.graph import _host_compute as host_compute
from devgraph.graph._break_calls import (
    CapturedBreak,
    aliases,
    captured_break,
    completed,
    fake_result,
    storage,
    tensors,
)
from devgraph.graph._breaks import break_ops, call_name
from devgraph.graph._capture import op_check
from devgraph.graph._compiled_regions import _describe, _wrapper_code
from devgraph.graph._opnames import resolve_auto_update_ops
from devgraph.graph._segment_check import MARK_REMEDY, refusal

if TYPE_CHECKING:
    from devgraph.graph._contract import Device, Graph, MemoryPool, Stream

__all__ = ["BreakableGraph", "CapturedBreak"]

logger = logging.getLogger("devgraph")


#: torch's own namespaces: their list arguments are shapes, dims, split sizes, not per-call data.
class _Run:
    """The state of one breakable capture in progress (segments opened and closed by the modes)."""

    def __init__(
        self,
        owner: BreakableGraph,
        stream: Stream,
        pool: MemoryPool,
        auto_update_ops: Sequence[str],
        capture_error_mode: str,
        host_values: Mapping[str, Any],
    ) -> None:
        self.owner = owner
        self.stream = stream
        self.pool = pool
        self.auto_update_ops = resolve_auto_update_ops(auto_update_ops, owner.device.updatable_ops)
        self.capture_error_mode = capture_error_mode
        self.host_ids = {id(v): k for k, v in host_values.items() if isinstance(v, (list, tuple))}
        self.graphs: list[Graph] = []
        self.breaks: list[CapturedBreak] = []
        self.current: contextlib.ExitStack | None = None
        self.fn_depth = 0
        self.dispatch_depth = 0
        self.failed: BaseException | None = None
        # Storages seen in the segments: made by a captured op (the pool owns them) or read from outside.
        self.made: set[int] = set()
        self.outside: set[int] = set()
        self.thread = threading.get_ident()
        # A Dynamo-compiled graph already running when the capture began (Dynamo in front: the
        # capture runs inside the graph's own callable, which is what is captured): not a region
        # inside the capture.
        self.outer_compiled = _compiled_graph_frame()

    def open_segment(self) -> None:
        import torch

        graph = self.owner.device.graph()
        stack = contextlib.ExitStack()
        stack.enter_context(
            graph.capture(
                stream=self.stream,
                pool=self.pool,
                auto_update_ops=self.auto_update_ops,
                capture_error_mode=self.capture_error_mode,
            )
        )
        self.graphs.append(graph)
        self.current = stack
        self.fn_depth = torch._C._len_torch_function_stack()
        self.dispatch_depth = torch._C._len_torch_dispatch_stack()

    def check(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The ``op_check`` of the segments' captures: refuse a break that reached a segment, or an op
        whose result depends on what the graph cannot see (see the module docstring)."""
        if threading.get_ident() != self.thread:
            return
        name = func._schema.name
        if name in self.owner.breaks:
            raise CaptureError(
                "a break op reached a segment graph's capture: it was called where a breakable capture "
                "cannot cut (from C++, from inside another torch function or op, or from compiled code), "
                "and would be captured with frozen arguments",
                op=name,
                source=user_source_line(),
                remedy="call it from Python code (torch.ops.ns.op(...)) outside torch.compile'd regions, "
                "or mark the op that calls it as the break",
            )
        why = refusal(
            func,
            args,
            kwargs,
            allowed={*self.auto_update_ops, *self.owner.static_ops},
            device_type=self.owner.device.torch_device.type,
        )
        if why is not None:
            raise CaptureError(why, op=name, source=user_source_line(), remedy=MARK_REMEDY.format(op=name))

    def close_segment(self, exc: tuple[Any, Any, Any] = (None, None, None)) -> None:
        stack, self.current = self.current, None
        if stack is not None:
            if exc[0] is None:
                stack.close()
            else:
                stack.__exit__(*exc)

    def abandon(self) -> None:
        for graph in self.graphs:
            if graph.is_captured():
                graph.reset()
        self.graphs, self.breaks = [], []

    # -- bookkeeping of where tensors live (capture only) ------------------------------------------

    def see(self, args: Any, result: Any) -> None:
        for t in tensors(args):
            ptr = storage(t)
            if ptr and ptr not in self.made:
                self.outside.add(ptr)
        for t in tensors(result):
            ptr = storage(t)
            if ptr and ptr not in self.outside:
                self.made.add(ptr)

    def pool_owns(self, t: Any) -> bool:
        """Whether the graphs' pool holds ``t``'s memory: made in this capture on the graphs' device (a
        CPU tensor made inside a device capture is ordinary host memory, which only a reference keeps)."""
        return t.device.type == self.owner.device.torch_device.type and storage(t) in self.made

    def keep(self, value: Any) -> Any:
        """How a break holds a tensor argument: weakly where the pool owns it, else as it is."""
        import torch

        if isinstance(value, torch.Tensor):
            return self.owner.device.weak_ref(value) if self.pool_owns(value) else value
        if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
            return type(value)(self.keep(v) for v in value)
        return value

    # -- a break ---------------------------------------------------------------------------------

    def run_break(self, func: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        import torch
        from torch.utils._pytree import tree_flatten, tree_unflatten

        source = user_source_line()
        if (
            torch._C._len_torch_function_stack() != self.fn_depth
            or torch._C._len_torch_dispatch_stack() != self.dispatch_depth
        ):
            raise CaptureError(
                "a break op called from inside another op (a Python-bodied custom op's body, or a "
                "mode's handler): the capture cannot be cut there",
                op=name,
                source=source,
                remedy="mark the op that calls it as the break instead (devgraph.mark_break('ns::outer_op'))",
            )
        compiled = _compiled_graph_frame(stop=self.outer_compiled)
        if compiled is not None:
            raise CaptureError(
                "a break op called from a torch.compile'd graph: compiled code runs (and is captured) as "
                "one unit, so the capture cannot be cut inside it",
                op=name,
                source=_describe(compiled),
                remedy="compile the code between the breaks, not the code that calls them (e.g. "
                "torch.compile each layer's MLP and projections, leave attention outside), or use "
                "mode='piecewise', which compiles the pieces between splitting ops",
            )
        fake = fake_result(func, args, kwargs)
        buffers: list[tuple[int, Any]] = []
        with torch._C.DisableTorchFunction():
            inputs = {storage(t) for t in tensors((args, kwargs))}
            # Buffers for its results, allocated in this segment (pool memory), shaped by the fake impl.
            for i, leaf in enumerate(tree_flatten(fake)[0] if fake is not None else ()):
                if isinstance(leaf, torch.Tensor):
                    shape, stride = leaf.shape, leaf.stride()
                    buffers.append(
                        (i, torch.empty_strided(shape, stride, dtype=leaf.dtype, device=leaf.device))
                    )
        self.made.update(storage(b) for _, b in buffers)
        self.close_segment()
        result = completed(name, func(*args, **kwargs))
        leaves, spec = tree_flatten(result)
        outs: list[tuple[int, Any]] = []
        for i, buffer in buffers:
            if not aliases(leaves[i], inputs):  # a view of an input stays one (the re-run makes it again)
                buffer.copy_(leaves[i])
                leaves[i] = buffer
                outs.append((i, self.owner.device.weak_ref(buffer) if self.pool_owns(buffer) else buffer))
        if fake is None:
            # No fake impl: its fresh results of capture time are the buffers, held here.
            for i, leaf in enumerate(leaves):
                if isinstance(leaf, torch.Tensor) and not aliases(leaf, inputs):
                    outs.append((i, leaf))
                    self.outside.add(storage(leaf))
        self.breaks.append(
            captured_break(len(self.graphs) - 1, name, source, func, args, kwargs, outs, self.keep)
        )
        self.open_segment()
        return tree_unflatten(leaves, spec)


def _torch() -> Any:
    """torch, imported once it is needed (``import devgraph`` imports no torch)."""
    import torch

    return torch


def _compiled_graph_frame(stop: FrameType | None = None) -> FrameType | None:
    """The frame of the Dynamo-compiled graph running on this thread (its ``disable`` wrapper), or
    None; frames from ``stop`` outwards are not looked at."""
    wrapper = _wrapper_code()
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame is not stop:
        if frame.f_code is wrapper:
            return frame
        frame = frame.f_back
    return None


def _modes() -> type:
    """Build the mode class lazily so that importing devgraph does not import torch."""
    import torch
    from torch.overrides import TorchFunctionMode

    class BreakMode(TorchFunctionMode):
        """Above every segment's modes: runs break ops eagerly between segments (module docstring)."""

        def __init__(self, run: _Run) -> None:
            super().__init__()
            self.run = run

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            run = self.run
            if torch.compiler.is_compiling() or threading.get_ident() != run.thread or run.current is None:
                return func(*args, **kwargs)
            name = call_name(func)
            if name is not None and name in run.owner.breaks:
                try:
                    return run.run_break(func, name, args, kwargs)
                except BaseException as exc:
                    run.failed = run.failed or exc
                    raise
            if run.host_ids:
                for value in (*args, *kwargs.values()):
                    host = run.host_ids.get(id(value))
                    if host is not None:
                        op = name or getattr(func, "__name__", repr(func))
                        raise CaptureError(
                            f"the per-call host value {host!r} is read by {op} inside a segment graph, "
                            "which would freeze it at capture",
                            op=op,
                            source=user_source_line(),
                            remedy=MARK_REMEDY.format(op=op),
                        )
            result = func(*args, **kwargs)
            with torch._C.DisableTorchFunction():
                run.see((args, kwargs), result)
            return result

    return BreakMode


_BREAK_MODE: type | None = None


def _break_mode() -> type:
    global _BREAK_MODE
    if _BREAK_MODE is None:
        _BREAK_MODE = _modes()
    return _BREAK_MODE


@contextlib.contextmanager
def _checking(run: _Run) -> Iterator[None]:
    token = op_check.set(run.check)
    try:
        yield
    finally:
        op_check.reset(token)


class BreakableGraph:
    """Segment graphs of one capture, cut at break ops that replay eagerly in between.

    Args:
        device: the device whose graphs hold the segments.
        breaks: extra break ops (names ``"ns::op"`` or ops) besides the defaults
            (``devgraph.graph.break_ops(device)``: devgraph's attention ops, ``mark_break``'s, plugins').
        static_ops: custom ops whose host-list arguments are the same on every call, so the
            refusal of host lists inside a segment does not apply to them.

    ``capture()``/``replay()``/``reset()`` follow ``Graph``'s contract; ``graphs`` are the segment
    graphs, ``captured_breaks`` the breaks between them. See the module docstring.
    """

    def __init__(self, device: Device, breaks: Sequence[Any] = (), *, static_ops: Sequence[Any] = ()) -> None:
        from devgraph.graph._breaks import _name_of

        self.device = device
        self.breaks = frozenset(break_ops(device, breaks))
        self.static_ops = frozenset(_name_of(op) for op in static_ops)
        self._graphs: list[Graph] = []
        self._breaks: list[CapturedBreak] = []
        self._pool: MemoryPool | None = None
        self._state = "new"
        self._lock = threading.RLock()
        self._host_names: frozenset[str] = frozenset()
        # Per segment: its graph, the host arguments its tasks take, the break after it (the replay's plan).
        self._plan: list[tuple[Graph, tuple[str, ...], CapturedBreak | None]] = []

    @contextlib.contextmanager
    def capture(
        self,
        stream: Stream | None = None,
        pool: MemoryPool | None = None,
        *,
        auto_update_ops: Sequence[str] = (),
        host_args: Mapping[str, Any] | None = None,
        capture_error_mode: str = "default",
    ) -> Iterator[BreakableGraph]:
        """Record the block as segment graphs cut at break ops (which run eagerly, here and at replay).

        Args:
            stream: as ``Graph.capture``, for every segment.
            pool: as ``Graph.capture``, shared by every segment.
            auto_update_ops: as ``Graph.capture``, for every segment.
            capture_error_mode: as ``Graph.capture``, for every segment.
            host_args: the call's per-call host values by name (``{"seq_lens_host": lens}``): an op
                inside a segment given one of these very objects is refused (it would be frozen).
        Raises:
            DevgraphError: already captured (``reset()`` first) or capturing.
            CaptureError: the block did something a segment cannot hold (see the module docstring).
        """
        if self._state != "new":
            raise DevgraphError(
                "this breakable graph is capturing already"
                if self._state == "capturing"
                else "this breakable graph was already captured; call reset() before capturing again"
            )
        stream = stream or self.device.capture_stream()
        self._pool = pool = pool or self.device.pool()
        run = _Run(self, stream, pool, auto_update_ops, capture_error_mode, host_args or {})
        self._state = "capturing"
        ok = False
        try:
            # The device's capture lock for the whole capture: no other capture slips in between segments.
            with (
                self.device.capture_lock(),
                stream,
                _checking(run),
                host_compute.shared_across(self.device.torch_device.type),
            ):
                run.open_segment()
                try:
                    with _break_mode()(run):
                        yield self
                except BaseException:
                    run.close_segment(sys.exc_info())
                    raise
                run.close_segment()
                if run.failed is not None:
                    raise DevgraphError(
                        "a break of this capture failed and the error was caught inside the capture "
                        f"block ({type(run.failed).__name__}: {run.failed}); the capture is abandoned"
                    ) from run.failed
            ok = True
        finally:
            if not ok:
                run.abandon()
                self._state = "new"
        self._graphs, self._breaks = run.graphs, run.breaks
        self._index()
        self._state = "captured"
        logger.debug(
            "devgraph: breakable capture of %d segments, %d breaks (%s)",
            len(self._graphs),
            len(self._breaks),
            ", ".join(dict.fromkeys(b.op for b in self._breaks)) or "none",
        )

    def _index(self) -> None:
        names: set[str] = set()
        for b in self._breaks:
            names.update(b.host_args)
        self._plan = []
        for i, graph in enumerate(self._graphs):
            taken = tuple(sorted({n for t in graph.tasks if t.is_auto for n in t.host_names}))
            self._plan.append((graph, taken, self._breaks[i] if i < len(self._breaks) else None))
            names.update(taken)
        self._host_names = frozenset(names)

    def is_captured(self) -> bool:
        """True once a capture has completed (until ``reset()``)."""
        return self._state == "captured"

    @property
    def graphs(self) -> tuple[Graph, ...]:
        """The segment graphs, in replay order (one more than the breaks)."""
        return tuple(self._graphs)

    @property
    def captured_breaks(self) -> tuple[CapturedBreak, ...]:
        """The breaks between the segments, in replay order."""
        return tuple(self._breaks)

    def pool(self) -> MemoryPool:
        """The pool every segment captured into."""
        if self._pool is None:
            raise DevgraphError("this breakable graph has no pool yet; capture it first")
        return self._pool

    def replay(self, host_args: Mapping[str, Any] | None = None) -> None:
        """Replay the segments in order, each break re-run eagerly in between with ``host_args``.

        Args:
            host_args: ``{argument name: value}`` for this call, given to every break (and every
                updatable task of the segments) that takes the argument; the others keep the values
                they last had (frozen at capture, as on a graph).
        Raises:
            DevgraphError: not captured, or a name no break or task takes.
        """
        with self._lock:
            if self._state != "captured":
                raise DevgraphError("replay() of a breakable graph that was never captured (or was reset)")
            if host_args and not self._host_names.issuperset(host_args):
                unknown = sorted(set(host_args) - self._host_names)
                raise DevgraphError(
                    f"no break or updatable task of this breakable graph takes host argument(s) {unknown}; "
                    f"its breaks take {sorted(self._host_names) or 'none'}"
                )
            if _torch().is_grad_enabled():  # entering no_grad costs as much as a segment's replay
                with _torch().no_grad():
                    self._run(host_args)
            else:
                self._run(host_args)

    def _run(self, host_args: Mapping[str, Any] | None) -> None:
        for graph, taken, brk in self._plan:
            if taken and host_args:
                graph.replay({n: host_args[n] for n in taken if n in host_args} or None)
            else:
                graph.replay()
            if brk is not None:
                brk.run(host_args)

    def reset(self) -> None:
        """Drop every segment graph and break, so the breakable graph can be captured again."""
        if self._state == "capturing":
            raise DevgraphError("reset() inside the breakable graph's own capture block")
        with self._lock:
            for graph in self._graphs:
                graph.reset()
            self._graphs, self._breaks, self._plan = [], [], []
            self._state = "new"
