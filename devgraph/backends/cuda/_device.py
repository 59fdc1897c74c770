"""The CUDA backend: devgraph's contract over ``torch.cuda.CUDAGraph``, streams, events and pools.

Capture follows ``torch.cuda.graph``: synchronise the device, make the side stream current, then
``CUDAGraph.capture_begin(pool=...)`` / ``capture_end()`` on that stream. A ``CudaPool`` is a
``torch.cuda.graph_pool_handle()``; graphs captured with the same pool share memory. Captures
without an explicit stream use the device's one ``capture_stream()`` (see ``Device``).

Task update on CUDA -- the documented no-op path
------------------------------------------------
A CUDA graph cannot re-issue one of its captured kernels with new host arguments: the launch
parameters are baked into the instantiated graph. CUDA engines therefore keep per-step attention
metadata (sequence lengths, block tables) in *device tensors* that the kernel reads at run time,
and refill those tensors before every replay. devgraph's CUDA kernel of
``devgraph::paged_decode_attention`` does exactly that: it reads ``seq_lens`` (a device tensor) and
ignores ``seq_lens_host``. So on this backend:

* ``graph.update(host_args)`` / ``graph.replay(host_args)`` for ops in ``DEVICE_METADATA_OPS`` only
  record the new host values on the task (``TaskGroup.host_args``); nothing is re-issued. The caller
  must write the new lengths into the device tensor it captured with (as every CUDA engine does).
* Task groups are captured as ordinary graph work (``_task_group_begin/_end`` are no-ops, the
  group's ``handle`` stays None), so backend-neutral code that opens them still captures.
* Re-issuing work -- ``graph.task_update(group)``, or ``update()`` of any op *not* in
  ``DEVICE_METADATA_OPS`` -- raises ``DevgraphError``: the op must read its changing metadata from
  device tensors to be used in a CUDA graph.

Importing this module makes no CUDA call, so it imports (and fails only on use) with a CPU-only torch.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from devgraph._errors import CaptureError, DevgraphError
from devgraph._source import user_source_line
from devgraph.graph import Device, Event, Graph, MemoryPool, MemoryStats, Stream, TaskGroup, apply_host_args

__all__ = [
    "DEVICE_METADATA_OPS",
    "CudaDevice",
    "CudaEvent",
    "CudaGraph",
    "CudaPool",
    "CudaStream",
    "DeviceMetadataGraph",
]

logger = logging.getLogger("devgraph.cuda")

#: Ops whose CUDA kernel reads its per-step metadata from device tensors: updating their host
#: arguments is a no-op on CUDA (see the module docstring).
DEVICE_METADATA_OPS: frozenset[str] = frozenset({"devgraph::paged_decode_attention"})

#: Fragments of the CUDA errors raised when captured code does something a capture forbids.
_CAPTURE_VIOLATIONS = (
    "operation not permitted when stream is capturing",
    "operation failed due to a previous error during capture",
    "stream capture",
    "cudaErrorStreamCapture",
    # torch's own assertNotCapturing: re-seeding a generator (manual_seed, set_rng_state) and others
    "during CUDA graph capture",
    # A library's first use inside a capture (plan building, workspace allocation): cuDNN's SDPA on
    # a shape it has not seen fails with CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED (H200,
    # torch 2.11). Any library or CUDA error raised while capturing is the capture's to name.
    "cuDNN error",
    "CUBLAS_STATUS_",
    "CUDA error:",
)

_RNG_REMEDY = (
    "seed before capture, not inside the captured code: call torch.manual_seed / set_rng_state (or "
    "Generator.manual_seed / set_state) outside the block and create generators outside it; a replay "
    "then draws the next numbers of the stream, as an eager call would"
)

_CAPTURE_REMEDY = (
    "something inside the captured block made CUDA wait for the host or used an API that graph "
    "capture forbids (torch.cuda.synchronize(), an event/stream synchronize, a pageable host copy, "
    "an op that syncs internally such as repeat_interleave without output_size or boolean-mask "
    "indexing, or a library doing lazy initialisation on first use). Run the block once eagerly "
    "before capture (warm-up), move the offending call out of the block, or run that part eagerly "
    "(piecewise mode, splitting_ops=[...]). Capturing the same code on devgraph.device('cpu') "
    "names the offending op and line for most host syncs."
)


class CudaStream(Stream):
    """A devgraph stream over a ``torch.cuda.Stream``."""

    def __init__(
        self, device: CudaDevice, priority: int = 0, torch_stream: torch.cuda.Stream | None = None
    ) -> None:
        super().__init__(device, priority)
        self.torch_stream = torch_stream or torch.cuda.Stream(device=device.index, priority=priority)

    def synchronize(self) -> None:
        self.torch_stream.synchronize()

    def query(self) -> bool:
        return bool(self.torch_stream.query())

    def wait_event(self, event: Event) -> None:
        self.torch_stream.wait_event(_torch_event(event))

    def wait_stream(self, other: Stream) -> None:
        if not isinstance(other, CudaStream):
            raise DevgraphError(f"a cuda stream cannot wait on {other!r}")
        self.torch_stream.wait_stream(other.torch_stream)

    def _enter(self) -> Any:
        # torch.cuda.stream() also makes the stream's device current, and restores both on exit.
        ctx = torch.cuda.stream(self.torch_stream)
        ctx.__enter__()
        return ctx

    def _exit(self, token: Any) -> None:
        token.__exit__(None, None, None)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CudaStream) and self.torch_stream == other.torch_stream

    def __hash__(self) -> int:
        return hash(self.torch_stream)

    def __repr__(self) -> str:
        return f"<CudaStream {self.device} 0x{self.torch_stream.cuda_stream:x}>"


class CudaEvent(Event):
    """A devgraph event over a ``torch.cuda.Event``."""

    def __init__(self, device: CudaDevice, enable_timing: bool = False) -> None:
        super().__init__(device, enable_timing)
        self.torch_event = torch.cuda.Event(enable_timing=enable_timing)

    def record(self, stream: Stream | None = None) -> None:
        self.torch_event.record(_torch_stream(stream or self.device.current_stream()))

    def wait(self, stream: Stream | None = None) -> None:
        self.torch_event.wait(_torch_stream(stream or self.device.current_stream()))

    def query(self) -> bool:
        return bool(self.torch_event.query())

    def synchronize(self) -> None:
        self.torch_event.synchronize()

    def elapsed_time(self, end: Event) -> float:
        self._check_timing(end)
        return float(self.torch_event.elapsed_time(_torch_event(end)))


class CudaPool(MemoryPool):
    """A graph memory pool: a ``torch.cuda.graph_pool_handle()`` token."""

    def __init__(self, device: CudaDevice) -> None:
        super().__init__(device)
        self.handle = torch.cuda.graph_pool_handle()


class DeviceMetadataGraph(Graph):
    """A graph whose updatable ops read their changing values from device tensors (``_needs_reissue``
    is False for them): ``replay(host_args)`` only notes the host values.

    Per-task work at every replay would be pure host overhead there, so a replay whose host arguments
    only name values of such tasks keeps them in one pending mapping, recorded on the tasks when
    ``tasks`` or ``update`` next looks at them (``_settle_host_args``). A name no task takes, or a
    graph with a task that needs a re-issue, goes through ``update``, which validates and re-issues.
    """

    def _replay_with_host_args(self, host_args: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        if not self._note_host_args(host_args):
            self.update(host_args)
        self._replay()

    def _note_host_args(self, host_args: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> bool:
        """Take ``host_args`` without touching each task, when no task needs a re-issue; True if taken."""
        if not isinstance(host_args, Mapping):
            return False
        # (the task list it describes, names the tasks take, pending values); made on first use.
        plan: tuple[list[TaskGroup], frozenset[str] | None, dict[str, Any]] | None
        plan = self.__dict__.get("_host_only")
        if plan is None or plan[0] is not self._tasks:  # first replay since capture
            auto = [t for t in self._tasks if t.is_auto]
            names = (
                None
                if any(self._needs_reissue(t) for t in auto)
                else frozenset(n for t in auto for n in t.host_names)
            )
            pending: dict[str, Any] = {}
            plan = self.__dict__["_host_only"] = (self._tasks, names, pending)
        if plan[1] is None or not host_args.keys() <= plan[1]:
            return False
        plan[2].update(host_args)
        return True

    def _settle_host_args(self) -> None:
        """Record the values ``_note_host_args`` kept on the tasks that take them."""
        plan = self.__dict__.get("_host_only")
        if plan is not None and plan[0] is self._tasks and plan[2]:
            pending = dict(plan[2])
            plan[2].clear()
            for group, kwargs in apply_host_args(self._tasks, pending):
                group.remember(kwargs)


class CudaGraph(DeviceMetadataGraph):
    """A devgraph graph over ``torch.cuda.CUDAGraph`` (see the module docstring for task update)."""

    def __init__(self, device: CudaDevice, keep_graph: bool = False) -> None:
        super().__init__(device, keep_graph)
        self.torch_graph: torch.cuda.CUDAGraph | None = None
        self._capture_pool_id: Any = None  # the torch pool id of the capture under way

    def _translate_capture_error(self, exc: BaseException) -> BaseException | None:
        """CUDA's own capture errors ("operation not permitted when stream is capturing") as a
        ``CaptureError`` with the user's line and a remedy."""
        if (
            isinstance(exc, DevgraphError)
            or not isinstance(exc, RuntimeError)
            or not _is_capture_violation(exc)
        ):
            return None
        text = str(exc).strip()
        first_line = text.splitlines()[0] if text else type(exc).__name__
        rng = "GeneratorImpl" in first_line  # "Cannot call CUDAGeneratorImpl::set_current_seed ..."
        return CaptureError(
            f"CUDA refused an operation during graph capture: {first_line}",
            op="torch.manual_seed / set_rng_state / Generator.manual_seed" if rng else None,
            source=user_source_line(exc.__traceback__) or user_source_line(),
            remedy=_RNG_REMEDY if rng else _CAPTURE_REMEDY,
        )

    def _begin_capture(self, stream: Stream, pool: MemoryPool) -> None:
        if not isinstance(stream, CudaStream) or stream.device != self.device:
            raise DevgraphError(
                f"a graph on {self.device} must capture on a stream of that device, not {stream!r}"
            )
        if not isinstance(pool, CudaPool) or pool.device != self.device:
            raise DevgraphError(f"a graph on {self.device} cannot capture into {pool!r}")
        if stream.torch_stream == torch.cuda.default_stream(self.device.index):
            raise DevgraphError(
                "cannot capture on the default stream (CUDA refuses it): pass a side stream, "
                "device.stream(), or none to get one"
            )
        # Like torch.cuda.graph: finish outstanding work so nothing queued before the block is
        # mistaken for captured work. gc.collect() is left to the runner (it is slow per capture).
        torch.cuda.synchronize(self.device.index)
        graph = torch.cuda.CUDAGraph(keep_graph=True) if self.keep_graph else torch.cuda.CUDAGraph()
        # torch.cuda spells "default" as "global" (its own default); the other names are the same.
        mode = "global" if self.capture_error_mode == "default" else self.capture_error_mode
        graph.capture_begin(pool=pool.handle, capture_error_mode=mode)
        self.torch_graph = graph
        self._capture_pool_id = pool.handle

    def _end_capture(self) -> None:
        graph = self.torch_graph
        assert graph is not None
        try:
            graph.capture_end()
        except BaseException:
            self.torch_graph = None
            _release_failed_capture(graph, self.device.index, self._capture_pool_id)
            raise

    def _abort_capture(self) -> None:
        graph, self.torch_graph = self.torch_graph, None
        if graph is None:
            return
        # End the capture so the stream leaves capture mode; an invalidated capture fails to end,
        # and the error that invalidated it is already propagating.
        try:
            graph.capture_end()
        except RuntimeError as exc:
            logger.debug("ending an aborted capture failed (expected after a CUDA capture error): %s", exc)
            _release_failed_capture(graph, self.device.index, self._capture_pool_id)
            return
        try:
            graph.reset()
        except RuntimeError as exc:
            logger.debug("resetting an aborted capture's torch graph failed: %s", exc)

    def _replay(self) -> None:
        assert self.torch_graph is not None
        self.torch_graph.replay()

    def _reset(self) -> None:
        graph, self.torch_graph = self.torch_graph, None
        if graph is not None:
            graph.reset()

    # -- task update: the documented no-op path ------------------------------------------------

    def _task_group_begin(self, group: TaskGroup) -> None:
        group.handle = None  # captured as ordinary graph work

    def _task_group_end(self, group: TaskGroup) -> None:
        pass

    def _needs_reissue(self, group: TaskGroup) -> bool:
        return group.op not in DEVICE_METADATA_OPS

    def _task_update_begin(self, group: TaskGroup) -> None:
        if group.op in DEVICE_METADATA_OPS:
            raise DevgraphError(
                f"task {group.index} ({group.op}) cannot be re-issued on CUDA, and need not be: its "
                "CUDA kernel reads the lengths from the device tensor it was captured with. Write the "
                "new values into that tensor, then graph.update(host_args) (records the host values) "
                "or graph.replay(host_args)."
            )
        raise DevgraphError(
            f"task {group.index} ({group.op}) cannot be re-issued with new host arguments on CUDA: a "
            "CUDA graph bakes every captured kernel's launch arguments in at capture. Make the op read "
            "the changing values from device tensors (refilled before each replay) and list it in "
            "devgraph.backends.cuda._device.DEVICE_METADATA_OPS, or run it eagerly between graph "
            "pieces (piecewise mode, splitting_ops=[...])."
        )

    def _task_update_end(self, group: TaskGroup) -> None:
        pass


class CudaDevice(Device):
    """One CUDA GPU (``torch.device("cuda", index)``)."""

    name = "cuda"
    dispatch_key = "CUDA"
    updatable_ops = ("devgraph::paged_decode_attention",)
    default_compile_backend = "inductor"

    def __init__(self, index: int = 0) -> None:
        super().__init__(index)
        # cuda_stream handle -> the devgraph wrapper, so current_stream() returns the very object
        # a caller entered with `with stream:`.
        self._streams: weakref.WeakValueDictionary[int, CudaStream] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cuda", self.index)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.index)

    def stream(self, priority: int = 0) -> Stream:
        stream = CudaStream(self, priority)
        with self._lock:
            self._streams[stream.torch_stream.cuda_stream] = stream
        return stream

    def current_stream(self) -> Stream:
        current = torch.cuda.current_stream(self.index)
        with self._lock:
            known = self._streams.get(current.cuda_stream)
            if known is None:
                known = CudaStream(self, current.priority, torch_stream=current)
                self._streams[current.cuda_stream] = known
        return known

    def event(self, enable_timing: bool = False) -> Event:
        return CudaEvent(self, enable_timing)

    def graph(self, keep_graph: bool = False) -> Graph:
        return CudaGraph(self, keep_graph)

    def pool(self) -> MemoryPool:
        return CudaPool(self)

    def memory_stats(self) -> MemoryStats:
        """Bytes of torch's CUDA caching allocator on this GPU (graph pools included)."""
        return MemoryStats(
            allocated=torch.cuda.memory_allocated(self.index),
            reserved=torch.cuda.memory_reserved(self.index),
            peak_allocated=torch.cuda.max_memory_allocated(self.index),
        )


def _torch_stream(stream: Stream) -> torch.cuda.Stream:
    if not isinstance(stream, CudaStream):
        raise DevgraphError(f"expected a cuda stream, got {stream!r}")
    return stream.torch_stream


def _torch_event(event: Event) -> torch.cuda.Event:
    if not isinstance(event, CudaEvent):
        raise DevgraphError(f"expected a cuda event, got {event!r}")
    return event.torch_event


#: torch graphs whose failed capture left a record in the pinned-host allocator that Python cannot
#: end (see ``_release_failed_capture``): kept alive so the allocator's filter never reads a freed graph.
_FAILED_CAPTURES: list[Any] = []


def _release_failed_capture(graph: Any, device_index: int, pool_id: Any) -> None:
    """Give the caching allocator back what a capture whose ``capture_end()`` raised left behind.

    torch before 2.12 (pytorch #180395) checks ``cudaStreamEndCapture``'s error before it ends the
    allocator's allocation to the pool, so an invalidated capture leaves the allocator believing a
    capture is still under way: the next ``empty_cache()``, capture or pool release in the process
    asserts (``captures_underway.empty()``). Ending the allocation here (``endAllocateToPool``) undoes
    that. It succeeds only on such a torch; a torch with the fix ended it itself, and the call's
    "not currently recording" error is the sign to leave the rest to torch. On a torch with the bug,
    ``CUDAGraph.reset()`` releases the pool only after a successful capture, so the capture's
    reference on the pool is released here too (``releasePool``: the pool's memory can be freed once
    no graph uses it). ROCm builds are the exception: ROCm's release/2.11 carries pytorch #190348,
    whose ``reset()`` releases after a failed capture, and a second release would assert.
    ``graph.reset()`` then drops the capture's id from torch's table of graphs being captured.

    Never raises: it runs while the capture's own error propagates; what it could not do is logged.
    """
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    release = getattr(torch._C, "_cuda_releasePool", None)
    if end is None or release is None:
        logger.warning(
            "torch %s has no _cuda_endAllocateToPool/_cuda_releasePool: the caching allocator may still "
            "believe a capture is under way after this failed capture (pytorch #180395); restart the "
            "process before capturing again",
            torch.__version__,
        )
    else:
        try:
            end(device_index, pool_id)
        except RuntimeError as exc:
            logger.debug("torch ended the failed capture's allocation itself: %s", exc)
        else:
            logger.debug("ended the allocation of a failed capture to pool %s (pytorch #180395)", pool_id)
            _FAILED_CAPTURES.append(graph)
            if getattr(torch.version, "hip", None) is None:
                try:
                    release(device_index, pool_id)
                except RuntimeError as exc:
                    logger.warning("releasing the failed capture's pool %s failed: %s", pool_id, exc)
    try:
        graph.reset()
    except RuntimeError as exc:
        logger.debug("resetting a failed capture's torch graph failed: %s", exc)


def _is_capture_violation(exc: BaseException) -> bool:
    text = str(exc)
    return any(fragment.lower() in text.lower() for fragment in _CAPTURE_VIOLATIONS)
