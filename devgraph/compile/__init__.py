"""Piecewise graphs and the PassManager: split at attention, capture each piece per size.

Full graphs cannot hold everything: attention over variable-length prefill, ops that are not
capture-safe, collectives. ``devgraph.compile`` traces a model with Dynamo (``DevgraphBackend``),
lowers it to aten ops, runs the fusion passes (``PassManager``), cuts the graph at the splitting
ops (devgraph's attention ops, plus any the user lists), compiles every piece (eager, inductor,
torchair) and captures each piece per size bucket into one shared pool (``PiecewiseRunner``, in
``devgraph.runner``, which sits above the compiler), within the device's capture budget
(``plan_capture_sizes``). The splitting ops run eagerly in between, with the call's real metadata.

    graphed = devgraph.wrap(model, device="npu", mode="piecewise", capture_sizes=[16, 64, 256])

Modes (``mode=``): ``"full"`` (devgraph.wrap's default: one graph per batch size),
``"piecewise"``, ``"full_and_piecewise"`` (uniform decode batches that fit a full-graph bucket use
the full graphs; prefill, mixed and larger decode batches the pieces; one pool for both).
"""

from devgraph.compile._backends import CompiledPiece, compile_piece
from devgraph.compile._config import COMPILE_BACKENDS, MODES, CompileConfig, compile_option_names
from devgraph.compile._ops import DEFAULT_SPLITTING_OPS, host_arg, resolve_splitting_ops
from devgraph.compile._pieces import PieceRunner, PiecewiseModule
from devgraph.compile._planner import CapturePlan, padding_cost, plan_capture_sizes, spread_evenly
from devgraph.compile._split import Piece, SplitGraph, split_graph
from devgraph.compile._trace import CompiledGraph, DevgraphBackend, Traced, trace_call
from devgraph.compile.passes import (
    AddRmsNormDynamicQuantFusion,
    AddRmsNormFusion,
    AddRmsNormQuantFusion,
    Pass,
    PassContext,
    PassManager,
    SplitQkvRmsNormRopeFusion,
    builtin_passes,
    resolve_passes,
)

__all__ = [
    "COMPILE_BACKENDS",
    "DEFAULT_SPLITTING_OPS",
    "MODES",
    "AddRmsNormDynamicQuantFusion",
    "AddRmsNormFusion",
    "AddRmsNormQuantFusion",
    "CapturePlan",
    "CompileConfig",
    "CompiledGraph",
    "CompiledPiece",
    "DevgraphBackend",
    "Pass",
    "PassContext",
    "PassManager",
    "Piece",
    "PieceRunner",
    "PiecewiseModule",
    "PiecewiseRunner",
    "PiecewiseStats",
    "SplitGraph",
    "SplitQkvRmsNormRopeFusion",
    "Traced",
    "builtin_passes",
    "compile_option_names",
    "compile_piece",
    "host_arg",
    "padding_cost",
    "piecewise_runner",
    "plan_capture_sizes",
    "resolve_passes",
    "resolve_splitting_ops",
    "split_graph",
    "spread_evenly",
    "trace_call",
]

#: Names served from ``devgraph.runner._piecewise`` (the runner uses the compiler, never the reverse):
#: kept here so ``devgraph.compile.PiecewiseRunner`` still works, imported only when asked for.
_FROM_RUNNER = frozenset({"PiecewiseRunner", "PiecewiseStats", "piecewise_runner"})


def __getattr__(name: str) -> object:
    if name in _FROM_RUNNER:
        from devgraph.runner import _piecewise

        return getattr(_piecewise, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
