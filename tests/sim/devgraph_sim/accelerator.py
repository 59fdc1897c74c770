"""A stand-in for ``torch.accelerator`` (torch 2.13's Python API), for the ``accelerator`` backend's tests.

devgraph's ``accelerator`` backend drives any device that registers a ``torch.accelerator.Graph``
implementation (XPU, torch_npu...). No such device is here, and torch offers no Python way to register
a graph implementation (``REGISTER_GRAPH_IMPL`` is C++ only, keyed by device type), so the backend is
tested against this stand-in: objects with exactly the Python signatures torch 2.13 exposes
(``torch.accelerator.Graph(keep_graph=False, *, pool=None, capture_error_mode="default")`` with
``capture_begin/capture_end/instantiate/replay/reset/pool/enable_debug_mode/debug_dump`` and
``with graph:``; ``torch.Stream(device=None, *, priority=0)``; ``torch.Event(device=None, *,
enable_timing=False, blocking=False, interprocess=False)``; ``torch.accelerator.current_accelerator``,
``current_stream``, ``set_stream``, ``synchronize``, ``device_count`` and the memory counters), checked
against torch by ``tests/backends/accelerator/test_accelerator_backend.py``.

Underneath runs the torch_npu simulator's device model (``_runtime``: asynchronous streams,
stream capture recording dispatcher calls into a graph pool, replays on the same memory), on CPU
tensors; the stand-in's accelerator reports device type ``"cpu"``. It is a test double, not a
device: the README's verification table lists the backend as verified on this stand-in only.

``with standin_accelerator() as api:`` resets the simulated device for the block; pass ``api`` to
``AcceleratorDevice(index, api=api)``.
"""

from __future__ import annotations

import contextlib
import itertools
import types
from collections.abc import Iterator
from typing import Any

import torch

from devgraph_sim.npu import _runtime as _rt

__all__ = ["CAPTURE_ERROR_MODES", "standin_accelerator"]

#: torch.accelerator.Graph's capture_error_mode values (torch 2.13).
CAPTURE_ERROR_MODES = ("default", "global", "thread_local", "relaxed")
_DEVICE = torch.device("cpu")


def _index(device: Any) -> int:
    if device is None:
        return 0
    if isinstance(device, int):
        return device
    index = torch.device(device).index
    return 0 if index is None else index


class Stream:
    """``torch.Stream`` over a simulated stream."""

    def __init__(self, device=None, *, priority=0, _native=None) -> None:
        self._native = _native if _native is not None else _rt.Stream(priority=priority)
        self.device = _DEVICE
        self.device_index = _index(device)
        self.device_type = _DEVICE.type
        self.stream_id = self._native.stream_id
        self.priority = priority

    def query(self) -> bool:
        return self._native.query()

    def synchronize(self) -> None:
        self._native.synchronize()

    def wait_event(self, event) -> None:
        event.wait(self)

    def wait_stream(self, other) -> None:
        self.wait_event(other.record_event())

    def is_capturing(self) -> bool:
        return self.stream_id in _rt._STATE.capturing

    def record_event(self, event=None):
        event = Event(enable_timing=False) if event is None else event
        event.record(self)
        return event

    def __enter__(self):
        self._previous = current_stream()
        set_stream(self)
        return self

    def __exit__(self, exc_type, exc_val, exc_tb) -> None:
        set_stream(self._previous)

    def __eq__(self, other) -> bool:
        return isinstance(other, Stream) and other.stream_id == self.stream_id

    def __hash__(self) -> int:
        return hash(("standin", self.stream_id))

    def __repr__(self) -> str:
        return f"torch.Stream device_type=cpu, device_index={self.device_index}, stream_id={self.stream_id} (stand-in)"


class Event:
    """``torch.Event`` over a simulated event."""

    def __init__(self, device=None, *, enable_timing=False, blocking=False, interprocess=False) -> None:
        self._native = _rt.Event(enable_timing=enable_timing, blocking=blocking, interprocess=interprocess)
        self.device = _DEVICE

    def record(self, stream=None) -> None:
        self._native.record(None if stream is None else stream._native)

    def wait(self, stream=None) -> None:
        self._native.wait(None if stream is None else stream._native)

    def query(self) -> bool:
        return self._native.query()

    def synchronize(self) -> None:
        self._native.synchronize()

    def elapsed_time(self, other) -> float:
        return self._native.elapsed_time(other._native)


_pool_ids = itertools.count(1)
_pools: dict[tuple[int, int], Any] = {}  # pool id -> the simulator's pool token


class Graph:
    """``torch.accelerator.Graph`` over a simulated graph (signatures of torch 2.13)."""

    def __new__(cls, keep_graph=False, *, pool=None, capture_error_mode="default"):
        return super().__new__(cls)

    def __init__(self, keep_graph=False, *, pool=None, capture_error_mode="default") -> None:
        self.graph_pool = pool
        self.capture_error_mode = capture_error_mode
        self._keep_graph = keep_graph
        self._native = _rt.NPUGraph()
        self._pool_id: tuple[int, int] | None = None
        self._debug = False
        self._instantiated = False

    def capture_begin(self) -> None:
        if self.capture_error_mode not in CAPTURE_ERROR_MODES:
            raise RuntimeError(f"Unknown capture error mode {self.capture_error_mode!r}")
        if self.graph_pool is None:
            pool_id = (0, next(_pool_ids))
            _pools[pool_id] = _rt.graph_pool_handle()
        else:
            pool_id = tuple(self.graph_pool)
            if pool_id not in _pools:
                raise RuntimeError(f"unknown graph pool id {pool_id}")
        mode = "global" if self.capture_error_mode == "default" else self.capture_error_mode
        self._native.capture_begin(pool=_pools[pool_id], capture_error_mode=mode)
        self._pool_id = pool_id  # type: ignore[assignment]

    def capture_end(self) -> None:
        self._native.capture_end()
        self._instantiated = not self._keep_graph

    def instantiate(self) -> None:
        if not self._native._tape.segments:
            raise RuntimeError("instantiate() without a successful capture")
        self._instantiated = True

    def replay(self) -> None:
        if not self._instantiated and self._native._tape.segments:
            self.instantiate()
        self._native.replay()

    def reset(self) -> None:
        self._native.reset()
        self._instantiated = False

    def pool(self) -> tuple[int, int]:
        if self._pool_id is None:
            raise RuntimeError("this graph has no pool yet: capture it first")
        return self._pool_id

    def enable_debug_mode(self) -> None:
        self._debug = True

    def debug_dump(self, path: str) -> None:
        if not self._debug:
            raise RuntimeError("debug_dump needs enable_debug_mode() before capture")
        with open(path, "w", encoding="utf-8") as f:
            f.write("\n".join(self._native._recorded_ops) + "\n")

    def __enter__(self) -> None:
        synchronize()
        self.capture_begin()

    def __exit__(self, *exc_info: object) -> None:
        self.capture_end()


# -- torch.accelerator's module functions ------------------------------------------------------------


def current_accelerator(check_available: bool = False) -> torch.device:
    return _DEVICE


def is_available() -> bool:
    return True


def device_count() -> int:
    return 1


def current_device_index() -> int:
    return 0


def current_stream(device=None, /) -> Stream:
    return Stream(device, _native=_rt.current_stream())


def set_stream(stream: Stream) -> None:
    _rt.set_stream(stream._native)


def synchronize(device=None, /) -> None:
    _rt.synchronize()


def empty_cache() -> None:
    pass


def memory_allocated(device_index=None, /) -> int:
    return _rt.memory_allocated()


def memory_reserved(device_index=None, /) -> int:
    return _rt.memory_reserved()


def max_memory_allocated(device_index=None, /) -> int:
    return _rt.max_memory_allocated()


_ACCELERATOR_NAMES = (
    "Graph", "current_accelerator", "is_available", "device_count", "current_device_index", "current_stream",
    "set_stream", "synchronize", "empty_cache", "memory_allocated", "memory_reserved", "max_memory_allocated",
)  # fmt: skip


@contextlib.contextmanager
def standin_accelerator(hang_timeout: float = 2.0) -> Iterator[types.SimpleNamespace]:
    """A fresh stand-in for the block: ``api.accelerator`` (torch.accelerator), ``api.Stream``,
    ``api.Event``. The simulated device is reset on entry and exit (its queued work is run first)."""
    outer = _rt.stream_mode()
    _rt.reset_state("eager", hang_timeout)
    accelerator = types.SimpleNamespace(**{name: globals()[name] for name in _ACCELERATOR_NAMES})
    ok = False
    try:
        yield types.SimpleNamespace(accelerator=accelerator, Stream=Stream, Event=Event)
        ok = True
        _rt.synchronize()
    finally:
        _pools.clear()
        _rt.reset_state(*outer)
        del ok
