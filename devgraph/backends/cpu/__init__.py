"""CPU reference backend plugin (registration only; the implementation loads on first use)."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from typing import Any

from devgraph._hookspecs import hookimpl
from devgraph._plugins import BackendSpec, Probe


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
