"""The host-sync check every backend's capture runs under."""

from __future__ import annotations

import pytest
import torch

import devgraph
from devgraph import CaptureError


def _capture(fn):
    graph = devgraph.device("cpu").graph()
    with graph.capture():
        return fn()


@pytest.mark.parametrize(
    ("op", "fn"),
    [
        ("Tensor.item", lambda x: x.sum().item()),
        ("Tensor.tolist", lambda x: x.tolist()),
        ("Tensor.cpu", lambda x: x.cpu()),
        ("Tensor.numpy", lambda x: x.numpy()),
        ("Tensor.__bool__", lambda x: bool(x.sum() > 0)),
        ("Tensor.__int__", lambda x: int(x[0])),
        ("aten::nonzero", lambda x: torch.nonzero(x)),
        ("aten::masked_select", lambda x: torch.masked_select(x, x > 0)),
    ],
)
def test_host_syncs_raise_capture_error_naming_the_op(op, fn):
    x = torch.randn(4)
    with pytest.raises(CaptureError) as info:
        _capture(lambda: fn(x))
    assert info.value.op == op
    assert "test_capture_check.py" in info.value.source
    assert info.value.remedy


def test_same_device_to_is_not_a_host_copy():
    x, table = torch.randn(4), torch.randn(4)
    out = _capture(lambda: x * table.to(x.device) + table.to(device="cpu", dtype=torch.float32))
    torch.testing.assert_close(out, x * table + table)


def test_capture_error_message_lists_op_line_and_remedy():
    x = torch.randn(4)
    with pytest.raises(CaptureError) as info:
        _capture(lambda: x.sum().item())
    text = str(info.value)
    assert "op: Tensor.item" in text and "at: " in text and "remedy: " in text


def test_check_is_only_active_inside_capture():
    x = torch.randn(4)
    _capture(lambda: x + 1)
    assert isinstance(x.sum().item(), float)
    assert devgraph.graph._contract.current_graph() is None


@pytest.mark.parametrize("factory", [torch.tensor, torch.as_tensor])
def test_python_data_copied_to_the_device_inside_capture_is_refused(factory):
    x = torch.randn(2)
    with pytest.raises(CaptureError) as info:
        _capture(lambda: x + factory([1.0, 2.0]))
    assert info.value.op == f"torch.{factory.__name__}" and "before capture" in info.value.remedy


def test_python_scalars_as_0d_tensors_are_allowed():
    x = torch.randn(2)
    out = _capture(lambda: x * torch.tensor(3.0))
    torch.testing.assert_close(out, x * 3)


@pytest.mark.parametrize(
    ("op", "fn"),
    [
        ("Tensor.item", lambda x: x.sum().item()),
        ("Tensor.tolist", lambda x: x.tolist()),
        ("Tensor.__bool__", lambda x: bool(x.sum() > 0)),
        ("aten::nonzero", lambda x: torch.nonzero(x)),
        ("aten::_local_scalar_dense", lambda x: torch.nn.functional.one_hot(x.long().abs(), num_classes=9)),
    ],
)
def test_host_sync_check_refuses_what_a_capture_refuses_while_running_eagerly(op, fn):
    from devgraph.graph import host_sync_check

    x = torch.randn(4)
    with pytest.raises(CaptureError) as info, host_sync_check("cpu"):
        fn(x)
    assert info.value.op == op and "test_capture_check.py" in info.value.source
    with pytest.raises(CaptureError) as captured:
        _capture(lambda: fn(x))
    assert captured.value.op == op  # the same refusal as a capture's


def test_host_sync_check_runs_the_block_eagerly_and_captures_nothing():
    from devgraph.graph import host_sync_check

    x = torch.randn(4)
    with host_sync_check("cpu"):
        out = x * 2 + 1
        assert devgraph.graph.current_graph() is None
    torch.testing.assert_close(out, x * 2 + 1)
    assert isinstance(x.sum().item(), float)  # the check is gone after the block
    with host_sync_check("cuda"):  # another device's check: reading a host tensor made here is no sync
        assert torch.ones(3).sum().item() == 3.0
    with pytest.raises(CaptureError, match="made before capture"), host_sync_check("cuda"):
        x.sum()  # ...but host compute from one made before would be frozen in a cuda graph: refused
    with torch.autocast("cpu"), host_sync_check("cpu"):  # autocast is where a capture runs, not the code
        torch.mm(x[None], x[:, None])
