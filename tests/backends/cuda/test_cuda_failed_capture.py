"""A CUDA capture that CUDA invalidates, on CPU: the backend's clean-up of torch's caching allocator.

On torch 2.11 (before pytorch #180395) ``CUDAGraph.capture_end()`` checks ``cudaStreamEndCapture``'s
error before it ends the allocator's allocation to the pool, so an invalidated capture leaves the
allocator believing a capture is under way; torch's ``reset()`` then releases the pool only after a
successful capture (until pytorch #190348). The backend cleans up (``_release_failed_capture``).

No GPU here: the backend's module-level ``torch`` is replaced, for one test, by a fake whose
``torch.cuda`` and allocator calls follow torch's C++ code step by step (``CUDAGraph.cpp`` and the
caching allocator's ``beginAllocateToPool`` / ``endAllocateToPool`` / ``releasePool`` checks) in three
builds: 2.11 (the bug), 2.12 (#180395) and 2.13 (#180395 and #190348). Real torch is not touched.
The same two failures run on a real GPU in ``test_cuda_backend.py`` (``TestOnGpu``).
"""

from __future__ import annotations

import contextlib
import itertools
import types
from typing import Any

import pytest
import torch

from devgraph import CaptureError
from devgraph.backends.cuda import _device
from devgraph.backends.cuda._device import CudaDevice

BUILDS = ("2.11", "2.12", "2.13")


class FakeAllocator:
    """The caching allocator's graph-pool bookkeeping, with torch's own checks."""

    def __init__(self, calls: list[tuple[Any, ...]]) -> None:
        self.calls = calls
        self.captures_underway: list[tuple[int, int]] = []
        self.use_count: dict[tuple[int, int], int] = {}

    def begin_allocate_to_pool(self, pool: tuple[int, int]) -> None:
        if pool in self.captures_underway:
            raise RuntimeError("beginAllocateToPool: already recording to mempool_id")
        self.use_count[pool] = self.use_count.get(pool, 0) + 1
        self.captures_underway.append(pool)

    def end_allocate_to_pool(self, device: int, pool: tuple[int, int]) -> None:
        self.calls.append(("endAllocateToPool", device, pool))
        if pool not in self.captures_underway:
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
        self.captures_underway.remove(pool)

    def release_pool(self, device: int, pool: tuple[int, int]) -> None:
        self.calls.append(("releasePool", device, pool))
        self.use_count[pool] -= 1
        if self.use_count[pool] < 0:
            raise RuntimeError("uc >= 0 INTERNAL ASSERT FAILED")

    def empty_cache(self) -> None:
        if self.captures_underway:
            raise RuntimeError("captures_underway.empty() INTERNAL ASSERT FAILED")


class FakeStream:
    _ids = itertools.count(1)

    def __init__(self, device: int = 0, priority: int = 0) -> None:
        self.cuda_stream = next(self._ids)
        self.priority = priority

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FakeStream) and other.cuda_stream == self.cuda_stream

    def __hash__(self) -> int:
        return self.cuda_stream


def fake_torch(build: str) -> types.SimpleNamespace:
    """A ``torch`` for the backend's module: ``torch.cuda`` and ``torch._C``'s allocator calls as
    ``build`` implements them; ``fake.calls`` records, in order, the calls that touch the allocator."""
    calls: list[tuple[Any, ...]] = []
    alloc = FakeAllocator(calls)
    default = FakeStream()
    state: dict[str, Any] = {"current": default, "capturing": None}

    class CUDAGraph:
        def __init__(self, keep_graph: bool = False) -> None:
            self.capture_ended = self.pool_held = self.invalidated = False
            self.pool: tuple[int, int] | None = None

        def capture_begin(self, pool: tuple[int, int], capture_error_mode: str = "global") -> None:
            calls.append(("capture_begin", pool))
            assert state["current"] != default, "CUDA graphs must be captured on a non-default stream"
            self.pool = pool
            alloc.begin_allocate_to_pool(pool)
            self.pool_held = True
            state["capturing"] = self

        def capture_end(self) -> None:
            calls.append(("capture_end",))
            state["capturing"] = None
            if self.invalidated:
                if build != "2.11":  # pytorch #180395: the allocation ends before the error is raised
                    alloc.end_allocate_to_pool(0, self.pool)
                raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
            alloc.end_allocate_to_pool(0, self.pool)
            self.capture_ended = True

        def reset(self) -> None:
            calls.append(("reset",))
            release = self.capture_ended or (build == "2.13" and self.pool_held)  # 2.13: pytorch #190348
            if release and self.pool_held:
                alloc.release_pool(0, self.pool)
            self.capture_ended = self.pool_held = False

        def replay(self) -> None:
            assert self.capture_ended, "Called CUDAGraph::replay without a preceding successful capture."

    def synchronize(device: int | None = None) -> None:
        graph = state["capturing"]
        if graph is not None:  # a sync inside a capture: CUDA refuses it and invalidates the capture
            graph.invalidated = True
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    @contextlib.contextmanager
    def stream(s: FakeStream) -> Any:
        before, state["current"] = state["current"], s
        try:
            yield
        finally:
            state["current"] = before

    handles = itertools.count(1)
    cuda = types.SimpleNamespace(
        CUDAGraph=CUDAGraph,
        Stream=FakeStream,
        stream=stream,
        synchronize=synchronize,
        current_stream=lambda index=None: state["current"],
        default_stream=lambda index=None: default,
        graph_pool_handle=lambda: (0, next(handles)),
        empty_cache=alloc.empty_cache,
    )
    c_module = types.SimpleNamespace(
        _cuda_endAllocateToPool=alloc.end_allocate_to_pool, _cuda_releasePool=alloc.release_pool
    )
    return types.SimpleNamespace(
        cuda=cuda,
        _C=c_module,
        version=types.SimpleNamespace(hip=None, cuda="12.8"),
        device=torch.device,
        __version__=f"{build}.0",
        calls=calls,
        allocator=alloc,
    )


@pytest.fixture(params=BUILDS, ids=lambda b: f"torch{b}")
def fake(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    fake = fake_torch(request.param)
    monkeypatch.setattr(_device, "torch", fake)  # the backend module's name only; torch is untouched
    monkeypatch.setattr(_device, "_FAILED_CAPTURES", [])
    return fake


def _fail_at_capture_end(dev: CudaDevice, pool: Any) -> None:
    """The body swallows CUDA's refusal, so the capture's own end fails (the invalidated capture)."""
    with pytest.raises(CaptureError, match="previous error during capture"):
        with dev.graph().capture(pool=pool):
            with contextlib.suppress(RuntimeError):
                _device.torch.cuda.synchronize()


def _fail_in_the_body(dev: CudaDevice, pool: Any) -> None:
    """CUDA's refusal propagates from the body: the capture is aborted, and ending it fails."""
    with pytest.raises(CaptureError, match="not permitted when stream is capturing"):
        with dev.graph().capture(pool=pool):
            _device.torch.cuda.synchronize()


FAILURES = [_fail_at_capture_end, _fail_in_the_body]


def _allocator_calls(fake: types.SimpleNamespace) -> list[str]:
    return [c[0] for c in fake.calls if c[0] != "capture_begin"]


@pytest.mark.parametrize("fail", FAILURES, ids=lambda f: f.__name__.removeprefix("_"))
def test_failed_capture_leaves_no_capture_under_way(fake: types.SimpleNamespace, fail: Any) -> None:
    dev = CudaDevice(0)
    pool = dev.pool()
    fail(dev, pool)
    assert fake.allocator.captures_underway == []
    fake.cuda.empty_cache()  # torch 2.11 without the clean-up: captures_underway.empty() asserts


def _captured(dev: CudaDevice, pool: Any) -> Any:
    graph = dev.graph()
    with graph.capture(pool=pool):
        pass
    return graph


@pytest.mark.parametrize("fail", FAILURES, ids=lambda f: f.__name__.removeprefix("_"))
def test_a_shared_pool_is_captured_into_again_and_released_once(
    fake: types.SimpleNamespace, fail: Any
) -> None:
    dev = CudaDevice(0)
    pool = dev.pool()
    first = _captured(dev, pool)  # the pool stays in use (a runner's other buckets)
    fail(dev, pool)
    second = _captured(dev, pool)  # torch 2.11 without the clean-up: "already recording to mempool_id"
    second.replay()
    first.reset()
    second.reset()
    # Every capture's reference on the pool is given back exactly once (never twice: that asserts),
    # except on 2.12, whose reset() keeps a failed capture's reference (fixed by #190348 in 2.13).
    leaked = 1 if fake.__version__.startswith("2.12") else 0
    assert fake.allocator.use_count[pool.handle] == leaked


def test_clean_up_order_on_torch_2_11(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = fake_torch("2.11")
    monkeypatch.setattr(_device, "torch", fake)
    monkeypatch.setattr(_device, "_FAILED_CAPTURES", [])
    dev = CudaDevice(0)
    pool = dev.pool()
    _fail_at_capture_end(dev, pool)
    assert _allocator_calls(fake) == ["capture_end", "endAllocateToPool", "releasePool", "reset"]
    assert [c[1:] for c in fake.calls if c[0] in ("endAllocateToPool", "releasePool")] == [
        (0, pool.handle),
        (0, pool.handle),
    ]
    assert len(_device._FAILED_CAPTURES) == 1  # kept: the pinned-host allocator may still name it


@pytest.mark.parametrize("build", ["2.12", "2.13"])
def test_a_torch_with_the_fix_is_left_to_clean_up_itself(monkeypatch: pytest.MonkeyPatch, build: str) -> None:
    fake = fake_torch(build)
    monkeypatch.setattr(_device, "torch", fake)
    monkeypatch.setattr(_device, "_FAILED_CAPTURES", [])
    dev = CudaDevice(0)
    _fail_at_capture_end(dev, dev.pool())
    # torch ended the allocation itself: devgraph's try says so ("not currently recording"), and
    # devgraph releases nothing (reset() does on 2.13; a second release would assert).
    by_reset = ["releasePool"] if build == "2.13" else []
    assert _allocator_calls(fake) == [
        "capture_end",
        "endAllocateToPool",
        "endAllocateToPool",
        "reset",
        *by_reset,
    ]
    assert _device._FAILED_CAPTURES == []


def test_rocm_builds_leave_the_release_to_reset(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = fake_torch("2.11")
    fake.version.hip = "7.0"
    monkeypatch.setattr(_device, "torch", fake)
    monkeypatch.setattr(_device, "_FAILED_CAPTURES", [])
    dev = CudaDevice(0)
    _fail_in_the_body(dev, dev.pool())
    assert _allocator_calls(fake) == ["capture_end", "endAllocateToPool", "reset"]


def test_the_fake_catches_a_backend_without_the_clean_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fake is strict enough: with the clean-up reduced to torch's own reset(), the next capture
    into the pool fails as it does on a real torch 2.11."""
    fake = fake_torch("2.11")
    monkeypatch.setattr(_device, "torch", fake)
    monkeypatch.setattr(_device, "_release_failed_capture", lambda graph, index, pool: graph.reset())
    dev = CudaDevice(0)
    pool = dev.pool()
    first = _captured(dev, pool)
    _fail_at_capture_end(dev, pool)
    with pytest.raises(RuntimeError, match="captures_underway"):
        fake.cuda.empty_cache()
    with pytest.raises(RuntimeError, match="already recording to mempool_id"):
        _captured(dev, pool)
    assert first.is_captured()
