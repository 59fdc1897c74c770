"""BreakableGraphs: breakable mode's "which graphs" part, one ``BreakableGraph`` per capture size.

Where whole graphs hold one ``Graph`` per bucket and pieces hold a traced, split module's graphs,
this part holds, per size, the segment graphs of one breakable capture of the model's own forward
(``devgraph.graph.BreakableGraph``): attention (devgraph's attention ops, and any op marked with
``devgraph.mark_break`` or listed in ``breaks=``) runs eagerly between segments with the call's
real host values; nothing is traced or compiled, so a forward Dynamo cannot trace whole serves too,
and a capture costs one forward per size.

Every size shares the pool and stream the runner hands in (largest first, so smaller sizes reuse
its blocks); outputs are held weakly (the pool owns them) and overwritten by the next replay. Host
arguments reach the breaks by op argument name (``{"seq_lens_host": [...]}``), as they reach a
full graph's updatable tasks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from devgraph._errors import DevgraphError
from devgraph.graph._breakable import BreakableGraph
from devgraph.graph._contract import Device, Graph, MemoryPool, Stream
from devgraph.graph._weakref import weak_ref_tensors

__all__ = ["BreakableGraphs"]


class BreakableGraphs:
    """One breakable capture per size of a callable (see the module docstring).

    Args:
        device: the device the segment graphs are captured on.
        breaks: break ops besides the defaults (names ``"ns::op"`` or ops).
        static_ops: custom ops whose host lists are the same on every call (see ``BreakableGraph``).
    """

    def __init__(self, device: Device, breaks: Sequence[Any] = (), static_ops: Sequence[Any] = ()) -> None:
        self.device = device
        self.breaks = tuple(breaks)
        self.static_ops = tuple(static_ops)
        self._graphs: dict[int, BreakableGraph] = {}
        self._outputs: dict[int, Any] = {}

    @property
    def sizes(self) -> list[int]:
        """The sizes captured so far, ascending."""
        return sorted(self._graphs)

    def __contains__(self, size: object) -> bool:
        return size in self._graphs

    def capture(
        self,
        size: int,
        run: Callable[[], Any],
        pool: MemoryPool,
        stream: Stream,
        host_args: Mapping[str, Any] | None = None,
    ) -> Any:
        """Capture ``run()`` (the model called on the static buffers of ``size``) as segment graphs.

        ``host_args``: the capture's per-call host values by argument name (their very objects are
        refused as inputs of captured ops). Returns the outputs (weak: the pool owns them).

        Raises:
            DevgraphError: ``size`` is captured already (``reset()`` first).
            CaptureError: what ``BreakableGraph.capture`` refuses.
        """
        if size in self._graphs:
            raise DevgraphError(f"size {size} is captured already; reset() first")
        graph = BreakableGraph(self.device, self.breaks, static_ops=self.static_ops)
        with graph.capture(
            stream=stream, pool=pool, auto_update_ops=self.device.updatable_ops, host_args=host_args
        ):
            out = run()
        self._graphs[size], self._outputs[size] = graph, weak_ref_tensors(out)
        return self._outputs[size]

    def replay(self, size: int, host_args: Mapping[str, Any] | None = None) -> Any:
        """Replay the segments of ``size`` with the breaks run eagerly in between; its outputs."""
        graph = self._graphs.get(size)
        if graph is None:
            raise DevgraphError(f"no breakable graph for size {size}; captured: {self.sizes}")
        graph.replay(host_args)
        return self._outputs[size]

    def outputs(self, size: int) -> Any:
        """The outputs of ``size`` (overwritten by each replay of that size)."""
        return self._outputs[size]

    def graph(self, size: int) -> BreakableGraph:
        """The breakable graph of ``size``."""
        if size not in self._graphs:
            raise DevgraphError(f"no breakable graph for size {size}; captured: {self.sizes}")
        return self._graphs[size]

    def segment_graphs(self) -> list[Graph]:
        """Every segment graph of every size."""
        return [g for size in self.sizes for g in self._graphs[size].graphs]

    @property
    def graph_count(self) -> int:
        """Segment graphs over every size."""
        return sum(len(g.graphs) for g in self._graphs.values())

    @property
    def break_count(self) -> int:
        """Breaks per call (of the largest size; every size has the same)."""
        return len(self._graphs[max(self._graphs)].captured_breaks) if self._graphs else 0

    def takes(self, name: str) -> bool:
        """Whether some break of the captured sizes takes host argument ``name``."""
        return any(name in b.host_args for g in self._graphs.values() for b in g.captured_breaks)

    def reset(self) -> None:
        """Drop every size's graphs."""
        for graph in self._graphs.values():
            graph.reset()
        self._graphs.clear()
        self._outputs.clear()
