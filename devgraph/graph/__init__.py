"""The graph and its capture semantics: the contract every backend honours, and what a capture checks.

* ``_contract``: ``Device``, ``Stream``, ``Event``, ``Graph``, ``MemoryPool`` (the interface; backends
  implement it).
* ``_capture``: the capture guard (host syncs, collectives and updatable ops seen one by one).
* ``_tasks``: task groups (ops whose host arguments are re-issued at replay).
* ``_compiled_regions``: compiled code inside a capture.
* ``_collectives``: which collectives a capture replays and which it refuses.
* ``_opnames``: op names (``namespace::op``) and which ops have Python bodies.
* ``_weakref``: weak references to graph outputs.
* ``_graphed``: ``GraphedModule``, what ``devgraph.wrap`` returns.
* ``_breaks``, ``_breakable``, ``_break_calls``, ``_segment_check``: break ops and ``BreakableGraph``
  (one capture cut into segment graphs at break ops, which replay eagerly in between).

Importing this package imports no torch; the public names are re-exported by ``devgraph``.
"""

from __future__ import annotations

from devgraph.graph._breakable import BreakableGraph, CapturedBreak
from devgraph.graph._breaks import (
    ATTENTION_OPS,
    break_names,
    break_ops,
    mark_break,
    marked_breaks,
    unmark_break,
)
from devgraph.graph._contract import Device, Event, Graph, MemoryPool, MemoryStats, Stream
from devgraph.graph._graphed import GraphedModule
from devgraph.graph._tasks import TaskGroup
from devgraph.graph._weakref import weak_ref_tensor, weak_ref_tensors

__all__ = [
    "ATTENTION_OPS",
    "BreakableGraph",
    "CapturedBreak",
    "Device",
    "Event",
    "Graph",
    "GraphedModule",
    "MemoryPool",
    "MemoryStats",
    "Stream",
    "TaskGroup",
    "break_names",
    "break_ops",
    "mark_break",
    "marked_breaks",
    "unmark_break",
    "weak_ref_tensor",
    "weak_ref_tensors",
]
