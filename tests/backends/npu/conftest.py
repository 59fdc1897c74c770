"""Fixtures of the NPU backend's tests: the backend on devgraph's torch_npu simulator (tests/sim)."""

from __future__ import annotations

import pytest

import devgraph
from devgraph_sim.npu import simulated_torch_npu


@pytest.fixture
def sim():
    """The simulator for the test (a hang raises after 0.2 s); yields the fake ``torch_npu``."""
    with simulated_torch_npu(hang_timeout=0.2) as torch_npu:
        yield torch_npu


@pytest.fixture
def npu(sim):
    """``devgraph.device("npu")``: devgraph's NPU backend on the simulator."""
    return devgraph.device("npu")
