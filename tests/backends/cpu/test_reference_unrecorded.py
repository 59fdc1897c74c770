"""Ops the reference cannot record are refused at capture, never skipped at replay.

The CPU reference (and the torch_npu simulator, which records the same way) records what reaches
PyTorch's dispatcher. A kernel registered as ``CompositeImplicitAutograd`` that computes by itself
(vLLM's CPU kernels are such C++ functions), or any kernel writing memory directly, launches nothing
the dispatcher sees: a replay would skip it silently. Here the kernel writes through ``ctypes`` as a
C++ kernel would; the same computation registered as a CPU kernel is recorded and replays right.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from devgraph import CaptureError
from devgraph.graph import BreakableGraph

_LIB = torch.library.Library("devgraph_unrec_test", "DEF")
_LIB.define("write_rows(Tensor(a!) cache, Tensor x) -> ()")
_LIB.define("write_rows_cpu(Tensor(a!) cache, Tensor x) -> ()")


def _write_directly(cache: torch.Tensor, x: torch.Tensor) -> None:
    """Copy ``x`` into the first rows of ``cache`` by address: no op reaches the dispatcher."""
    ctypes.memmove(cache.data_ptr(), x.data_ptr(), x.numel() * x.element_size())


_LIB.impl("write_rows", _write_directly, "CompositeImplicitAutograd")


def _write_with_ops(cache: torch.Tensor, x: torch.Tensor) -> None:
    cache[: x.shape[0]].copy_(x)


_LIB.impl("write_rows_cpu", _write_with_ops, "CPU")


@torch.library.custom_op("devgraph_unrec_test::engine_step", mutates_args=("cache",))
def engine_step(cache: torch.Tensor, x: torch.Tensor) -> None:
    """A Python-bodied op (an engine's layer) calling the invisible kernel."""
    torch.ops.devgraph_unrec_test.write_rows(cache, x)


def _capture(device, write):
    cache = torch.zeros(4, 3, device=device.torch_device)
    x = torch.ones(2, 3, device=device.torch_device)
    graph = device.graph()
    with graph.capture():
        write(cache, x * 2)
    return graph, cache, x


def test_a_kernel_no_dispatch_mode_sees_is_refused_by_name_and_line(any_device):
    with pytest.raises(CaptureError, match="without any op reaching PyTorch's dispatcher") as err:
        _capture(any_device, torch.ops.devgraph_unrec_test.write_rows)
    assert err.value.op == "devgraph_unrec_test::write_rows"
    assert "test_reference_unrecorded.py" in (err.value.source or "")
    assert "instead of CompositeImplicitAutograd" in (err.value.remedy or "")
    assert "mark_break('devgraph_unrec_test::write_rows')" in (err.value.remedy or "")


def test_inside_a_python_bodied_op_too(any_device):
    if any_device.name == "npu":
        # The simulator records a Python-bodied op whole (on hardware, stream capture records what
        # its kernels launch): the replay runs the body again, invisible kernel included.
        graph, cache, x = _capture(any_device, engine_step)
        cache.zero_()
        x.fill_(5)
        graph.replay()
        torch.testing.assert_close(cache[:2], torch.full((2, 3), 10.0, device=cache.device))
        return
    with pytest.raises(CaptureError) as err:  # the reference records the body op by op
        _capture(any_device, engine_step)
    assert err.value.op == "devgraph_unrec_test::write_rows"


def test_the_same_kernel_registered_for_the_cpu_is_recorded_and_replays(any_device):
    graph, cache, x = _capture(any_device, torch.ops.devgraph_unrec_test.write_rows_cpu)
    cache.zero_()
    x.fill_(5)
    graph.replay()
    torch.testing.assert_close(cache[:2], torch.full((2, 3), 10.0, device=cache.device))


def test_without_the_refusal_the_replay_is_silently_wrong(any_device, monkeypatch):
    """What the refusal prevents: the capture succeeds, and a replay never writes the cache."""
    import devgraph.backends.cpu._recorder as recorder
    import devgraph.graph._capture as capture

    monkeypatch.setattr(capture, "refuse_unrecorded", lambda *a: None)
    monkeypatch.setattr(recorder, "refuse_unrecorded", lambda *a: None)
    for write in (torch.ops.devgraph_unrec_test.write_rows, engine_step):
        if write is engine_step and any_device.name == "npu":
            continue  # recorded whole there (see test_inside_a_python_bodied_op_too)
        graph, cache, x = _capture(any_device, write)
        cache.zero_()
        x.fill_(5)
        graph.replay()
        assert torch.equal(cache, torch.zeros_like(cache))  # the write was never recorded


def test_a_breakable_segment_refuses_it_and_a_break_serves_it(any_device):
    cache = torch.zeros(4, 3, device=any_device.torch_device)
    x = torch.ones(2, 3, device=any_device.torch_device)
    with pytest.raises(CaptureError, match="without any op reaching"), BreakableGraph(any_device).capture():
        torch.ops.devgraph_unrec_test.write_rows(cache, x * 2)
    bg = BreakableGraph(any_device, breaks=["devgraph_unrec_test::write_rows"])
    with bg.capture():
        torch.ops.devgraph_unrec_test.write_rows(cache, x * 2)
    cache.zero_()
    x.fill_(5)
    bg.replay()
    torch.testing.assert_close(cache[:2], torch.full((2, 3), 10.0, device=cache.device))
