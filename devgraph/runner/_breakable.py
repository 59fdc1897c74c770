"""``BreakableGraphs``: the runner part that captures the whole forward per bucket as breakable graphs.

Like ``WholeGraphs`` (``_whole.py``), one capture of the model's own forward per batch-size bucket,
the same static buffers, padding and slicing; unlike it, each capture is a ``BreakableGraph``
(``devgraph.graph``): the forward is cut into segment graphs at break ops (devgraph's attention
ops, ``devgraph.mark_break``'d ops, the ``breaks=`` option, plugins'), which run eagerly between
the segments at every replay with the call's host arguments. Nothing is traced or compiled, so a
size costs one forward to capture, and attention that reads per-call host lengths (prefill, mixed
batches) is served where a full graph would freeze them (``mode='breakable'``). With
``mode='full_and_breakable'`` uniform decode batches that fit a full-graph bucket go to the whole
graphs (attention an updatable task), everything else here; both capture into the runner's one pool.

An op that should have been a break and was not (a custom op reading per-call host lists) is
refused at capture with a ``CaptureError`` naming it: replay equals eager, or capture refused.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import attrs

from devgraph._errors import DevgraphError
from devgraph.graph import BreakableGraph, Device, Graph, SharedPool
from devgraph.runner._calls import Call
from devgraph.runner._config import RunnerConfig, RunnerStats
from devgraph.runner._whole import WholeGraphs

__all__ = ["BreakableGraphs", "BreakableStats"]


@attrs.define
class BreakableStats(RunnerStats):
    """Counters of a breakable runner (``graphed.stats``): ``RunnerStats`` and the segments'.

    ``graphs``: segment graphs over every captured size; ``breaks``: break ops run eagerly per call;
    ``full`` holds the whole graphs' own stats in ``full_and_breakable`` mode.
    """

    graphs: int = 0
    breaks: int = 0
    full: RunnerStats | None = None


class BreakableGraphs(WholeGraphs):
    """One breakable capture of the whole forward per batch-size bucket (see the module docstring).

    Args:
        fn: the model, as ``WholeGraphs``.
        device: the device to capture on.
        config: as ``WholeGraphs``; ``config.breaks`` adds break ops to the defaults, ``config.mode`` is
            ``"breakable"`` or ``"full_and_breakable"``.
        shared: the pool and side stream to capture into.
        lock: the runner's lock.
        full_stats: the whole graphs' counters in ``full_and_breakable`` mode (``stats.full``).
    """

    kind = "breakable"
    graph_noun = "breakable graphs"
    desc_word = "breakable capture"
    serve_what = "from a breakable graph"
    remedy = "or capture fewer sizes (batch_sizes=[...] / a smaller max_batch_size)"

    def __init__(
        self,
        fn: Callable[..., Any],
        device: Device,
        config: RunnerConfig,
        shared: SharedPool,
        lock: threading.RLock,
        full_stats: RunnerStats | None = None,
    ) -> None:
        breaks = config.breaks
        super().__init__(
            fn,
            device,
            config,
            shared,
            lock,
            BreakableStats(full=full_stats),
            make_graph=lambda: BreakableGraph(device, breaks),  # a Replayable: one per bucket
        )
        self.stats: BreakableStats

    def breakable_graph(self, batch_size: int) -> BreakableGraph:
        """The breakable graph (segments and breaks) of bucket ``batch_size``."""
        graph: BreakableGraph = self.graph(batch_size)
        return graph

    def segment_graphs(self) -> list[Graph]:
        """Every segment graph of every captured size, largest size first."""
        return [g for size in sorted(self.graphs, reverse=True) for g in self.breakable_graph(size).graphs]

    def drop(self) -> None:
        super().drop()
        self.stats.graphs = self.stats.breaks = 0

    def capture(self, example: Call) -> None:
        """Capture every bucket from ``example`` as breakable graphs (inside ``all_or_nothing``)."""
        super().capture(example)
        self.stats.graphs = sum(len(self.breakable_graph(s).graphs) for s in self.graphs)
        self.stats.breaks = len(self.breakable_graph(max(self.graphs)).captured_breaks)

    def _check_host_args(self, graph: BreakableGraph) -> None:
        taken = {n for b in graph.captured_breaks for n in b.host_args}
        taken.update(n for g in graph.graphs for t in g.tasks if t.is_auto for n in t.host_names)
        for call_name, op_name in self.config.host_args:
            if op_name not in taken:
                ops = sorted({b.op for b in graph.captured_breaks}) or ["none"]
                raise DevgraphError(
                    f"host_args names {call_name!r} -> op argument {op_name!r}, but no break of the "
                    f"breakable graph takes {op_name!r} (breaks captured: {ops}). Mark the op that reads "
                    f"it as a break (breaks=['ns::op']) or pass host_args={{'{call_name}': '<op argument>'}}."
                )
