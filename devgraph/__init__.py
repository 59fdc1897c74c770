"""devgraph: one device-agnostic way to capture and replay accelerator graphs.

``import devgraph`` touches no device: it imports neither torch_npu nor initialises CUDA. Backends
load when a device is first asked for. The subpackages ``devgraph.ops``, ``devgraph.runner`` and
``devgraph.compile`` import on first attribute access (they import torch), and so do
``devgraph.bisect`` and ``devgraph.compare_tokens`` (from ``devgraph.debug``).

``devgraph.list_backends()`` lists the backends; ``devgraph.backends`` is the package of built-in
backends (calling it, the listing's old name, is deprecated: it warns and lists).
"""

from __future__ import annotations

import importlib
from typing import Any

from devgraph._errors import (
    BackendUnavailable,
    CaptureError,
    DevgraphError,
    PluginLoadError,
    RankMismatchError,
)
from devgraph._hookspecs import hookimpl
from devgraph._plugins import BackendInfo, BackendSpec, Probe, device, list_backends
from devgraph._wrap import wrap
from devgraph.graph import (
    BreakableGraph,
    Device,
    Event,
    Graph,
    MemoryPool,
    MemoryStats,
    Stream,
    TaskGroup,
    mark_break,
    unmark_break,
    weak_ref_tensor,
    weak_ref_tensors,
)

__version__ = "0.1.0"

#: Subpackages reachable as ``devgraph.<name>`` after a plain ``import devgraph``, imported lazily
#: so that ``import devgraph`` stays cheap (no torch import).
_LAZY_SUBPACKAGES = ("compile", "debug", "ops", "runner")

#: Names re-exported from a lazily imported subpackage (they import torch).
_LAZY_NAMES = {
    "BisectOptions": "debug",
    "BisectReport": "debug",
    "TokenComparison": "debug",
    "bisect": "debug",
    "compare_tokens": "debug",
}


def __getattr__(name: str) -> Any:
    if name == "GraphedModule":  # the runner layer imports torch: loaded on first use
        from devgraph.runner import GraphedModule

        return GraphedModule
    if name in _LAZY_SUBPACKAGES:
        return importlib.import_module(f"devgraph.{name}")
    if name in _LAZY_NAMES:
        return getattr(importlib.import_module(f"devgraph.{_LAZY_NAMES[name]}"), name)
    if name == "backends":
        # Always the package (cheap: it imports no backend), never a function that a later
        # ``import devgraph.backends.<x>`` would silently replace; calling it is deprecated.
        return importlib.import_module("devgraph.backends")
    raise AttributeError(f"module 'devgraph' has no attribute {name!r}")


__all__ = [
    "BackendInfo",
    "BisectOptions",
    "BisectReport",
    "BackendSpec",
    "BackendUnavailable",
    "BreakableGraph",
    "CaptureError",
    "Device",
    "DevgraphError",
    "Event",
    "Graph",
    "GraphedModule",
    "MemoryPool",
    "MemoryStats",
    "PluginLoadError",
    "Probe",
    "RankMismatchError",
    "Stream",
    "TaskGroup",
    "TokenComparison",
    "__version__",
    "bisect",
    "compare_tokens",
    "device",
    "hookimpl",
    "list_backends",
    "mark_break",
    "unmark_break",
    "weak_ref_tensor",
    "weak_ref_tensors",
    "wrap",
]
