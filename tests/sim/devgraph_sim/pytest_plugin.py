"""pytest fixtures of devgraph_sim.

Enable them with ``pytest_plugins = ["devgraph_sim.pytest_plugin"]`` in a top-level
``conftest.py`` (or ``-p devgraph_sim.pytest_plugin`` on the command line).
"""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest

__all__ = ["npu_sim"]


@pytest.fixture
def npu_sim() -> Iterator[ModuleType]:
    """The torch_npu simulator, installed for the test; yields the fake ``torch_npu`` module.

    Inside the test ``devgraph.device("npu")`` is the NPU backend on the simulator.
    """
    from devgraph_sim.npu import simulated_torch_npu

    with simulated_torch_npu() as torch_npu:
        yield torch_npu
