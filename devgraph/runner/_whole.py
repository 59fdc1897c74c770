"""``WholeGraphs``: the runner part that captures the whole forward as one graph per batch-size bucket.

Capture follows SGLang's runner: static input buffers sized for the largest bucket, buckets captured
largest first into one shared pool, warm-up runs before each capture (``CaptureLoop``). A replay
loads nothing itself (the runner loaded the call into ``inputs``), replays the bucket's graph with the
call's host arguments and cuts the outputs to the call's rows along the dim the padding check found.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from devgraph._errors import DevgraphError
from devgraph.graph import Device, GraphSet, SharedPool
from devgraph.runner._buckets import normalise_batch_sizes
from devgraph.runner._calls import Call, Unsupported
from devgraph.runner._capture_loop import part_core
from devgraph.runner._config import RunnerConfig, RunnerStats
from devgraph.runner._padding import PaddingVerdict

__all__ = ["WholeGraphs"]


class WholeGraphs:
    """One captured graph of the whole forward per batch-size bucket (``mode='full'``, and the decode
    half of ``full_and_piecewise``).

    Args:
        fn: the model.
        device: the device to capture on.
        config: the runner's config (``batch_sizes``/``max_batch_size`` set the buckets).
        shared: the pool and side stream to capture into (shared with the runner's other part).
        lock: the runner's lock (the accounts count under it).
        make_graph: how each bucket's graph is made (default ``device.graph()``); a breakable part
            makes ``BreakableGraph``s (``devgraph.graph.Replayable``: capture, replay, reset).
    """

    kind = "full"
    match_word = "captured"
    size_word = "batch sizes"
    #: What a capture is called in the summary line, the progress bar and the accounts.
    graph_noun = "graphs"
    desc_word = "capture"
    serve_what = "from a graph"
    remedy = (
        "or capture fewer sizes (batch_sizes=[...] / a smaller max_batch_size), "
        "or run the offending op eagerly (mode='piecewise')"
    )

    def __init__(
        self,
        fn: Callable[..., Any],
        device: Device,
        config: RunnerConfig,
        shared: SharedPool,
        lock: threading.RLock,
        stats: RunnerStats | None = None,
        make_graph: Callable[[], Any] | None = None,
    ) -> None:
        self.fn = fn
        self.device = device
        self.config = config
        self.sizes = normalise_batch_sizes(config.batch_sizes, config.max_batch_size)
        self.buckets = self.sizes  # the sizes a call is bucketed into
        self.stats = stats if stats is not None else RunnerStats()
        self.inputs, self.accounts, self.capture_loop = part_core(
            fn,
            device,
            config,
            self.stats,
            lock,
            shared,
            serve_what=self.serve_what,
            size_noun="batch sizes",
            size_options="batch_sizes/max_batch_size",
        )
        self.graphs: GraphSet[int, Any] = GraphSet(device, shared, make=make_graph or device.graph)
        self._out_dims: list[int | None] = []

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    def graph(self, batch_size: int) -> Any:
        """The captured graph (a ``Replayable``: ``make_graph``'s) of bucket ``batch_size``."""
        if batch_size not in self.graphs:
            raise DevgraphError(f"no graph for batch size {batch_size}; captured: {sorted(self.graphs)}")
        return self.graphs.graph(batch_size)

    # -- serve ---------------------------------------------------------------------------------

    def replay(self, call: Call, size: int, host_args: Mapping[str, Any] | None) -> Any:
        """Replay bucket ``size`` (the call is loaded) and return the outputs cut to its rows."""
        return self._slice(self.graphs.replay(size, host_args), size, call.batch)

    def beyond(self, call: Call, why: Unsupported) -> Any:
        """A call no graph can serve (too large, or padding would change it): the runner runs it eagerly."""
        raise why

    def _slice(self, outputs: Any, size: int, batch: int) -> Any:
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
        """Forget the capture (graphs, buffers, template); the counters stay."""
        self.graphs.reset()
        self.inputs.clear()
        self.capture_loop.clear()

    def capture(self, example: Call) -> None:
        """Capture every bucket from ``example`` (run inside ``CaptureLoop.all_or_nothing``)."""
        inputs = self.inputs
        inputs.alloc(example, self.sizes[-1])

        def prepare(size: int) -> tuple[Callable[[], Any], Callable[[], None]]:
            host = {name: [self.config.pad_value(name)] * size for name in example.host}
            values: dict[str, Any] = dict(inputs.narrowed(size))
            values.update(example.static)
            values.update(example.consts)
            values.update(host)
            args, kwargs = example.bind(inputs.signature, values)

            def warm_up() -> Any:
                return self.fn(*args, **kwargs)

            def capture() -> None:
                # The graph's pool owns the output memory (held weakly by the graph set), so the
                # next (smaller) bucket reuses it. Outputs are overwritten by the next replay.
                self.graphs.capture(size, lambda graph: self.fn(*args, **kwargs))
                self._check_host_args(self.graphs.graph(size))  # stored first: a failure's rollback resets it

            return warm_up, capture

        self.capture_loop.run(
            self.sizes,
            prepare,
            remedy=self.remedy,
            summary=f"captured {len(self.sizes)} {self.graph_noun} (batch sizes {{sizes}})",
            desc=f"devgraph {self.desc_word} ({self.device})",
            example=example,
        )
        self._out_dims = self._decide_out_dims(inputs.padding_verdict)
        inputs.remember(example)

    def _decide_out_dims(self, verdict: PaddingVerdict | None) -> list[int | None]:
        """Per output leaf, the dim cut to a call's rows: what the padding check found (one dim that
        grows with the rows, or none), if every captured bucket agrees; else padded calls run eagerly."""
        inputs = self.inputs
        outputs = self.graphs.outputs()
        dims = _output_batch_dims(outputs)
        if verdict is None or verdict.out_dims is None:
            if dims is None:
                dims = []
                inputs.exact_only = inputs.exact_only or "the output's structure differs between buckets"
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
                inputs.exact_only = inputs.exact_only or (
                    f"the outputs at bucket {size} are not the largest bucket's cut along the batch dim"
                )
                return dims or []
        return list(verdict.out_dims)

    def _check_host_args(self, graph: Any) -> None:
        for call_name, op_name in self.config.host_args:
            if not any(t.is_auto and t.takes(op_name) for t in graph.tasks):
                ops = sorted({t.op for t in graph.tasks}) or ["none"]
                raise DevgraphError(
                    f"host_args names {call_name!r} -> op argument {op_name!r}, but no updatable task in the "
                    f"captured graph takes {op_name!r} (updatable ops captured: {ops}; this device updates "
                    f"{list(self.device.updatable_ops)}). Pass host_args={{'{call_name}': '<op argument>'}}."
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
