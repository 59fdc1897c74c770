"""devgraph's decode runners: devgraph's backend captures even where SGLang built its own first (npu)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

# "sglang.srt", not "sglang": this directory is itself importable as a namespace package "sglang".
pytest.importorskip("sglang.srt")

from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

from devgraph.adapters.sglang._backend import DevgraphGraphBackend
from devgraph.adapters.sglang._runner import (
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
