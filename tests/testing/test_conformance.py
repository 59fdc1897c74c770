"""The backend conformance suite over every backend CI can run (cpu, npu via the simulator), and
the contract's refusal of pools every graph let go of (beyond the reset that the suite checks)."""

from __future__ import annotations

import gc

import pytest
import torch

import devgraph
from devgraph.testing.conformance import CHECKS, NotApplicable


def _available():
    return [b.name for b in devgraph.list_backends() if b.available]


def _run(check, device) -> None:
    """Runs one conformance check on ``device``; a check that does not apply there is a skip."""
    try:
        check(device)
    except NotApplicable as why:
        pytest.skip(str(why))


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_conformance(any_device, check):
    _run(check, any_device)


@pytest.mark.parametrize("backend", [n for n in _available() if n != "cpu"])
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_conformance_on_other_available_backends(backend, check):
    """cuda on a GPU machine, a real npu, or an installed third-party backend."""
    _run(check, devgraph.device(backend))


# -- pools let go of by every graph (DESIGN.md, contract point 6) -------------------------------------


def _captured_into(device, pool):
    x = torch.ones(8, device=device.torch_device)
    graph = device.graph()
    with graph.capture(pool=pool):
        x + 1
    return graph


def test_pool_of_a_freed_graph_is_refused(any_device):
    pool = any_device.pool()
    graph = _captured_into(any_device, pool)
    del graph
    gc.collect()
    with pytest.raises(devgraph.DevgraphError, match=r"device\.pool\(\)"):
        _captured_into(any_device, pool)


def test_pool_of_a_failed_capture_is_refused(any_device):
    pool = any_device.pool()
    x = torch.ones(8, device=any_device.torch_device)
    with pytest.raises(devgraph.CaptureError):
        with any_device.graph().capture(pool=pool):
            x.sum().item()
    with pytest.raises(devgraph.DevgraphError, match=r"device\.pool\(\)"):
        _captured_into(any_device, pool)


def test_pool_held_by_one_graph_takes_more_captures(any_device):
    pool = any_device.pool()
    holder = _captured_into(any_device, pool)
    for _ in range(2):
        _captured_into(any_device, pool).reset()
    assert holder.is_captured()


# -- the accelerator backend (torch.accelerator.Graph) on its stand-in -------------------------------------


@pytest.fixture
def standin_device():
    """The accelerator backend over the torch.accelerator stand-in of tests/sim (no XPU here)."""
    from devgraph.backends.accelerator._device import AcceleratorDevice
    from devgraph_sim.accelerator import standin_accelerator

    with standin_accelerator(hang_timeout=0.5) as api:
        yield AcceleratorDevice(0, api=api)


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_conformance_of_the_accelerator_backend_on_its_standin(standin_device, check):
    _run(check, standin_device)
