"""The graph and its capture semantics: the contract every backend honours, and what a capture checks.

* ``_contract``: ``Device``, ``Stream``, ``Event``, ``Graph``, ``MemoryPool`` (the interface; backends
  implement it).
* ``_capture``: the capture check (host syncs, collectives and updatable ops seen one by one).
* ``_tasks``: task groups (ops whose host arguments are re-issued at replay).
* ``_multistep``: ``MultiStepGraph``, several steps (a speculative draft's) captured as one graph whose
  replay gives every step's tasks their host arguments in one update.
* ``_compiled_regions``: compiled code inside a capture.
* ``_collectives``: which collectives a capture replays and which it refuses.
* ``_opnames``: op names (``namespace::op``) and which ops have Python bodies.
* ``_weakref``: weak references to graph outputs.
* ``_graph_set``: ``GraphSet``, graphs by key in one shared pool (``SharedPool``), outputs held weakly:
  the core of every holder of graphs (the runner's parts, the pieces, the engine adapters).
* ``_breaks``, ``_breakable``, ``_break_calls``, ``_segment_check``: break ops and ``BreakableGraph``
  (one capture cut into segment graphs at break ops, which replay eagerly in between).

Importing this package imports no torch. Its face (``__all__``) is what other packages and third-party
backends use: the contract, the graph set, task groups and host-argument application, and the refusal
helpers a backend's capture needs (``raise_refusal``, ``is_collective``/``refuse_collective``,
``has_python_kernel``, ``lookup_op``, ``FUNCTION_SYNCS``/``SHAPE_REMEDY``), and ``host_sync_check`` (the
capture check around an eager run: what a capture would refuse, found before any capture). ``devgraph``
re-exports the user-facing names.
"""

from __future__ import annotations

from devgraph.graph._breakable import BreakableGraph, CapturedBreak
from devgraph.graph._breaks import (
    ATTENTION_OPS,
    add_break_source,
    break_names,
    break_ops,
    mark_break,
    marked_breaks,
    unmark_break,
)
from devgraph.graph._capture import (
    FUNCTION_SYNCS,
    SHAPE_REMEDY,
    host_sync_check,
    raise_refusal,
    refuse_unrecorded,
)
from devgraph.graph._collectives import is_collective, refuse_collective
from devgraph.graph._compiled_regions import CompiledRegions
from devgraph.graph._contract import (
    Device,
    Event,
    Graph,
    MemoryPool,
    MemoryStats,
    Stream,
    current_graph,
    probe_captures,
)
from devgraph.graph._flat import leaves as flat_leaves
from devgraph.graph._flat import map_leaves, tensor_leaves, tree_tensors
from devgraph.graph._graph_set import GraphSet, Replayable, SharedPool
from devgraph.graph._multistep import MultiStepGraph, MultiStepStats, step_lengths
from devgraph.graph._opnames import (
    has_python_kernel,
    is_view,
    lookup_op,
    writes_arguments,
    written_arguments,
    written_tensors,
)
from devgraph.graph._tasks import TaskGroup, apply_host_args, holds_tensor
from devgraph.graph._weakref import weak_ref_tensor, weak_ref_tensors

__all__ = [
    "ATTENTION_OPS",
    "BreakableGraph",
    "CapturedBreak",
    "CompiledRegions",
    "FUNCTION_SYNCS",
    "SHAPE_REMEDY",
    "Device",
    "Event",
    "Graph",
    "GraphSet",
    "Replayable",
    "MemoryPool",
    "MemoryStats",
    "MultiStepGraph",
    "MultiStepStats",
    "SharedPool",
    "Stream",
    "TaskGroup",
    "add_break_source",
    "apply_host_args",
    "break_names",
    "break_ops",
    "current_graph",
    "flat_leaves",
    "has_python_kernel",
    "holds_tensor",
    "host_sync_check",
    "is_collective",
    "is_view",
    "lookup_op",
    "map_leaves",
    "mark_break",
    "marked_breaks",
    "probe_captures",
    "raise_refusal",
    "refuse_unrecorded",
    "refuse_collective",
    "step_lengths",
    "tensor_leaves",
    "tree_tensors",
    "unmark_break",
    "weak_ref_tensor",
    "weak_ref_tensors",
    "writes_arguments",
    "written_arguments",
    "written_tensors",
]
