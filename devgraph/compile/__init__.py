"""Piecewise graphs and the PassManager: split at attention, capture each piece per size.

Full graphs cannot hold everything: attention over variable-length prefill, ops that are not
capture-safe, collectives. ``devgraph.compile`` traces a model with Dynamo (``DevgraphCompiler``),
lowers it to aten ops, runs the fusion passes (``PassManager``), cuts the graph at the splitting
ops (devgraph's attention ops, plus any the user lists), compiles every piece (eager, inductor,
torchair) and captures each piece per size bucket into one shared pool (the runner's ``Pieces``, in
``devgraph.runner``, which sits above the compiler), within the device's capture budget
(``plan_capture_sizes``). The splitting ops run eagerly in between, with the call's real metadata.

    graphed = devgraph.wrap(model, device="npu", mode="piecewise", capture_sizes=[16, 64, 256])

Modes (``mode=``): ``"full"`` (devgraph.wrap's default: one graph per batch size),
``"piecewise"``, ``"full_and_piecewise"`` (uniform decode batches that fit a full-graph bucket use
the full graphs; prefill, mixed and larger decode batches the pieces; one pool for both).
"""

from devgraph.compile._compilers import compile_piece, compilers_for
from devgraph.compile._config import CompileConfig, compile_option_names
from devgraph.compile._pieces import PieceGraphs, PiecewiseModule
from devgraph.compile._planner import CapturePlan, padding_cost, plan_capture_sizes, spread_evenly
from devgraph.compile._splitting_ops import host_values, resolve_splitting_ops
from devgraph.compile._trace import DevgraphCompiler, Traced, trace_call
from devgraph.compile.passes import Pass, PassContext, PassManager, builtin_passes, resolve_passes

__all__ = [
    "CapturePlan",
    "CompileConfig",
    "DevgraphCompiler",
    "Pass",
    "PassContext",
    "PassManager",
    "PieceGraphs",
    "PiecewiseModule",
    "Traced",
    "builtin_passes",
    "compile_option_names",
    "compile_piece",
    "compilers_for",
    "host_values",
    "padding_cost",
    "plan_capture_sizes",
    "resolve_passes",
    "resolve_splitting_ops",
    "spread_evenly",
    "trace_call",
]
