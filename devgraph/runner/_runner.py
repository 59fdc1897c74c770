"""GraphRunner: one captured graph per batch-size bucket, replayed behind the model's own call.

Capture follows SGLang's runner: static input buffers sized for the largest bucket, buckets
captured largest first into one shared pool, warm-up runs before each capture, garbage collection
frozen while capturing, a progress bar on a terminal and one summary log line (``CaptureLoop``).
Anything the graphs cannot serve runs eagerly, counted and warned about once.

A runner is composed, not inherited: a ``StaticInputs`` (``_inputs.py``: the call's reading and
matching, the static buffers and their padding, the weight watch), a ``ThreadOwner``, its
``Accounts`` and a ``CaptureLoop`` (``_shared.py``). ``PiecewiseRunner`` (``_piecewise.py``) is
built of the same pieces.

One call, top to bottom (``graphed(**batch)``; ``__call__`` and ``serve`` below, in this order):

1. lock, thread, autograd: take the lock, claim the calling thread (outputs are views of graph
   memory), turn autograd off.
2. read: ``StaticInputs.read`` -> ``CallReader.read`` (``_calls.py``): bind the arguments to the
   forward's signature -- in full for the first call of each shape, then by the binding
   remembered for that shape -- and classify them into a ``Call``: batched tensors, static
   tensors, host lists, constants, and the batch size. (``full_and_piecewise`` reads the call
   once in the piecewise runner and hands the ``Call`` to ``serve``.)
3. an empty batch falls back; a weight replaced since capture drops the graphs (``WeightWatch``);
   the first call captures every bucket.
4. match: ``StaticInputs.match``: the call is like the captured one (shapes but the batch dim,
   dtypes, devices, static tensors' addresses, constants, autocast, default dtype).
5. bucket: ``choose_bucket``, the smallest captured bucket holding the batch; with
   ``check_ranks="every_call"``, ``RankCheck.agree_on_call`` (``_ranks.py``): one all-gather, so
   every rank replays the same size or every rank raises. Padding that changes the result
   (``StaticInputs.exact_only``) serves bucket sizes only.
6. load: ``StaticInputs.load`` copies each batched tensor into the first rows of its static
   buffer and fills padding only in rows an earlier call left data in (every call for a buffer
   the model writes itself); ``padded_host_args`` pads the host lists to the bucket.
7. replay: ``Graph.replay(host_args)``: on a backend whose tasks need a re-issue (the CPU
   reference, NPU) each task is re-issued with the new host values; on CUDA, where the kernels
   read device tensors, the values are only noted, with no per-task work.
8. slice: ``_slice`` cuts the outputs to the real batch along the dim that grows with the bucket.

Any ``Unsupported`` on the way runs the model eagerly (``_eager``), counted by reason.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from devgraph._errors import DevgraphError
from devgraph.graph._contract import Device, Graph, MemoryPool, Stream
from devgraph.graph._weakref import weak_ref_tensors
from devgraph.runner._buckets import choose_bucket, normalise_batch_sizes
from devgraph.runner._calls import Call, Unsupported
from devgraph.runner._config import RunnerConfig, RunnerStats
from devgraph.runner._inputs import StaticInputs
from devgraph.runner._rows import CATEGORY as PADDING_CATEGORY
from devgraph.runner._rows import PaddingVerdict
from devgraph.runner._shared import Accounts, CaptureLoop, SharedCapture, ThreadOwner
from devgraph.runner._state import registrations

__all__ = ["GraphRunner"]


class GraphRunner:
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
        self.fn = fn
        self.device = device
        self.config = config = config or RunnerConfig()
        self.sizes = normalise_batch_sizes(config.batch_sizes, config.max_batch_size)
        self.stats = RunnerStats()
        self._lock = threading.RLock()
        self.inputs = StaticInputs(fn, device, config)
        self.threads = ThreadOwner(config, caller_serialises)
        self.accounts = Accounts(config, self.stats, self._lock, "from a graph")
        self.capture_loop = CaptureLoop(
            self.inputs,
            device,
            config,
            self.stats,
            self.accounts,
            shared=shared,
            size_noun="batch sizes",
            size_options="batch_sizes/max_batch_size",
        )
        if shared is not None:
            shared.users.append(self)
        self._graphs: dict[int, Graph] = {}
        self._outputs: dict[int, Any] = {}
        self._out_dims: list[int | None] = []

    # -- a call, top to bottom -----------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Serve one call (its path, step by step: this module's docstring).

        Raises:
            DevgraphError: a call from a second live thread while outputs are views of graph memory
                (``clone_outputs=False``): the next replay would overwrite the first thread's result.
        """
        with self._lock:
            self.threads.claim()
            if not torch.is_grad_enabled():  # entering no_grad costs as much as reading the call
                return self._call(args, kwargs)
            with torch.no_grad():
                return self._call(args, kwargs)

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            call = self.inputs.read(args, kwargs)  # read
        except Unsupported as why:
            return self._eager(why, args, kwargs)
        return self.serve(call, args, kwargs)

    def serve(self, call: Call, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Serve a call already read (``full_and_piecewise`` reads once and routes the ``Call``);
        ``args``/``kwargs`` run eagerly when it cannot be served from a graph."""
        inputs = self.inputs
        try:
            if call.batch == 0:
                raise Unsupported("empty_batch", "the call has 0 rows; there is nothing to replay")
            if inputs.watch.seen != registrations[0]:  # something registered a weight somewhere: look
                replaced = inputs.watch.replaced()
                if replaced is not None:
                    self._drop()  # captured again just below
                    self.accounts.note_recapture(replaced)
            if not self._graphs:
                self._capture_all(call)
            # match
            inputs.match(call, "captured")
            # bucket
            size = choose_bucket(call.batch, self.sizes)
            if self.capture_loop.rank_check is not None:
                self.capture_loop.rank_check.agree_on_call(size)
            if size is None:
                raise Unsupported(
                    "batch_too_large",
                    f"batch {call.batch} is outside the captured buckets (1..{self.sizes[-1]})",
                )
            if inputs.exact_only is not None and size != call.batch:
                raise Unsupported(
                    PADDING_CATEGORY, f"{inputs.exact_only}; batch sizes {self.sizes} still replay"
                )
            # load
            inputs.load(call, size)
            host_args = inputs.padded_host_args(call.host, size) if self.config.host_args else None
            if self.config.debug:
                inputs.weights.check(self.fn)
            # replay
            self._graphs[size].replay(host_args)
            self.stats.replays += 1
            # slice
            return self._slice(self._outputs[size], size, call.batch)
        except Unsupported as why:
            unsupported = why
        # Outside the except block: an error of the model's own eager run is not chained to ours.
        return self._eager(unsupported, args, kwargs)

    def _eager(self, why: Unsupported, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.accounts.note_fallback(why.category, why.detail)
        return self.fn(*args, **kwargs)

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

    # -- public --------------------------------------------------------------------------------

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def graph(self, batch_size: int) -> Graph:
        """The captured graph of bucket ``batch_size``."""
        if batch_size not in self._graphs:
            raise DevgraphError(f"no graph for batch size {batch_size}; captured: {sorted(self._graphs)}")
        return self._graphs[batch_size]

    def capture(self, *example_args: Any, **example_kwargs: Any) -> GraphRunner:
        """Capture every size now, using an example call (any size) for shapes and types."""
        with self._lock, torch.no_grad():
            try:
                call = self.inputs.read(example_args, example_kwargs)
            except Unsupported as why:
                raise DevgraphError(f"cannot capture from this example call: {why.detail}") from None
            self.reset()
            self._capture_all(call)
        return self

    def reset(self) -> None:
        """Drop every captured graph (the next call captures again).

        Outputs returned earlier are views of graph memory (unless ``clone_outputs=True``): after a
        reset that memory goes back to the pool and the next capture reuses it, so those views read
        garbage. Clone what you keep across a reset.
        """
        with self._lock:
            self._drop()

    def note_fallback(self, category: str, detail: str) -> None:
        """Account for a call served without graphs: raise when ``strict``, else count it in
        ``stats.fallbacks[category]`` and ``stats.eager_calls`` and warn once per category.

        Raises:
            DevgraphError: ``strict=True``.
        """
        self.accounts.note_fallback(category, detail)

    def padded_host_args(self, host: dict[str, list[Any]], size: int) -> dict[str, list[Any]]:
        """The updatable tasks' host arguments for a call's host lists padded to bucket ``size``
        (``{op argument: values}``, as ``Graph.replay(host_args=...)`` takes them)."""
        return self.inputs.padded_host_args(host, size)

    # -- capture -------------------------------------------------------------------------------

    def _drop(self) -> None:
        """Forget the capture (graphs, buffers, template); the counters stay."""
        for graph in self._graphs.values():
            graph.reset()
        self._graphs.clear()
        self._outputs.clear()
        self.inputs.clear()
        self.capture_loop.clear()

    def _capture_all(self, example: Call) -> None:
        self.capture_loop.all_or_nothing(lambda: self._capture(example), self._drop)

    def _capture(self, example: Call) -> None:
        inputs = self.inputs
        inputs.alloc(example, self.sizes[-1])

        def prepare(size: int) -> tuple[Callable[[], Any], Callable[[MemoryPool, Stream], None]]:
            host = {name: [self.config.pad_value(name)] * size for name in example.host}
            values: dict[str, Any] = dict(inputs.narrowed(size))
            values.update(example.static)
            values.update(example.consts)
            values.update(host)
            args, kwargs = example.bind(inputs.signature, values)

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

        self.capture_loop.run(
            self.sizes,
            prepare,
            remedy="or capture fewer sizes (batch_sizes=[...] / a smaller max_batch_size), "
            "or run the offending op eagerly (mode='piecewise')",
            summary=f"captured {len(self.sizes)} graphs (batch sizes {{sizes}})",
            desc=f"devgraph capture ({self.device})",
            example=example,
        )
        self._out_dims = self._decide_out_dims(inputs.padding_verdict)
        inputs.remember(example)

    def _decide_out_dims(self, verdict: PaddingVerdict | None) -> list[int | None]:
        """Per output leaf, the dim cut to a call's rows: what the padding check found (one dim that
        grows with the rows, or none), if every captured bucket agrees; else padded calls run eagerly."""
        inputs = self.inputs
        dims = _output_batch_dims(self._outputs)
        if verdict is None or verdict.out_dims is None:
            if dims is None:
                dims = []
                inputs.exact_only = inputs.exact_only or "the output's structure differs between buckets"
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
                inputs.exact_only = inputs.exact_only or (
                    f"the outputs at bucket {size} are not the largest bucket's cut along the batch dim"
                )
                return dims or []
        return list(verdict.out_dims)

    def _check_host_args(self, graph: Graph) -> None:
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
