"""CUDA backend plugin (registration only; the implementation loads on first use).

The probe is cheap and never raises: it asks torch whether it is a CUDA build and how many GPUs
are visible, and never creates a CUDA context (``torch.cuda.device_count()`` does not), so
``devgraph.list_backends()`` is safe to call before a fork.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from devgraph._hookspecs import hookimpl
from devgraph._plugins import BackendSpec, Probe

__all__ = ["devgraph_register_backends", "devgraph_register_op_kernels", "probe"]


def probe() -> Probe:
    """Whether a CUDA GPU can be used here, and why not."""
    try:
        import torch
    except Exception as exc:  # torch missing, or broken by a device plugin (torch_npu without CANN)
        return Probe(False, f"torch is not importable ({type(exc).__name__}: {exc})")
    cuda_version = getattr(torch.version, "cuda", None)
    hip_version = getattr(torch.version, "hip", None)  # ROCm builds drive AMD GPUs through torch.cuda
    if cuda_version is None and hip_version is None:
        return Probe(
            False,
            f"torch {torch.__version__} is a CPU-only build; install a CUDA build of torch to use cuda",
        )
    version = (
        f"torch {torch.__version__}, CUDA {cuda_version}"
        if cuda_version is not None
        else f"torch {torch.__version__}, ROCm {hip_version}"
    )
    try:
        count = torch.cuda.device_count()  # does not initialise a CUDA context
    except Exception as exc:
        return Probe(False, f"torch.cuda.device_count() failed ({type(exc).__name__}: {exc})", version)
    if count == 0:
        return Probe(False, "no CUDA GPU visible (check the driver and CUDA_VISIBLE_DEVICES)", version)
    return Probe(True, f"{count} CUDA GPU(s)", version, count)


@hookimpl
def devgraph_register_backends(register: Callable[[Any], None]) -> None:
    register(BackendSpec("cuda", probe, "devgraph.backends.cuda._device:CudaDevice", builtin=True))


@hookimpl
def devgraph_register_op_kernels(register: Callable[..., None]) -> None:
    from devgraph.backends.cuda import _kernels

    _kernels.register_all(register)
