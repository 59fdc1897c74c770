"""Generic backend over ``torch.accelerator.Graph`` (torch 2.12+) (registration only).

Serves any device that registers a ``torch.accelerator.Graph`` implementation and has no dedicated
devgraph backend: an XPU (or a PrivateUse1 device) gets devgraph without a plugin of its own.
``devgraph.device("xpu")`` resolves to it, and so does ``devgraph.device()`` when no dedicated
accelerator backend is available. CUDA and Ascend NPUs keep their own backends (``cuda``, ``npu``).

The probe imports torch (devgraph needs it anyway) and never raises; it touches the device only to
ask torch whether a graph implementation is registered for it (torch has no other way to ask from
Python: ``REGISTER_GRAPH_IMPL`` is C++ only).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from devgraph._hookspecs import hookimpl
from devgraph._plugins import BackendSpec, Probe

__all__ = ["DEDICATED", "devgraph_register_backends", "device_types", "probe"]

#: Device types with a dedicated devgraph backend: the generic one stands aside for them.
DEDICATED = frozenset({"cpu", "cuda", "npu"})


def _accelerator() -> tuple[Any, str | None, str]:
    """``(torch, device type or None, why not)``."""
    try:
        import torch
    except Exception as exc:
        return None, None, f"torch is not importable ({type(exc).__name__}: {exc})"
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None or not hasattr(accelerator, "Graph"):
        return torch, None, f"torch {torch.__version__} has no torch.accelerator.Graph (torch 2.12+)"
    try:
        current = accelerator.current_accelerator()
    except Exception as exc:
        return torch, None, f"torch.accelerator.current_accelerator() failed ({type(exc).__name__}: {exc})"
    if current is None:
        return (
            torch,
            None,
            "no accelerator visible to torch (torch.accelerator.current_accelerator() is None)",
        )
    return torch, current.type, ""


def probe() -> Probe:
    """Whether torch's current accelerator can be driven through ``torch.accelerator.Graph`` here."""
    torch, kind, why = _accelerator()
    if kind is None:
        return Probe(False, why, getattr(torch, "__version__", None))
    version = f"torch {torch.__version__}"
    if kind in DEDICATED:
        return Probe(False, f"{kind} has devgraph's own backend: devgraph.device({kind!r})", version)
    try:
        torch.accelerator.Graph()  # raises when no graph implementation is registered for the device
        count = int(torch.accelerator.device_count())
    except Exception as exc:
        return Probe(
            False, f"{kind} registers no torch.accelerator.Graph implementation ({type(exc).__name__}: {exc})",
            version,
        )  # fmt: skip
    return Probe(True, f"{count} {kind} device(s) through torch.accelerator.Graph", version, count)


def device_types() -> tuple[str, ...]:
    """The torch device types this backend serves now (``("xpu",)``), for ``devgraph.device("xpu")``."""
    _, kind, _ = _accelerator()
    return () if kind is None or kind in DEDICATED else (kind,)


@hookimpl
def devgraph_register_backends(register: Callable[[Any], None]) -> None:
    register(
        BackendSpec(
            "accelerator",
            probe,
            "devgraph.backends.accelerator._device:AcceleratorDevice",
            builtin=True,
            device_types=device_types,
        )
    )
