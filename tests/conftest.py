from __future__ import annotations

import os

import pytest

pytest_plugins = ["devgraph_sim.pytest_plugin"]

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import torch  # noqa: E402  (after the env var above)
from _machines import ROW_VARIANT_GEMM, inductor_cache_dir, install_row_variant_gemm  # noqa: E402

# Inductor's cache does not tell kernels compiled for one CPU capability from another's: each
# ATEN_CPU_CAPABILITY gets its own (tests/_machines.py). Set before anything compiles; inherited by
# the processes tests start.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", inductor_cache_dir())
if ROW_VARIANT_GEMM:
    install_row_variant_gemm()

# One intra-op thread per xdist worker: with -n 2 on 2 cores, torch's default of one thread per
# core oversubscribes the machine and makes small ops ~10x slower.
torch.set_num_threads(int(os.environ.get("DEVGRAPH_TEST_THREADS", "1")))


#: Test files whose tests start processes (ranks over gloo, the GPU one-shot script's dry run, the
#: benchmark scripts): marked ``processes``; ``nox -s tests`` leaves them to ``nox -s tests-processes``
#: to stay within 10 minutes on 2 cores.
PROCESS_TEST_FILES = frozenset(
    {
        "test_gpu_oneshot.py",
        "test_benchmarks.py",
        "test_distributed.py",
        "test_rank_agreement.py",
        "test_distributed_harness.py",
        "test_breakable_collectives.py",
        "test_collectives_capture.py",
    }
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in PROCESS_TEST_FILES:
            item.add_marker(pytest.mark.processes)


@pytest.fixture(autouse=True)
def _fresh_dynamo_caches():
    """Each test starts with Dynamo's caches empty. Every ``TracedModule`` (``devgraph.wrap`` in
    mode='full') is compiled through one frame Dynamo shares (torch's ``external_utils.inner``), whose
    cache gives up after ``recompile_limit`` (8) entries: without this, a wrap in a test would run
    eagerly or be graphed depending on how many models tests before it in the same worker wrapped.
    tests/test_dynamo_frontend.py::test_more_wrapped_models_than_dynamos_recompile_limit_are_graphed
    holds the defect itself (strict xfail) until the front end compiles a frame of its own per model."""
    torch._dynamo.reset()
    yield


@pytest.fixture
def fresh_plugins():
    """Forget loaded plugins before and after a test that changes what is installed."""
    from devgraph import _plugins

    _plugins._reset_for_tests()
    yield
    _plugins._reset_for_tests()


def _device_params():
    params: list = ["cpu", "npu-sim"]
    if torch.cuda.is_available():  # a lent GPU (tools/gpu_oneshot.sh runs these with -m cuda)
        params.append(pytest.param("cuda", marks=pytest.mark.cuda))
    return params


@pytest.fixture(params=_device_params())
def any_device(request):
    """Every backend CI can run: the CPU reference and the NPU backend over the torch_npu simulator;
    and CUDA where a GPU is visible (marked ``cuda``)."""
    import devgraph

    if request.param in ("cpu", "cuda"):
        yield devgraph.device(request.param)
        return
    from devgraph_sim.npu import simulated_torch_npu

    with simulated_torch_npu():
        yield devgraph.device("npu")
