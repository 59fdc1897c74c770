"""Ascend NPU backend plugin (registration only; the implementation loads on first use).

The probe is cheap and never raises. It never imports torch_npu unless the CANN runtime loads:
torch_npu installed without CANN breaks ``import torch`` itself (``libhccl.so`` missing), so the
probe reports that instead of triggering it. In order:

1. ``sys.modules["torch_npu"] is None``: importing torch_npu was disabled on purpose.
2. A ``torch_npu`` module is already loaded (the real one, or a stand-in such as devgraph's tests'):
   ask it (``torch_npu.npu.is_available()``).
3. torch_npu is not installed.
4. torch_npu is installed but ``libhccl.so`` does not load: CANN is missing or not sourced.
5. Otherwise import torch_npu and ask it.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from devgraph._hookspecs import hookimpl
from devgraph._plugins import BackendSpec, Probe

__all__ = ["devgraph_register_backends", "devgraph_register_op_kernels", "probe"]

#: The CANN library whose absence makes torch_npu (and, through autoload, ``import torch``) fail.
CANN_PROBE_LIBRARY = "libhccl.so"


def _installed_version() -> str:
    for dist in ("torch_npu", "torch-npu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "(unknown version)"


def _ask(torch_npu: ModuleType) -> Probe:
    """Availability as a loaded torch_npu module (real or simulated) reports it."""
    version = getattr(torch_npu, "__version__", None)
    try:
        available = bool(torch_npu.npu.is_available())
        count = int(torch_npu.npu.device_count()) if available else 0
    except Exception as exc:
        return Probe(False, f"torch_npu.npu.is_available() failed ({type(exc).__name__}: {exc})", version)
    if not available or count <= 0:
        return Probe(
            False,
            f"torch_npu {version} is loaded but sees no NPU (check the driver and ASCEND_RT_VISIBLE_DEVICES)",
            version,
        )
    # Where the module came from, so that a stand-in (devgraph's tests' simulator) says so itself.
    spec = getattr(torch_npu, "__spec__", None)
    origin = getattr(spec, "origin", None) or getattr(torch_npu, "__file__", None) or "?"
    return Probe(True, f"{count} NPU(s) seen by torch_npu {version} ({origin})", version, count)


def probe() -> Probe:
    """Whether an Ascend NPU can be used here, and why not (see the module docstring)."""
    if "torch_npu" in sys.modules:
        loaded = sys.modules["torch_npu"]
        if loaded is None:
            return Probe(False, "import of torch_npu is disabled (sys.modules['torch_npu'] is None)")
        return _ask(loaded)
    try:
        spec = importlib.util.find_spec("torch_npu")
    except (ImportError, ValueError) as exc:
        return Probe(False, f"torch_npu cannot be located ({type(exc).__name__}: {exc})")
    if spec is None:
        return Probe(False, "torch_npu is not installed (pip install 'devgraph[npu]')")
    version = _installed_version()
    try:
        ctypes.CDLL(CANN_PROBE_LIBRARY)
    except OSError as exc:
        return Probe(
            False,
            f"torch_npu {version} is installed but the CANN runtime is missing: {exc} (source CANN's "
            "set_env.sh; keep TORCH_DEVICE_BACKEND_AUTOLOAD=0 until then)",
            version,
        )
    try:
        import torch_npu
    except Exception as exc:
        return Probe(False, f"import torch_npu failed ({type(exc).__name__}: {exc})", version)
    return _ask(torch_npu)


@hookimpl
def devgraph_register_backends(register: Callable[[Any], None]) -> None:
    register(BackendSpec("npu", probe, "devgraph.backends.npu._device:NpuDevice", builtin=True))


@hookimpl
def devgraph_register_op_kernels(register: Callable[..., None]) -> None:
    from devgraph.backends.npu import _kernels

    _kernels.register_all(register)


@hookimpl
def devgraph_register_compilers(register: Callable[..., None], device: Any) -> None:
    """torchair, for pieces captured on an NPU (refused there, naming why: see ``_compilers``)."""
    if getattr(device, "name", None) == "npu":
        from devgraph.backends.npu._compilers import torchair

        register("torchair", torchair, opaque=True)
