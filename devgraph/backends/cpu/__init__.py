"""CPU reference backend plugin (registration only; the implementation loads on first use).

Its face: ``CpuDevice``, the reference device, for a backend (or a test double) built on it;
loaded on first access, as the device is.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from typing import Any

from devgraph._hookspecs import hookimpl
from devgraph._plugins import BackendSpec, Probe

__all__ = ["CpuDevice"]


def __getattr__(name: str) -> Any:
    if name == "CpuDevice":  # imports torch: only when asked for
        from devgraph.backends.cpu._device import CpuDevice

        return CpuDevice
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _probe() -> Probe:
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return Probe(False, "torch is not installed")
    return Probe(True, "reference simulator (correctness, not speed)", version, 1)


@hookimpl
def devgraph_register_backends(register: Callable[[Any], None]) -> None:
    register(BackendSpec("cpu", _probe, "devgraph.backends.cpu._device:CpuDevice", builtin=True))


@hookimpl
def devgraph_register_op_kernels(register: Callable[..., None]) -> None:
    from devgraph.backends.cpu import _kernels

    _kernels.register_all(register)
