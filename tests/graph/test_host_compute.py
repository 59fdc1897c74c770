"""Host computation inside a device capture (devgraph.graph._host_compute): refused where frozen.

A device graph records device work only: an op over CPU tensors runs once, at capture, and a replay
reuses its result. The unit tests drive the check as a device capture's dispatch mode does (the
``meta`` device stands in for a device here); on a GPU, ``any_device``'s cuda parameter captures the
real thing (a model left on the CPU, a host counter) and must see the refusal. The CPU reference and
the NPU simulator compute on the CPU and record it: nothing is refused there.
"""

from __future__ import annotations

import pytest
import torch

import devgraph
from devgraph import CaptureError, DevgraphError
from devgraph.graph import BreakableGraph
from devgraph.graph._host_compute import HostCompute

aten = torch.ops.aten


def test_a_host_op_over_a_pre_capture_cpu_tensor_is_refused_by_name():
    check = HostCompute("meta")
    weight = torch.randn(4, 4)  # made before the capture: the caller may change it
    x = torch.randn(2, 4)
    with pytest.raises(CaptureError, match=r"aten::mm computes on the CPU from a CPU tensor \(2, 4\)") as err:
        check.check(aten.mm.default, (x, weight), {}, x @ weight)
    assert "meta graph records device work only" in str(err.value)
    assert "test_host_compute.py" in (err.value.source or "")
    assert "model.to(device)" in (err.value.remedy or "")


def test_host_ops_over_tensors_made_inside_the_capture_pass():
    check = HostCompute("meta")
    made = torch.arange(6)
    check.check(aten.arange.default, (6,), {}, made)  # a factory: no pre-capture tensor read
    doubled = made * 2
    check.check(aten.mul.Tensor, (made, 2), {}, doubled)  # reads only what the capture made
    check.check(aten.view.default, (doubled, [2, 3]), {}, doubled.view(2, 3))


def test_a_result_on_the_device_passes_and_views_pass():
    check = HostCompute("meta")
    pinned_like = torch.randn(3)  # e.g. a host buffer uploaded each replay: the copy is device work
    check.check(aten._to_copy.default, (pinned_like,), {"device": "meta"}, torch.empty(3, device="meta"))
    scale = torch.tensor(0.5)  # 0-d, given to a device kernel: a kernel scalar
    check.check(aten.mul.Tensor, (torch.empty(3, device="meta"), scale), {}, torch.empty(3, device="meta"))
    check.check(aten.select.int, (pinned_like, 0, 1), {}, pinned_like[1])  # a view computes nothing
    with pytest.raises(CaptureError, match="aten::add"):  # computing on it on the host does
        check.check(aten.add.Tensor, (scale, 1), {}, scale + 1)


def test_an_in_place_update_of_a_host_counter_is_refused():
    check = HostCompute("meta")
    counter = torch.zeros(2, dtype=torch.long)
    with pytest.raises(CaptureError, match="aten::add_"):
        check.check(aten.add_.Tensor, (counter, 1), {}, counter.add_(1))


def test_the_reference_records_host_ops_and_refuses_nothing(any_device):
    if any_device.torch_device.type != "cpu":
        pytest.skip("a device graph: see test_a_model_left_on_the_cpu_is_refused_on_a_device")
    weight = torch.randn(4, 4)
    x = torch.randn(2, 4)
    graph = any_device.graph()
    with graph.capture():
        y = x @ weight
    x.copy_(torch.ones(2, 4))
    graph.replay()
    torch.testing.assert_close(y, torch.ones(2, 4) @ weight)


def test_a_model_left_on_the_cpu_is_refused_on_a_device(any_device):
    if any_device.torch_device.type == "cpu":
        pytest.skip("the CPU reference and the NPU simulator record host ops")
    weight = torch.randn(4, 4)  # left on the CPU
    x = torch.randn(2, 4)
    graph = any_device.graph()
    with pytest.raises(CaptureError, match="computes on the CPU"), graph.capture():
        x @ weight
    bg = BreakableGraph(any_device, breaks=["aten::scaled_dot_product_attention"])
    with pytest.raises(CaptureError, match="computes on the CPU"), bg.capture():
        x @ weight


def test_wrap_refuses_a_model_left_on_the_cpu_for_a_device():
    from devgraph._wrap import refuse_host_weights

    with pytest.raises(
        DevgraphError, match=r"Linear's parameter 'weight' is on the CPU.*model\.to\('meta'\)"
    ):
        refuse_host_weights(torch.nn.Linear(2, 2), torch.device("meta"))
    model = torch.nn.Linear(2, 2).to("meta")
    model.register_buffer("table", torch.zeros(3))  # a buffer left behind
    with pytest.raises(DevgraphError, match="buffer 'table' is on the CPU"):
        refuse_host_weights(model, torch.device("meta"))
    refuse_host_weights(torch.nn.Linear(2, 2), torch.device("cpu"))  # the reference: nothing to refuse
    refuse_host_weights(torch.nn.Linear(2, 2).to("meta"), torch.device("meta"))


def test_wrap_of_a_cpu_model_for_a_device_is_refused_at_wrap(any_device):
    if any_device.torch_device.type == "cpu":
        pytest.skip("the CPU reference and the NPU simulator hold models on the CPU")
    with pytest.raises(DevgraphError, match="is on the CPU"):
        devgraph.wrap(torch.nn.Linear(4, 4), device=any_device)


def test_a_breakable_capture_shares_what_its_segments_made():
    from devgraph.graph._host_compute import for_capture, shared_across

    assert for_capture("cpu") is None  # the reference records host ops
    with shared_across("meta"):  # what BreakableGraph.capture opens around its segments
        first, second = for_capture("meta"), for_capture("meta")
        assert first is second
        made = torch.arange(4)
        first.check(aten.arange.default, (4,), {}, made)
        second.check(aten.mul.Tensor, (made, 2), {}, made * 2)  # made by an earlier segment: allowed
    assert for_capture("meta") is not for_capture("meta")  # plain captures: one record each
