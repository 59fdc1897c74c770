"""devgraph's decode runners: devgraph's backend captures even where SGLang built its own first (npu)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

# "sglang.srt", not "sglang": this directory is itself importable as a namespace package "sglang".
pytest.importorskip("sglang.srt")

from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

from devgraph.adapters.sglang._backend import DevgraphGraphBackend
from devgraph.adapters.sglang._decode_runner import (
    DevgraphDecodeGraphRunner,
    _UsesDevgraphBackend,
    npu_graph_runner_cls,
)


class InTreeBackend:
    """Stands in for SGLang's NPUCudaGraphBackend, built by resolve_decode_backend on npu."""

    def __init__(self) -> None:
        self.cleaned = False

    def cleanup(self) -> None:
        self.cleaned = True


class SGLangRunner:
    """Stands in for the SGLang runner the mixin precedes: capture() uses self.backend."""

    def capture(self) -> None:
        self.captured_with = self.backend


class Runner(_UsesDevgraphBackend, SGLangRunner):
    pass


def _runner(backend) -> Runner:
    runner = Runner()
    runner.model_runner = SimpleNamespace(device="cpu")
    runner.backend = backend
    return runner


def test_in_tree_backend_is_released_and_replaced_before_capture():
    in_tree = InTreeBackend()
    runner = _runner(in_tree)
    runner.capture()
    assert in_tree.cleaned
    assert isinstance(runner.captured_with, DevgraphGraphBackend) and runner.backend is runner.captured_with


def test_devgraph_backend_from_the_platform_is_kept():
    runner = _runner(None)
    runner.backend = backend = DevgraphGraphBackend(runner)
    runner.capture()
    assert runner.captured_with is backend


def test_runners_put_devgraphs_capture_before_sglangs():
    from sglang.srt.hardware_backend.npu.graph_runner.npu_graph_runner import NPUGraphRunner

    npu_runner = npu_graph_runner_cls()
    assert issubclass(npu_runner, NPUGraphRunner)
    for cls, base in ((DevgraphDecodeGraphRunner, DecodeCudaGraphRunner), (npu_runner, NPUGraphRunner)):
        mro = cls.__mro__
        assert mro.index(_UsesDevgraphBackend) < mro.index(base)


def _decode_runner(monkeypatch, capture_bs, compile_bs=()) -> DevgraphDecodeGraphRunner:
    """A DevgraphDecodeGraphRunner without SGLang's __init__; SGLang's own decisions stubbed."""
    monkeypatch.setattr(DecodeCudaGraphRunner, "can_run_graph", lambda self, fb: fb.batch_size <= self.max_bs)
    monkeypatch.setattr(DecodeCudaGraphRunner, "capture", lambda self: setattr(self, "captured", True))
    runner = object.__new__(DevgraphDecodeGraphRunner)
    runner.capture_bs, runner.max_bs, runner.compile_bs = list(capture_bs), max(capture_bs), list(compile_bs)
    runner.model_runner = SimpleNamespace(device="cpu")
    runner.backend = DevgraphGraphBackend(runner)
    return runner


def test_cpu_decode_runner_captures_without_torch_compile(monkeypatch):
    # SGLang compiles every captured size's forward on cpu (torch_compile_max_bs is raised to the
    # largest size): inductor's kernels round differently from the eager step.
    runner = _decode_runner(monkeypatch, [1, 2, 4], compile_bs=[1, 2, 4])
    runner.capture()
    assert runner.captured and runner.compile_bs == []


def test_cpu_decode_runner_replays_only_exact_sizes_and_counts_the_rest(monkeypatch, caplog, fresh_stats):
    runner = _decode_runner(monkeypatch, [1, 2, 4])
    batch = lambda bs: SimpleNamespace(batch_size=bs)  # noqa: E731
    with caplog.at_level(logging.WARNING, logger="devgraph.adapters.sglang._decode_runner"):
        assert [runner.can_run_graph(batch(bs)) for bs in (1, 2, 4)] == [True] * 3
        # 3 would be padded to 4 by SGLang: a CPU GEMM rounds 3 rows of 4 unlike 3 rows alone.
        assert [runner.can_run_graph(batch(bs)) for bs in (3, 3, 8, 6, 8)] == [False] * 5
        assert caplog.records == []  # reported once the window of decode steps has run
        assert [runner.can_run_graph(batch(bs)) for bs in (4, 2, 1)] == [True] * 3
        for bs in (8, 4, 3, 1):  # later steps: counted, never warned again
            runner.can_run_graph(batch(bs))
    assert dict(fresh_stats().eager_decode) == {3: 3, 8: 3, 6: 1}
    (warning,) = [r.getMessage() for r in caplog.records]
    assert warning.startswith("devgraph: 5 of 8 decode steps ran eagerly")
    assert "captured: [1, 2, 4]; eager batch sizes: 3 (2x), 6 (1x), 8 (2x)" in warning
    assert "--cuda-graph-bs-decode 1 2 3 4 5 6 7 8, or lower --max-running-requests to 4" in warning
