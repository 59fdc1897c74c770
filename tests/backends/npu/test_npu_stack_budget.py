"""The NPU backend declares its stack's cap on capture sizes; the piecewise planner keeps within it."""

from __future__ import annotations

import pytest
import torch

import devgraph
from devgraph import DevgraphError
from devgraph.testing.models import DecoderConfig, KVBlockManager, make_decoder
from devgraph_sim.npu import simulated_torch_npu


@pytest.fixture
def sim(monkeypatch):
    monkeypatch.delenv("DEVGRAPH_NPU_MAX_CAPTURE_SIZES", raising=False)
    with simulated_torch_npu() as torch_npu:
        yield torch_npu


def _named(monkeypatch, sim, name):
    monkeypatch.setattr(sim.npu, "get_device_name", lambda device_name=None: name, raising=False)
    from devgraph import _plugins

    _plugins.forget_devices("npu")
    return devgraph.device("npu")


def test_an_ascend_950_declares_four_sizes(sim, monkeypatch):
    assert _named(monkeypatch, sim, "Ascend950PR").max_capture_sizes == 4


def test_other_stacks_declare_no_cap_and_the_stream_rule_is_the_fallback(sim, monkeypatch):
    npu = _named(monkeypatch, sim, "Ascend910B3")
    assert npu.max_capture_sizes is None
    assert npu.capture_stream_budget == 2048
    # The simulator has no get_device_name: no name, no cap.
    from devgraph import _plugins

    monkeypatch.delattr(sim.npu, "get_device_name")
    _plugins.forget_devices("npu")
    assert devgraph.device("npu").max_capture_sizes is None


def test_the_cap_is_configurable(sim, monkeypatch):
    monkeypatch.setenv("DEVGRAPH_NPU_MAX_CAPTURE_SIZES", "7")
    assert _named(monkeypatch, sim, "Ascend950PR").max_capture_sizes == 7  # configured beats probed
    monkeypatch.setenv("DEVGRAPH_NPU_MAX_CAPTURE_SIZES", "zero")
    from devgraph import _plugins

    _plugins.forget_devices("npu")
    with pytest.raises(DevgraphError, match="DEVGRAPH_NPU_MAX_CAPTURE_SIZES must be a positive integer"):
        devgraph.device("npu")


def test_piecewise_capture_keeps_to_the_stacks_cap(sim, monkeypatch):
    npu = _named(monkeypatch, sim, "Ascend950PR")
    config = DecoderConfig(num_layers=1, dtype=torch.bfloat16)
    model = make_decoder(config, device=npu.torch_device)
    reference = make_decoder(config, device=npu.torch_device)
    sizes = [1, 2, 4, 8, 16, 32]
    graphed = devgraph.wrap(model, device=npu, mode="piecewise", capture_sizes=sizes)
    manager = KVBlockManager(config, device=npu.torch_device)
    batch = manager.decode_batch([0, 1, 2], [3, 4, 5])
    torch.testing.assert_close(graphed(**batch), reference(**batch))
    stats = graphed.stats
    # 2 pieces per size leave the 2048-stream rule room for all six; the 950's cap keeps four.
    assert len(stats.captured_sizes) == 4 and stats.captured_sizes[-1] == 32
    assert set(stats.captured_sizes) | set(stats.dropped_sizes) == set(sizes)
    assert graphed.runner.pieces.plan.max_sizes == 4
