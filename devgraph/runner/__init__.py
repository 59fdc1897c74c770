"""The graph runner: one call path (``GraphRunner``) whose "which graphs" is a part (``Part``).

``WholeGraphs`` (one graph per batch-size bucket; with ``breaks``, one breakable capture per bucket:
segment graphs, break ops run eagerly in between) and ``Pieces`` (a model cut at its splitting ops,
each piece captured per token-count size; it uses ``devgraph.compile``, which sits below) are the
parts; ``full_and_piecewise`` and ``full_and_breakable`` route decode batches to whole graphs
(``MODE_TABLE``). ``GraphedModule`` is what ``devgraph.wrap`` returns: a model whose calls a runner
serves.
"""

from devgraph.runner._accounts import Accounts
from devgraph.runner._buckets import choose_bucket, default_batch_sizes, normalise_batch_sizes
from devgraph.runner._calls import Call, Unsupported, signature_of
from devgraph.runner._config import (
    MODE_TABLE,
    MODES,
    Mode,
    RunnerConfig,
    RunnerStats,
    make_config,
    positive_ints,
)
from devgraph.runner._families import (
    VERIFY_TOKEN_COUNT,
    AcceptanceStats,
    DraftSteps,
    Family,
    FamilyStats,
    GraphFamilies,
    MultiStepGraphs,
)
from devgraph.runner._graphed import GraphedModule
from devgraph.runner._model_state import capture_warnings
from devgraph.runner._part import Kit, Part, Words
from devgraph.runner._pieces import Pieces, PiecewiseStats
from devgraph.runner._rounding import RowCountRounding
from devgraph.runner._runner import PARTS, GraphRunner, piecewise_config, piecewise_runner
from devgraph.runner._tensors import tensor_version
from devgraph.runner._threads import ThreadOwner
from devgraph.runner._whole import BreakableStats, WholeGraphs

__all__ = [
    "MODES",
    "MODE_TABLE",
    "PARTS",
    "VERIFY_TOKEN_COUNT",
    "AcceptanceStats",
    "Accounts",
    "BreakableStats",
    "Call",
    "DraftSteps",
    "Family",
    "FamilyStats",
    "GraphFamilies",
    "GraphRunner",
    "GraphedModule",
    "Kit",
    "Mode",
    "MultiStepGraphs",
    "Part",
    "Pieces",
    "PiecewiseStats",
    "RowCountRounding",
    "RunnerConfig",
    "RunnerStats",
    "ThreadOwner",
    "Unsupported",
    "WholeGraphs",
    "Words",
    "capture_warnings",
    "choose_bucket",
    "default_batch_sizes",
    "make_config",
    "normalise_batch_sizes",
    "piecewise_config",
    "piecewise_runner",
    "positive_ints",
    "signature_of",
    "tensor_version",
]
