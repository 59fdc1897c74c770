"""Dynamo in front, devgraph behind: the front end of ``devgraph.wrap`` and ``torch.compile(backend="devgraph")``.

Dynamo traces the forward (guards what it read, replays its Python side effects, breaks the graph
where it cannot follow); devgraph captures and replays each FX graph it hands over with a
``GraphRunner`` per graph (``DynamoGraphs``, reading each graph with ``TracedGraph``): whole per
bucket, breakable, or cut into pieces, by mode. ``TracedModule`` is what ``devgraph.wrap(model)``
returns in the ``full``, ``piecewise`` and ``breakable`` modes (``frontend='dynamo'``, the default).
This layer sits above the runner and below debug and the adapters.
"""

from devgraph.frontend._dynamo import (
    DYNAMO_CONFIG,
    DynamoGraphs,
    DynamoStats,
    Served,
    backend_for,
    call_traced,
    compile_graph,
)
from devgraph.frontend._module import TracedModule, wrap_traced
from devgraph.frontend._traced_graph import PYTHON_RANDOM, TracedGraph, Unservable, node_meta_at

__all__ = [
    "DYNAMO_CONFIG",
    "PYTHON_RANDOM",
    "DynamoGraphs",
    "DynamoStats",
    "Served",
    "TracedGraph",
    "TracedModule",
    "Unservable",
    "backend_for",
    "call_traced",
    "compile_graph",
    "node_meta_at",
    "wrap_traced",
]
