"""``Graph.update`` / ``replay(host_args)`` with a name that is not a host argument of the graph's tasks.

A tensor argument of an updatable op (``seq_lens``, next to the host list ``seq_lens_host``) is read
where it was at capture: an update cannot replace it. Every backend refuses such a name with a
``DevgraphError`` that names it and lists the valid host arguments (the check is ``apply_host_args``,
which the CPU reference, the NPU backend and CUDA's note-only replay all go through), before any
task is re-issued with a list where the op takes a tensor (torch's schema error).
"""

from __future__ import annotations

import pytest
import torch

import devgraph
import devgraph.ops as ops
from devgraph import DevgraphError
from devgraph.backends.cpu._device import CpuDevice, CpuGraph
from devgraph.backends.cuda._device import DeviceMetadataGraph
from devgraph.graph import BreakableGraph

OP = "devgraph::paged_decode_attention"
HOST_NAMES = ["logits_soft_cap", "scale", "seq_lens_host", "sliding_window"]


class _NotesHostArgs(DeviceMetadataGraph, CpuGraph):
    """CUDA's replay(host_args) path (values only noted, nothing re-issued) over the CPU reference."""

    def _needs_reissue(self, group) -> bool:
        return False


class _NotesHostArgsDevice(CpuDevice):
    def graph(self, keep_graph: bool = False):
        return _NotesHostArgs(self, keep_graph)


@pytest.fixture(params=["cpu", "npu-sim", "cuda-path"])
def device(request):
    if request.param == "cpu":
        yield devgraph.device("cpu")
    elif request.param == "cuda-path":
        yield _NotesHostArgsDevice()
    else:
        from devgraph_sim.npu import simulated_torch_npu

        with simulated_torch_npu():
            yield devgraph.device("npu")


def _captured(device):
    dtype = torch.bfloat16 if device.name.startswith("npu") else torch.float32
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 8, generator=g).to(dtype)
    k = torch.randn(8, 16, 2, 8, generator=g).to(dtype)
    v = torch.randn(8, 16, 2, 8, generator=g).to(dtype)
    table = torch.arange(1, 5, dtype=torch.int32).view(2, 2)
    seq = torch.tensor([5, 9], dtype=torch.int32)
    out = torch.empty_like(q)
    graph = device.graph()
    with graph.capture(auto_update_ops=[OP]):
        ops.paged_decode_attention(q, k, v, table, seq, [5, 9], 0.5, out)
    graph.keep = (q, k, v, table, seq, out)  # tasks hold their tensors weakly
    return graph


@pytest.mark.parametrize("how", ["update", "replay"])
def test_a_tensor_argument_given_as_a_host_argument_is_refused_by_name(device, how):
    graph = _captured(device)
    with pytest.raises(DevgraphError) as info:
        if how == "update":
            graph.update({"seq_lens": [3, 11]})
        else:
            graph.replay(host_args={"seq_lens": [3, 11]})
    message = str(info.value)
    assert "['seq_lens']" in message and "tensor argument" in message
    assert str(HOST_NAMES) in message  # the valid names, listed
    graph.replay(host_args={"seq_lens_host": [3, 11]})  # the graph still works
    assert graph.tasks[0].host_args["seq_lens_host"] == [3, 11]


def test_an_unknown_name_lists_the_host_arguments(device):
    graph = _captured(device)
    with pytest.raises(DevgraphError, match=r"\['lens'\].*host arguments are \['logits_soft_cap'"):
        graph.update({"lens": [3, 11]})


def test_the_per_task_form_names_the_tasks_host_arguments(device):
    graph = _captured(device)
    with pytest.raises(DevgraphError, match=r"takes no host argument\(s\) \['seq_lens'\].*'seq_lens_host'"):
        graph.update([{"seq_lens": [3, 11]}])


def test_a_task_lists_only_its_host_arguments():
    (task,) = _captured(devgraph.device("cpu")).tasks
    assert sorted(task.host_names) == HOST_NAMES
    assert "seq_lens" in task.argument_names and not task.takes("seq_lens")
    assert task.takes("seq_lens_host")


def test_a_breakable_graph_refuses_a_tensor_argument_of_its_tasks():
    dev = devgraph.device("cpu")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 8, generator=g)
    k = torch.randn(8, 16, 2, 8, generator=g)
    v = torch.randn(8, 16, 2, 8, generator=g)
    table = torch.arange(1, 5, dtype=torch.int32).view(2, 2)
    seq = torch.tensor([5, 9], dtype=torch.int32)
    bg = BreakableGraph(dev)
    with torch.no_grad(), bg.capture(auto_update_ops=[OP], host_args={"seq_lens_host": [5, 9]}):
        out = (q * 2).contiguous()
        ops.paged_decode_attention(q, k, v, table, seq, [5, 9], 0.5, out)
    with pytest.raises(DevgraphError, match=r"\['seq_lens'\]"):
        bg.replay(host_args={"seq_lens": [3, 11]})
