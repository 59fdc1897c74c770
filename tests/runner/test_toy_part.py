"""A part of our own, written in this file only, served by the runner's one call path.

What adding a part costs (issue 46): a class that takes the runner's ``Kit`` and satisfies ``Part``.
The runner reads, matches, buckets, loads, counts and recaptures for it; the part only captures its
graphs, replays one, cuts the outputs and says what happens beyond its sizes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import torch

import devgraph
from devgraph.graph import GraphSet
from devgraph.runner import Call, GraphRunner, Kit, RunnerConfig, RunnerStats, Unsupported, Words


class EvenSizes:
    """A toy part: one graph of the whole forward per *even* bucket; an odd batch beyond them runs
    eagerly (counted by the runner as ``batch_too_large``)."""

    words = Words(
        kind="even",
        match="captured",
        sizes="even batch sizes",
        graphs="even graphs",
        desc="even capture",
        serve_what="from an even graph",
        size_options="batch_sizes",
        remedy="or capture fewer sizes",
    )

    def __init__(self, kit: Kit) -> None:
        self.kit = kit
        self.sizes = [2, 4]
        self.buckets: list[int] | None = None
        self.exact_only: str | None = None
        self.stats = RunnerStats()
        self.graphs: GraphSet[int, Any] = GraphSet(kit.device, kit.shared)
        self.make_graph = kit.device.graph  # what devgraph.bisect captures a bucket with

    def capture(self, example: Call) -> None:
        inputs = self.kit.inputs

        def prepare(size: int):
            args, kwargs = example.bind(inputs.signature, {**inputs.narrowed(size), **example.consts})
            return (lambda: self.kit.fn(*args, **kwargs)), (
                lambda: self.graphs.capture(size, lambda graph: self.kit.fn(*args, **kwargs))
            )

        self.kit.loop.run(self.sizes, prepare, stats=self.stats, words=self.words, summary="{sizes}")
        self.buckets = self.sizes

    def replay(self, call: Call, size: int, host_args: Mapping[str, Any] | None) -> Any:
        return self.graphs.replay(size, host_args)

    def cut(self, outputs: Any, size: int, batch: int) -> Any:
        return outputs[:batch]

    def beyond(self, call: Call, why: Unsupported) -> Any:
        raise why

    def drop(self) -> None:
        self.graphs.reset()
        self.buckets = None


def _runner():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)).eval()
    device = devgraph.device("cpu")
    return model, GraphRunner(model, device, RunnerConfig(), part=EvenSizes)


def test_a_toy_part_defined_here_is_served_by_the_runner():
    model, runner = _runner()
    with torch.no_grad():
        for batch in (1, 2, 3, 4):
            x = torch.randn(batch, 8)
            out = runner(x)
            # 1 padded to 2, 3 to 4: bitwise only where the rows' GEMM does not round by row count
            torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-6)
            assert out.shape == (batch, 4)
        assert runner.stats.replays == 4 and runner.stats.captured_sizes == (2, 4)
        assert isinstance(runner.part, EvenSizes) and runner.stats is runner.part.stats
        # beyond its sizes: the runner's fallback, counted in the part's stats by reason
        x = torch.randn(5, 8)
        with pytest.warns(UserWarning, match="batch_too_large"):
            out = runner(x)
        torch.testing.assert_close(out, model(x), rtol=0, atol=0)  # eager: the model itself
        assert runner.stats.fallbacks == {"batch_too_large": 1} and runner.stats.eager_calls == 1


def test_the_runner_recaptures_a_toy_part_when_a_weight_is_replaced():
    model, runner = _runner()
    x = torch.randn(3, 8)
    with torch.no_grad():
        runner(x)
        model[2].weight = torch.nn.Parameter(torch.randn(4, 8))
        with pytest.warns(UserWarning, match="replaced since capture"):
            out = runner(x)
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-6)
    assert runner.stats.recaptures == 1 and runner.stats.replays == 2
