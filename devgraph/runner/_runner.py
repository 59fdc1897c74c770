"""GraphRunner: one captured graph per batch-size bucket, replayed behind the model's own call.

Capture follows SGLang's runner: static input buffers sized for the largest bucket, buckets
captured largest first into one shared pool, warm-up runs before each capture, garbage collection
frozen while capturing, a progress bar on a terminal and one summary log line (all of it in
``BucketedRunner``). Anything the graphs cannot serve runs eagerly, counted and warned about once.

One call, top to bottom (``graphed(**batch)``; every step is a few lines of the named method):

1. ``GraphedModule.__call__`` -> ``BucketedRunner.__call__``: take the lock, claim the calling
   thread (outputs are views of graph memory), turn autograd off.
2. ``BucketedRunner._call`` -> ``CallReader.read`` (``_calls.py``): bind the arguments to the
   forward's signature -- in full for the first call of each shape (positional count and
   keyword names), then by the binding remembered for that shape -- and classify them into a
   ``Call``: batched tensors, static tensors, host lists, constants, and the batch size.
   ``full_and_piecewise`` reads the call once here and routes that ``Call``.
3. ``_call_read``: an empty batch falls back; the first call captures every bucket.
4. ``GraphRunner._serve``:
   a. ``_check_template``: the call is like the captured one (shapes but the batch dim, dtypes,
      devices, static tensors' addresses, constants) -- or it falls back, eagerly;
   b. ``choose_bucket``: the smallest captured bucket holding the batch;
      with ``check_ranks="every_call"``, ``RankCheck.agree_on_call`` (``_ranks.py``): one all-gather,
      so every rank of the process group replays the same size or every rank raises;
   c. ``_load``: copy each batched tensor into the first rows of its static buffer; fill padding
      only in rows an earlier call left data in (every call for a buffer the model writes itself);
   d. ``padded_host_args``: the host lists padded to the bucket, as the updatable tasks take them;
   e. ``Graph.replay(host_args)``: on a backend whose tasks need a re-issue (the CPU reference,
      NPU) each task is re-issued with the new host values; on CUDA, where the kernels read
      device tensors, the values are only noted, with no per-task work;
   f. ``_slice``: the outputs cut to the real batch along the dim that grows with the bucket.
5. Any ``Unsupported`` on the way: ``_fallback`` runs the model eagerly and counts why.

The piecewise runner (``devgraph.compile._runner``) shares steps 1-3 and 4a-4d, then replays its
pieces (``PiecewiseModule.replay``) instead of one graph.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from devgraph._errors import DevgraphError
from devgraph.graph._contract import Device, Graph, MemoryPool, Stream
from devgraph.graph._weakref import weak_ref_tensors
from devgraph.runner._base import BucketedRunner, SharedCapture
from devgraph.runner._buckets import choose_bucket, normalise_batch_sizes
from devgraph.runner._calls import Call, Unsupported
from devgraph.runner._config import RunnerConfig, RunnerStats
from devgraph.runner._rows import CATEGORY as PADDING_CATEGORY

__all__ = ["GraphRunner"]


class GraphRunner(BucketedRunner):
    """Serve calls of ``fn`` from graphs captured per batch-size bucket.

    Args:
        fn: the model (an ``nn.Module`` or any callable taking tensors).
        device: the devgraph device to capture on.
        config: a ``RunnerConfig``.
        shared: a ``SharedCapture`` (one pool and side stream) to capture into, shared with
            another runner (``full_and_piecewise`` mode); None: a fresh pool per capture.
        caller_serialises: the caller consumes every output under its own lock before any other
            call is made, so calls from several threads are safe without ``clone_outputs``.

    Threads: calls are serialised by a lock. Outputs are views of graph memory overwritten by the
    next call, so unless ``clone_outputs=True`` one live thread at a time may call; a second one
    gets a ``DevgraphError`` naming ``clone_outputs=True`` (a call's output is never another's).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        device: Device,
        config: RunnerConfig | None = None,
        *,
        shared: SharedCapture | None = None,
        caller_serialises: bool = False,
    ) -> None:
        super().__init__(
            fn, device, config or RunnerConfig(), shared=shared, caller_serialises=caller_serialises
        )
        self.sizes = normalise_batch_sizes(self.config.batch_sizes, self.config.max_batch_size)
        self.stats = RunnerStats()
        self._graphs: dict[int, Graph] = {}
        self._outputs: dict[int, Any] = {}
        self._out_dims: list[int | None] = []

    # -- public --------------------------------------------------------------------------------

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def graph(self, batch_size: int) -> Graph:
        """The captured graph of bucket ``batch_size``."""
        if batch_size not in self._graphs:
            raise DevgraphError(f"no graph for batch size {batch_size}; captured: {sorted(self._graphs)}")
        return self._graphs[batch_size]

    # -- capture -------------------------------------------------------------------------------

    def _drop(self) -> None:
        for graph in self._graphs.values():
            graph.reset()
        self._graphs.clear()
        self._outputs.clear()
        super()._drop()

    def _capture(self, example: Call) -> None:
        self._alloc_buffers(example, self.sizes[-1])

        def prepare(size: int) -> tuple[Callable[[], Any], Callable[[MemoryPool, Stream], None]]:
            host = {name: [self.config.pad_value(name)] * size for name in example.host}
            args, kwargs = self._args_for(example, size, host)

            def warm_up() -> Any:
                return self.fn(*args, **kwargs)

            def capture(pool: MemoryPool, stream: Stream) -> None:
                graph = self.device.graph()
                with graph.capture(stream=stream, pool=pool, auto_update_ops=self.device.updatable_ops):
                    out = self.fn(*args, **kwargs)
                # The graph's pool owns the output memory; a strong reference here would stop the
                # next (smaller) bucket from reusing it. Outputs are overwritten by the next replay.
                self._graphs[size], self._outputs[size] = graph, weak_ref_tensors(out)
                self._check_host_args(graph)  # after storing it, so a failure's rollback resets it

            return warm_up, capture

        self._capture_each(
            self.sizes,
            prepare,
            remedy="or capture fewer sizes (batch_sizes=[...] / a smaller max_batch_size), "
            "or run the offending op eagerly (mode='piecewise')",
            summary=f"captured {len(self.sizes)} graphs (batch sizes {{sizes}})",
            desc=f"devgraph capture ({self.device})",
            example=example,
        )
        self._out_dims = self._decide_out_dims(self._padding_verdict)
        self._remember_weights(example)

    def _decide_out_dims(self, verdict: Any) -> list[int | None]:
        """Per output leaf, the dim cut to a call's rows: what the padding check found (one dim that
        grows with the rows, or none), if every captured bucket agrees; else padded calls run eagerly."""
        dims = _output_batch_dims(self._outputs)
        if verdict is None or verdict.out_dims is None:
            if dims is None:
                dims = []
                self._exact_only = self._exact_only or "the output's structure differs between buckets"
            return dims
        for size, out in self._outputs.items():
            leaves = tree_flatten(out)[0]
            largest = tree_flatten(self._outputs[self.sizes[-1]])[0]
            ok = len(leaves) == len(verdict.out_dims) and all(
                (d is None and (not isinstance(leaf, torch.Tensor) or leaf.shape == top.shape))
                or (d is not None and isinstance(leaf, torch.Tensor) and leaf.shape[d] == size)
                for leaf, top, d in zip(leaves, largest, verdict.out_dims)
            )
            if not ok:
                self._exact_only = self._exact_only or (
                    f"the outputs at bucket {size} are not the largest bucket's cut along the batch dim"
                )
                return dims or []
        return list(verdict.out_dims)

    def _args_for(
        self, call: Call, size: int, host: dict[str, list[Any]]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        values: dict[str, Any] = dict(self._narrowed(size))
        values.update(call.static)
        values.update(call.consts)
        values.update(host)
        return call.bind(self._signature, values)

    def _check_host_args(self, graph: Graph) -> None:
        for call_name, op_name in self.config.host_args:
            if not any(t.is_auto and t.takes(op_name) for t in graph.tasks):
                ops = sorted({t.op for t in graph.tasks}) or ["none"]
                raise DevgraphError(
                    f"host_args names {call_name!r} -> op argument {op_name!r}, but no updatable task in the "
                    f"captured graph takes {op_name!r} (updatable ops captured: {ops}; this device updates "
                    f"{list(self.device.updatable_ops)}). Pass host_args={{'{call_name}': '<op argument>'}}."
                )

    # -- replay --------------------------------------------------------------------------------

    def _serve(self, call: Call) -> Any:
        self._check_template(call, "captured")
        size = choose_bucket(call.batch, self.sizes)
        if self._rank_check is not None:
            self._rank_check.agree_on_call(size)
        if size is None:
            raise Unsupported(
                "batch_too_large", f"batch {call.batch} is outside the captured buckets (1..{self.sizes[-1]})"
            )
        if self._exact_only is not None and size != call.batch:
            raise Unsupported(PADDING_CATEGORY, f"{self._exact_only}; batch sizes {self.sizes} still replay")
        self._load(call, size)
        host_args = self.padded_host_args(call.host, size) if self.config.host_args else None
        if self.config.debug:
            self._weights.check(self.fn)
        self._graphs[size].replay(host_args)
        self.stats.replays += 1
        return self._slice(self._outputs[size], size, call.batch)

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
