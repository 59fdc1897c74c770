"""The adapter's FULL wrapper on the asynchronous NPU simulator, stepped as vLLM's async scheduling
steps it: each step's replay is queued right after the previous one, with new host sequence lengths,
and the host never synchronises the device in between.

What it covers: ``DevgraphGraphWrapper`` (FULL) under vLLM's own forward context and capture switch,
``step_host_args`` and devgraph's backend-neutral ``Graph.replay(host_args=...)`` on the real NPU
backend over the simulated torch_npu (lazy streams: a stream runs only when something waits on it,
so a missing wait shows as a wrong sum or a hang). It does not run vLLM's engine on the simulator.
"""

from __future__ import annotations

import pytest
import torch
from _fake_engine import AttentionModel, platform_on, step, vllm_config

import devgraph
from devgraph.backends.npu._device import NpuGraph
from devgraph_sim.npu import simulated_torch_npu
from devgraph_sim.npu._streams import SimulatedHang

CAPTURED = [5, 9]
STEPS = [[30, 3], [1, 17], [12, 12], [31, 2], [7, 25]]


def _async_steps(device, sim):
    """Capture at CAPTURED, then run STEPS back to back; return (model, device syncs during steps)."""
    from vllm.config import CUDAGraphMode

    from devgraph.adapters.vllm import reset_stats, stats
    from devgraph.adapters.vllm._wrapper import DevgraphGraphWrapper

    config = vllm_config()
    model = AttentionModel(torch.bfloat16)
    wrapper = DevgraphGraphWrapper(model, config, runtime_mode=CUDAGraphMode.FULL)
    step(wrapper, model, config, CAPTURED, capture=True)
    device.synchronize()
    model.acc.zero_()  # the capture ran the work once
    reset_stats()
    syncs = []
    real_sync = sim.npu.synchronize
    sim.npu.synchronize = lambda *a: (syncs.append(a), real_sync(*a))[1]
    try:
        for lens in STEPS:
            step(wrapper, model, config, lens)
    finally:
        sim.npu.synchronize = real_sync
    counted = stats()
    assert counted["replay.FULL"] == counted["update.FULL"] == len(STEPS)
    device.synchronize()
    return model, syncs


@pytest.fixture(params=["overlap", "serial"])
def npu(request):
    with simulated_torch_npu(streams="lazy", hang_timeout=0.2) as sim:
        device = devgraph.device("npu")
        device.update_order = request.param
        with platform_on("npu"):
            yield device, sim


def test_async_steps_each_replay_with_their_own_lengths_without_a_device_sync(npu):
    device, sim = npu
    model, syncs = _async_steps(device, sim)
    assert syncs == []  # no device-wide synchronize per step
    want = sum((model.expected(lens) for lens in STEPS), torch.zeros_like(model.acc))
    torch.testing.assert_close(model.acc, want, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("wait", ["_fence_update_stream", "_release_updated"])
def test_removing_a_wait_is_caught(npu, monkeypatch, wait):
    device, sim = npu
    monkeypatch.setattr(NpuGraph, wait, lambda self, *args, **kwargs: None)
    with pytest.raises((AssertionError, SimulatedHang)):
        model, _ = _async_steps(device, sim)
        want = sum((model.expected(lens) for lens in STEPS), torch.zeros_like(model.acc))
        torch.testing.assert_close(model.acc, want, atol=5e-2, rtol=5e-2)
