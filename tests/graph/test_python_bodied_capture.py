"""Python-bodied custom ops inside a capture: the capture sees what their body launches.

An engine's attention is often a ``torch.library`` op with a Python body that reads live state
(vLLM's forward context) and calls the real kernel. Captured on a device, what the body launched is
what replays; so an updatable op inside the body must become a task (its host arguments updated at
replay), and a host sync inside it must be refused, as if it were called directly.
"""

from __future__ import annotations

import pytest
import torch

import devgraph.ops as ops
from devgraph import CaptureError

OP = "devgraph::paged_decode_attention"
_STATE = {"lens": [5, 9]}  # what the body reads: a stand-in for an engine's forward context


@torch.library.custom_op("devgraph_test::engine_attention", mutates_args=())
def engine_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, seq: torch.Tensor
) -> torch.Tensor:
    return ops.paged_decode_attention(q, k, v, table, seq, list(_STATE["lens"]))


@torch.library.custom_op("devgraph_test::syncing_body", mutates_args=())
def syncing_body(x: torch.Tensor) -> torch.Tensor:
    return x * float(x.sum().item())


@torch.library.custom_op("devgraph_test::listing_body", mutates_args=())
def listing_body(x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    # transformers' grouped_mm fallback does this: split by offsets read on the host
    parts = torch.split(x, offs.tolist())
    return torch.cat([p * (i + 1) for i, p in enumerate(parts)])


def _case(dev):
    # bfloat16 on the NPU (Ascend's attention takes no float32), float32 on the reference
    dtype = torch.float32 if str(dev).startswith("cpu") else torch.bfloat16
    device = dev.torch_device
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 8, generator=g)
    k = torch.randn(5, 16, 2, 8, generator=g)  # blocks of 16 tokens (Ascend's paged attention rule)
    v = torch.randn(5, 16, 2, 8, generator=g)
    table = torch.arange(1, 5, dtype=torch.int32).view(2, 2)
    seq = torch.tensor([5, 9], dtype=torch.int32)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    return [t.to(device) for t in (q, k, v, table, seq)]


def test_updatable_op_inside_a_python_bodied_op_is_a_task(any_device):
    _STATE["lens"] = [5, 9]
    q, k, v, table, seq = _case(any_device)
    engine_attention(q, k, v, table, seq)  # warm-up (CUDA: cuDNN plans its SDPA on first use)
    graph = any_device.graph()
    with graph.capture(auto_update_ops=[OP]):
        out = engine_attention(q, k, v, table, seq)
    assert [t.op for t in graph.tasks] == [OP]
    assert graph.tasks[0].host_args["seq_lens_host"] == [5, 9]

    seq.copy_(torch.tensor([3, 11], dtype=torch.int32))
    graph.replay(host_args={"seq_lens_host": [3, 11]})
    any_device.synchronize()
    expected = ops.paged_decode_attention(q, k, v, table, seq, [3, 11])
    torch.testing.assert_close(out, expected)
    if any_device.name != "cuda":  # CUDA's kernel reads the lengths from ``seq`` (DEVICE_METADATA_OPS)
        stale = ops.paged_decode_attention(q, k, v, table, seq, [5, 9])
        assert not torch.allclose(out, stale)


def test_host_sync_inside_a_python_bodied_op_is_refused(any_device):
    x = torch.ones(4, device=any_device.torch_device)
    graph = any_device.graph()
    with pytest.raises(CaptureError, match=r"_local_scalar_dense|item"):
        with graph.capture():
            syncing_body(x)


def test_host_read_inside_a_python_bodied_op_is_refused(any_device):
    # .tolist() is seen by the host-sync check (a function mode), which torch takes off the stack
    # for the outer op: the capture must put it back, or the offsets would be frozen silently.
    x = torch.ones(6, device=any_device.torch_device)
    offs = torch.tensor([2, 4], device=any_device.torch_device)
    graph = any_device.graph()
    with pytest.raises(CaptureError, match="tolist"):
        with graph.capture():
            listing_body(x, offs)
