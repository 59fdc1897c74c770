"""The host-sync guard every backend's capture runs under."""

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
    assert "test_capture_guard.py" in info.value.source
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


def test_guard_is_only_active_inside_capture():
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
