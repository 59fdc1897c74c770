"""The batch-bucketed graph runner (see ``GraphRunner``)."""

from devgraph.runner._buckets import choose_bucket, default_batch_sizes, normalise_batch_sizes
from devgraph.runner._config import RunnerConfig, RunnerStats, make_config
from devgraph.runner._runner import GraphRunner

__all__ = [
    "GraphRunner",
    "RunnerConfig",
    "RunnerStats",
    "choose_bucket",
    "default_batch_sizes",
    "make_config",
    "normalise_batch_sizes",
]
