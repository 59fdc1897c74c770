"""Ascend capture failures with known causes raise a CaptureError naming the remedy (simulator)."""

from __future__ import annotations

import pytest
import torch

import devgraph
from devgraph import CaptureError
from devgraph.backends.npu import _capture_errors
from devgraph_sim.npu import _runtime as _npu_sim_runtime


@pytest.mark.parametrize(
    ("kind", "cause", "remedy"),
    [
        ("stream_resources", "stream resources are insufficient", "FULL_DECODE_ONLY"),
        ("old_driver", "could not allocate a stream queue", "upgrade the HDK"),
    ],
)
def test_known_capture_failures_name_their_remedy(npu, kind, cause, remedy):
    x = torch.ones(4)
    graph = npu.graph()
    _npu_sim_runtime.fail_next_capture(kind)
    with pytest.raises(CaptureError, match=cause) as info:
        with graph.capture():
            x.add_(1)
    assert remedy in info.value.remedy
    assert isinstance(info.value.__cause__, RuntimeError)  # the runtime's own words stay attached
    # The failure leaves nothing behind: the next capture works.
    with graph.capture():
        y = x * 2
    x.fill_(3)
    graph.replay()
    npu.synchronize()
    assert torch.equal(y, torch.full((4,), 6.0))


def test_stream_exhaustion_names_fewer_capture_sizes():
    error = _capture_errors.classify(RuntimeError(_npu_sim_runtime.CAPTURE_FAILURES["stream_resources"]))
    assert isinstance(error, CaptureError)
    assert "capture_sizes" in error.remedy and "error code is 207008" in str(error)


def test_the_old_driver_wins_over_the_memory_code_it_comes_with():
    # "Alloc sq cq fail" comes with 207005 ("Failed to apply for memory"): the cure is the driver.
    error = _capture_errors.classify(RuntimeError(_npu_sim_runtime.CAPTURE_FAILURES["old_driver"]))
    assert "HDK" in error.remedy


def test_other_capture_failures_are_left_alone(npu):
    graph = npu.graph()
    with pytest.raises(ValueError, match="something else"):
        with graph.capture():
            raise ValueError("something else")
    assert _capture_errors.classify(RuntimeError("error code is 107002")) is None


def test_the_simulator_refuses_an_unknown_failure_kind():
    with pytest.raises(ValueError, match="known"):
        _npu_sim_runtime.fail_next_capture("gremlins")


@pytest.mark.parametrize(("mode", "native"), [("default", "global"), ("thread_local", "thread_local")])
def test_capture_error_mode_reaches_npugraph_capture_begin(npu, monkeypatch, mode, native):
    seen = []
    sim_graph = _npu_sim_runtime.NPUGraph
    real = sim_graph.capture_begin

    def spy(self, pool=None, capture_error_mode="global"):
        seen.append(capture_error_mode)
        return real(self, pool=pool, capture_error_mode=capture_error_mode)

    monkeypatch.setattr(sim_graph, "capture_begin", spy)
    graph = npu.graph()
    with graph.capture(capture_error_mode=mode):
        torch.ones(2) + 1
    assert seen == [native] and graph.capture_error_mode == mode


def test_debug_dump_is_refused_where_the_runtime_has_none(npu):
    # The simulator's NPUGraph has no debug_dump (torch_npu 2.13's has): refused, not ignored.
    with pytest.raises(devgraph.DevgraphError, match="no debug dump"):
        npu.graph().enable_debug_mode()
