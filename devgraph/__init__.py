"""devgraph: one device-agnostic way to capture and replay accelerator graphs.

``import devgraph`` touches no device: it imports neither torch_npu nor initialises CUDA. Backends
load when a device is first asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from devgraph._contract import Device, Event, Graph, MemoryPool, MemoryStats, Stream
from devgraph._errors import BackendUnavailable, CaptureError, DevgraphError, PluginLoadError
from devgraph._hookspecs import hookimpl
from devgraph._plugins import BackendInfo, BackendSpec, Probe, backends, device
from devgraph._tasks import TaskGroup
from devgraph._wrap import GraphedModule, wrap

if TYPE_CHECKING:
    import torch

__version__ = "0.1.0"

__all__ = [
    "BackendInfo",
    "BackendSpec",
    "BackendUnavailable",
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
    "Stream",
    "TaskGroup",
    "__version__",
    "backends",
    "device",
    "hookimpl",
    "weak_ref_tensor",
    "weak_ref_tensors",
    "wrap",
]


def weak_ref_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A non-owning tensor over ``tensor``'s memory (it does not keep the memory alive).

    Built with PyTorch's storage-from-data-pointer constructor, so it works on every backend.
    The caller must keep the memory alive by other means (a graph's pool does for captured outputs).
    """
    from devgraph.backends.cpu._device import weak_ref_tensor as _weak

    return _weak(tensor)


def weak_ref_tensors(tensors: Any) -> Any:
    """``weak_ref_tensor`` applied to every tensor in a (nested) list/tuple/dict; others pass through."""
    import torch
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: weak_ref_tensor(t) if isinstance(t, torch.Tensor) else t, tensors)
