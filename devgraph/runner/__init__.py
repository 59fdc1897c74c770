"""The graph runners: ``GraphRunner`` (one graph per batch-size bucket) and ``PiecewiseRunner``
(a model cut at its splitting ops, each piece captured per token-count size; it uses
``devgraph.compile``, which sits below)."""

from devgraph.runner._buckets import choose_bucket, default_batch_sizes, normalise_batch_sizes
from devgraph.runner._config import RunnerConfig, RunnerStats, make_config
from devgraph.runner._piecewise import PiecewiseRunner, PiecewiseStats, piecewise_runner
from devgraph.runner._runner import GraphRunner

__all__ = [
    "GraphRunner",
    "PiecewiseRunner",
    "PiecewiseStats",
    "RunnerConfig",
    "RunnerStats",
    "choose_bucket",
    "default_batch_sizes",
    "make_config",
    "normalise_batch_sizes",
    "piecewise_runner",
]
