"""``WholeGraphs``: the runner part that captures the whole forward as one graph per batch-size bucket.

Capture follows SGLang's runner: static input buffers sized for the largest bucket, buckets captured
largest first into one shared pool, warm-up runs before each capture (``CaptureLoop``). A replay
loads nothing itself (the runner loaded the call into its inputs), replays the bucket's graph with the
call's host arguments; ``cut`` cuts the outputs to the call's rows along the dim the padding check found.

Breakable (``breaks=``: ``mode='breakable'``, and the non-decode half of ``full_and_breakable``): each
bucket's capture is a ``BreakableGraph`` (``devgraph.graph``): the forward cut into segment graphs at
break ops (devgraph's attention ops, ``devgraph.mark_break``'d ops, the ``breaks=`` option, plugins'),
which run eagerly between the segments at every replay with the call's host arguments. Nothing is traced
or compiled, so a size costs one forward to capture, and attention that reads per-call host lengths
(prefill, mixed batches) is served where a whole graph would freeze them. An op that should have been a
break and was not (a custom op reading per-call host lists) is refused at capture with a
``CaptureError`` naming it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from devgraph._errors import DevgraphError
from devgraph.graph import BreakableGraph, Graph, GraphSet
from devgraph.runner._buckets import normalise_batch_sizes
from devgraph.runner._calls import Call, Unsupported
from devgraph.runner._config import RunnerStats
from devgraph.runner._padding import PaddingVerdict
from devgraph.runner._part import Kit, Words

__all__ = ["BreakableStats", "WholeGraphs"]

WHOLE = Words(
    kind="full",
    match="captured",
    sizes="batch sizes",
    graphs="graphs",
    desc="capture",
    serve_what="from a graph",
    size_options="batch_sizes/max_batch_size",
    remedy="or capture fewer sizes (batch_sizes=[...] / a smaller max_batch_size), "
    "or run the offending op eagerly (mode='piecewise')",
)
BREAKABLE = attrs.evolve(
    WHOLE,
    kind="breakable",
    graphs="breakable graphs",
    desc="breakable capture",
    serve_what="from a breakable graph",
    remedy="or capture fewer sizes (batch_sizes=[...] / a smaller max_batch_size)",
)


@attrs.define
class BreakableStats(RunnerStats):
    """Counters of a breakable runner (``graphed.stats``): ``RunnerStats`` and the segments'.

    ``graphs``: segment graphs over every captured size; ``breaks``: break ops run eagerly per call;
    ``full`` holds the whole graphs' own stats in ``full_and_breakable`` mode.
    """

    graphs: int = 0
    breaks: int = 0
    full: RunnerStats | None = None


class WholeGraphs:
    """One captured graph of the whole forward per batch-size bucket (``mode='full'``, the decode half
    of ``full_and_*``), or one breakable graph per bucket (``breaks``: ``mode='breakable'``).

    Args:
        kit: what the runner lends (model, device, config, pool, inputs, capture loop, accounts);
            ``config.batch_sizes``/``max_batch_size`` set the buckets.
        stats: this part's counters (default new; the runner's own when this part is its primary).
        breaks: capture ``BreakableGraph``s that run these ops (and the defaults) eagerly between
            segments (None: one ``device.graph()`` per bucket).
    """

    def __init__(
        self, kit: Kit, stats: RunnerStats | None = None, breaks: tuple[str, ...] | None = None
    ) -> None:
        self.kit = kit
        self.fn, self.device, self.config = kit.fn, kit.device, kit.config
        self.breakable = breaks is not None
        self.words = BREAKABLE if self.breakable else WHOLE
        self.sizes = normalise_batch_sizes(self.config.batch_sizes, self.config.max_batch_size)
        self.buckets: list[int] | None = None
        self.exact_only: str | None = None
        self.stats = stats if stats is not None else (BreakableStats() if self.breakable else RunnerStats())
        device = kit.device
        #: how a bucket's graph is made (a ``devgraph.graph.Replayable``; the bisect makes its own)
        self.make_graph: Callable[[], Any] = (
            (lambda: BreakableGraph(device, breaks)) if breaks is not None else device.graph
        )
        self.graphs: GraphSet[int, Any] = GraphSet(device, kit.shared, make=self.make_graph)
        self._out_dims: list[int | None] = []

    def graph(self, batch_size: int) -> Any:
        """The captured graph (a ``Graph``, or a ``BreakableGraph`` with ``breaks``) of bucket ``batch_size``."""
        if batch_size not in self.graphs:
            raise DevgraphError(f"no graph for batch size {batch_size}; captured: {sorted(self.graphs)}")
        return self.graphs.graph(batch_size)

    def breakable_graph(self, batch_size: int) -> BreakableGraph:
        """The breakable graph (segments and breaks) of bucket ``batch_size``."""
        graph: BreakableGraph = self.graph(batch_size)
        return graph

    def segment_graphs(self) -> list[Graph]:
        """Every segment graph of every captured size, largest size first (breakable)."""
        return [g for size in sorted(self.graphs, reverse=True) for g in self.breakable_graph(size).graphs]

    # -- serve ---------------------------------------------------------------------------------

    def replay(self, call: Call, size: int, host_args: Mapping[str, Any] | None) -> Any:
        """Replay bucket ``size`` (the call is loaded)."""
        return self.graphs.replay(size, host_args)

    def beyond(self, call: Call, why: Unsupported) -> Any:
        """A call no graph can serve (too large, or padding would change it): the runner runs it eagerly."""
        raise why

    def cut(self, outputs: Any, size: int, batch: int) -> Any:
        """The outputs of bucket ``size`` cut to the call's ``batch`` rows (cloned with ``clone_outputs``)."""
        if isinstance(outputs, torch.Tensor):  # the common case, without flattening a tree
            dim = self._out_dims[0]
            if dim is not None and batch != size:
                outputs = outputs[:batch] if dim == 0 else outputs.narrow(dim, 0, batch)
            return outputs.clone() if self.config.clone_outputs else outputs
        leaves, spec = tree_flatten(outputs)
        cut = []
        # A bucket's own size is never cut (its outputs may differ in structure from other buckets').
        dims = self._out_dims if batch != size else itertools.repeat(None)
        for leaf, dim in zip(leaves, dims):
            if isinstance(leaf, torch.Tensor):
                if dim is not None and batch != size:
                    leaf = leaf.narrow(dim, 0, batch)
                if self.config.clone_outputs:
                    leaf = leaf.clone()
            cut.append(leaf)
        return tree_unflatten(cut, spec)

    # -- capture -------------------------------------------------------------------------------

    def drop(self) -> None:
        """Forget the graphs and what the capture found; the counters of calls stay."""
        self.graphs.reset()
        self.buckets = None
        self.exact_only = None
        stats = self.stats
        stats.forget_capture()
        if isinstance(stats, BreakableStats):
            stats.graphs = stats.breaks = 0

    def capture(self, example: Call) -> None:
        """Capture every bucket from ``example`` (run inside ``CaptureLoop.all_or_nothing``; the
        runner's inputs hold buffers of enough rows)."""
        inputs = self.kit.inputs

        def prepare(size: int) -> tuple[Callable[[], Any], Callable[[], None]]:
            args, kwargs = inputs.bound_at(example, size)

            def warm_up() -> Any:
                return self.fn(*args, **kwargs)

            def capture() -> None:
                # The graph's pool owns the output memory (held weakly by the graph set), so the
                # next (smaller) bucket reuses it. Outputs are overwritten by the next replay.
                self.graphs.capture(size, lambda graph: self.fn(*args, **kwargs))
                self._check_host_args(self.graphs.graph(size))  # stored first: a failure's rollback resets it

            return warm_up, capture

        verdict = self.kit.loop.run(
            self.sizes,
            prepare,
            stats=self.stats,
            words=self.words,
            summary=f"captured {len(self.sizes)} {self.words.graphs} (batch sizes {{sizes}})",
            example=example,
        )
        self.exact_only = verdict.exact_only if verdict is not None else None
        self._out_dims = self._decide_out_dims(verdict)
        self.buckets = self.sizes
        if isinstance(self.stats, BreakableStats):
            self.stats.graphs = sum(len(self.breakable_graph(s).graphs) for s in self.graphs)
            self.stats.breaks = len(self.breakable_graph(max(self.graphs)).captured_breaks)

    def _decide_out_dims(self, verdict: PaddingVerdict | None) -> list[int | None]:
        """Per output leaf, the dim cut to a call's rows: what the padding check found (one dim that
        grows with the rows, or none), if every captured bucket agrees; else padded calls run eagerly."""
        outputs = self.graphs.outputs()
        dims = _output_batch_dims(outputs)
        if verdict is None or verdict.out_dims is None:
            if dims is None:
                dims = []
                self.exact_only = self.exact_only or "the output's structure differs between buckets"
            return dims
        largest = tree_flatten(outputs[self.sizes[-1]])[0]
        for size, out in outputs.items():
            leaves = tree_flatten(out)[0]
            ok = len(leaves) == len(verdict.out_dims) and all(
                (d is None and (not isinstance(leaf, torch.Tensor) or leaf.shape == top.shape))
                or (d is not None and isinstance(leaf, torch.Tensor) and leaf.shape[d] == size)
                for leaf, top, d in zip(leaves, largest, verdict.out_dims)
            )
            if not ok:
                self.exact_only = self.exact_only or (
                    f"the outputs at bucket {size} are not the largest bucket's cut along the batch dim"
                )
                return dims or []
        return list(verdict.out_dims)

    def _check_host_args(self, graph: Any) -> None:
        if self.breakable:
            self._check_break_host_args(graph)
            return
        for call_name, op_name in self.config.host_args:
            if not any(t.is_auto and t.takes(op_name) for t in graph.tasks):
                ops = sorted({t.op for t in graph.tasks}) or ["none"]
                raise DevgraphError(
                    f"host_args names {call_name!r} -> op argument {op_name!r}, but no updatable task in the "
                    f"captured graph takes {op_name!r} (updatable ops captured: {ops}; this device updates "
                    f"{list(self.device.updatable_ops)}). Pass host_args={{'{call_name}': '<op argument>'}}."
                )

    def _check_break_host_args(self, graph: BreakableGraph) -> None:
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


def _output_batch_dims(outputs: dict[int, Any]) -> list[int | None] | None:
    """Per output leaf, the dim that grows with the bucket (None: not batched); None when the
    outputs' structure differs between buckets.

    With two or more buckets it is the dim whose size equals the bucket size in each of them; with
    one bucket, the first dim equal to that size.
    """
    sizes = sorted(outputs)
    flat = {s: tree_flatten(outputs[s])[0] for s in sizes}
    if len({len(leaves) for leaves in flat.values()}) > 1:
        return None
    dims: list[int | None] = []
    for i, leaf in enumerate(flat[sizes[0]]):
        found = None
        if isinstance(leaf, torch.Tensor):
            for d in range(leaf.dim()):
                if all(isinstance(flat[s][i], torch.Tensor) and flat[s][i].shape[d] == s for s in sizes):
                    found = d
                    break
        dims.append(found)
    return dims
