"""What differs between the CPUs CI may land on, reproducible on any one of them.

Two ways kernels differ by machine, and how the tests reproduce each here:

* **The instruction set.** ``ATEN_CPU_CAPABILITY=avx2`` makes ATen and inductor pick their AVX2 kernels on
  an AVX-512 machine. Inductor's on-disk cache does not key its compiled kernels on that choice (torch
  2.13): a kernel compiled under one capability and loaded under the other computed wrong values (8.9
  off in a bf16 test model) or corrupted the heap, measured here. ``inductor_cache_dir`` gives each
  capability its own cache, so a run under one never loads the other's kernels.
* **GEMMs that round by row count.** oneDNN picks another float32 kernel by the number of rows on some
  CPUs (an AMD EPYC: 3 rows and the same 3 padded to 4 differ by 2.4e-7); cuBLAS does on GPUs. An Intel
  machine may round 3 and 4 rows alike. ``DEVGRAPH_TEST_ROW_VARIANT_GEMM=1`` makes every float32 CPU
  ``mm``/``addmm`` round by row count on any machine (rows not a multiple of 4 accumulate in float64,
  then round: a last-bit difference, as the real kernels give), so a test that needs bit equality
  across row counts fails here as it would there. Tests-only: it overrides two aten CPU kernels in the
  test process, which devgraph itself never does.
"""

from __future__ import annotations

import os
import tempfile

import torch

ROW_VARIANT_GEMM = os.environ.get("DEVGRAPH_TEST_ROW_VARIANT_GEMM") == "1"


def inductor_cache_dir() -> str:
    """A cache folder of inductor's per CPU capability and test thread count (``TORCHINDUCTOR_CACHE_DIR``,
    unless set): torch 2.13's cache keys neither (its CPU kernels may specialise on the thread count too:
    pytorch#184444)."""
    capability = os.environ.get("ATEN_CPU_CAPABILITY", "default") or "default"
    threads = os.environ.get("DEVGRAPH_TEST_THREADS", "1")
    return os.path.join(tempfile.gettempdir(), f"devgraph-tests-inductor-{capability}-t{threads}")


def _variant(a: torch.Tensor) -> bool:
    """Whether this call rounds otherwise: a float32 product whose row count is not a multiple of 4."""
    return a.dtype == torch.float32 and a.shape[0] % 4 != 0


# The overrides compute through the batched kernels (not overridden), which round as mm/addmm do
# for every other call: only the variant calls change.
def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if _variant(a):
        return torch.bmm(a.double()[None], b.double()[None])[0].float()
    return torch.bmm(a[None], b[None])[0]


def _addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    if _variant(a):
        product = torch.bmm(a.double()[None], b.double()[None])[0]
        return (product * alpha + bias.double() * beta).float()
    return torch.baddbmm(bias.expand(a.shape[0], b.shape[1])[None], a[None], b[None], beta=beta, alpha=alpha)[
        0
    ]


_LIBRARY = None


def install_row_variant_gemm() -> None:
    """Override aten's CPU ``mm`` and ``addmm`` with the row-count-rounding versions (once)."""
    global _LIBRARY
    if _LIBRARY is not None:
        return
    import warnings

    _LIBRARY = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel": intended
        _LIBRARY.impl("mm", _mm, "CPU")
        _LIBRARY.impl("addmm", _addmm, "CPU")
