"""GraphRunner: one captured graph per batch-size bucket, replayed behind the model's own call.

Capture follows SGLang's runner: static input buffers sized for the largest bucket, buckets
captured largest first into one shared pool, warm-up runs before each capture, garbage collection
frozen while capturing, a progress bar on a terminal and one summary log line. A call is copied
into the buffers, padded up to the nearest bucket, the host-side metadata (``host_args``) reaches
the graph's updatable tasks through ``Graph.replay(host_args)``, and outputs come back sliced to
the real batch. Anything the graphs cannot serve runs eagerly, counted and warned about once.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from devgraph._capture import user_stacklevel
from devgraph._contract import Device, Graph
from devgraph._errors import CaptureError, DevgraphError
from devgraph._weakref import weak_ref_tensors
from devgraph.runner._buckets import choose_bucket, normalise_batch_sizes
from devgraph.runner._calls import Call, Unsupported, read_call, signature_of, template_mismatch
from devgraph.runner._config import RunnerConfig, RunnerStats

__all__ = ["GraphRunner"]

logger = logging.getLogger("devgraph")


def _progress(items: list[int], desc: str) -> Iterable[int]:
    if not sys.stderr.isatty():
        return items
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, unit="graph", leave=False)


@contextlib.contextmanager
def _gc_frozen():
    """Collect once, then freeze: a collection during capture would walk every live object."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class GraphRunner:
    """Serve calls of ``fn`` from graphs captured per batch-size bucket.

    Args:
        fn: the model (an ``nn.Module`` or any callable taking tensors).
        device: the devgraph device to capture on.
        config: a ``RunnerConfig``.
    """

    def __init__(self, fn: Callable[..., Any], device: Device, config: RunnerConfig | None = None) -> None:
        self.fn = fn
        self.device = device
        self.config = config or RunnerConfig()
        self.sizes = normalise_batch_sizes(self.config.batch_sizes, self.config.max_batch_size)
        self.stats = RunnerStats()
        self._signature = signature_of(fn)
        self._graphs: dict[int, Graph] = {}
        self._outputs: dict[int, Any] = {}
        self._buffers: dict[str, torch.Tensor] = {}
        self._template: dict[str, Any] | None = None
        self._captured: Call | None = None
        self._addresses: dict[str, tuple[torch.Tensor, int]] = {}
        self._out_dims: list[int | None] = []
        self._warned: set[str] = set()
        self._lock = threading.RLock()

    # -- public --------------------------------------------------------------------------------

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def graph(self, batch_size: int) -> Graph:
        """The captured graph of bucket ``batch_size``."""
        if batch_size not in self._graphs:
            raise DevgraphError(f"no graph for batch size {batch_size}; captured: {sorted(self._graphs)}")
        return self._graphs[batch_size]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock, torch.no_grad():
            try:
                call = read_call(self._signature, self.config, args, kwargs)
                if not self._graphs:
                    self._capture(call)
                return self._replay(call)
            except Unsupported as why:
                return self._fallback(why, args, kwargs)

    def capture(self, *example_args: Any, **example_kwargs: Any) -> GraphRunner:
        """Capture every bucket now, using an example call (any batch size) for shapes and types."""
        with self._lock, torch.no_grad():
            try:
                call = read_call(self._signature, self.config, example_args, example_kwargs)
            except Unsupported as why:
                raise DevgraphError(f"cannot capture from this example call: {why.detail}") from None
            self.reset()
            self._capture(call)
        return self

    def reset(self) -> None:
        """Drop every captured graph (the next call captures again)."""
        with self._lock:
            for graph in self._graphs.values():
                graph.reset()
            self._graphs.clear()
            self._outputs.clear()
            self._buffers.clear()
            self._template = None
            self._captured = None

    # -- capture -------------------------------------------------------------------------------

    def _capture(self, example: Call) -> None:
        cfg = self.config
        largest = self.sizes[-1]
        for name, x in example.batched.items():
            d = cfg.batch_dim(name)
            shape = list(x.shape)
            shape[d] = largest
            self._buffers[name] = torch.full(shape, cfg.pad_value(name), dtype=x.dtype, device=x.device)
        self._template = example.template(cfg)
        self._captured = example
        pool = self.device.pool()
        # One side stream for every bucket: CUDA's allocator reuses a shared pool's freed blocks
        # only on the stream that allocated them.
        stream = self.device.stream()
        start = time.perf_counter()
        graphs: dict[int, Graph] = {}
        outputs: dict[int, Any] = {}
        try:
            with _gc_frozen():
                before = self.device.memory_stats().reserved  # after the collection: dead pools are gone
                for size in _progress(sorted(self.sizes, reverse=True), f"devgraph capture ({self.device})"):
                    graphs[size], outputs[size] = self._capture_one(example, size, pool, stream)
        except BaseException:
            # All buckets or none: a half-captured runner would replay some sizes and not others.
            for graph in graphs.values():
                graph.reset()
            self.reset()
            raise
        self._graphs, self._outputs = graphs, outputs
        self._out_dims = _output_batch_dims(outputs)
        self.stats.capture_seconds = time.perf_counter() - start
        self.stats.pool_bytes = self.device.memory_stats().reserved - before
        self.stats.captured_sizes = tuple(self.sizes)
        self._remember_addresses()
        logger.info(
            "devgraph: captured %d graphs (batch sizes %s) on %s in %.2f s, pool %.1f MiB",
            len(self.sizes),
            _ranges(self.sizes),
            self.device,
            self.stats.capture_seconds,
            self.stats.pool_bytes / 2**20,
        )

    def _args_for(
        self, call: Call, size: int, host: dict[str, list[Any]]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        values: dict[str, Any] = {
            n: b.narrow(self.config.batch_dim(n), 0, size) for n, b in self._buffers.items()
        }
        values.update(call.static)
        values.update(call.consts)
        values.update(host)
        return call.bind(self._signature, values)

    def _capture_one(self, example: Call, size: int, pool: Any, stream: Any) -> tuple[Graph, Any]:
        cfg = self.config
        for name, buf in self._buffers.items():
            buf.fill_(cfg.pad_value(name))  # padded rows are what warm-up and capture see
        host = {name: [cfg.pad_value(name)] * size for name in example.host}
        args, kwargs = self._args_for(example, size, host)
        stream.wait_stream(self.device.current_stream())  # the buffer fill above runs on the current stream
        with stream:
            for _ in range(cfg.warmup_iters):
                self.fn(*args, **kwargs)
        self.device.synchronize()
        graph = self.device.graph()
        try:
            with graph.capture(stream=stream, pool=pool, auto_update_ops=self.device.updatable_ops):
                out = self.fn(*args, **kwargs)
        except CaptureError as err:
            remedy = (
                f"{err.remedy}; or capture fewer sizes (batch_sizes=[...] / a smaller max_batch_size), "
                "or run the offending op eagerly (mode='piecewise')"
            )
            raise err.with_batch_size(size, remedy) from err
        self.device.synchronize()
        self._check_host_args(graph)
        # The graph's pool owns the output memory; a strong reference here would stop the next
        # (smaller) bucket from reusing it. Outputs are overwritten by the next replay anyway.
        return graph, weak_ref_tensors(out)

    def _check_host_args(self, graph: Graph) -> None:
        for call_name, op_name in self.config.host_args:
            if not any(t.is_auto and t.takes(op_name) for t in graph.tasks):
                ops = sorted({t.op for t in graph.tasks}) or ["none"]
                raise DevgraphError(
                    f"host_args names {call_name!r} -> op argument {op_name!r}, but no updatable task in the "
                    f"captured graph takes {op_name!r} (updatable ops captured: {ops}; this device updates "
                    f"{list(self.device.updatable_ops)}). Pass host_args={{'{call_name}': '<op argument>'}}."
                )

    def _remember_addresses(self) -> None:
        self._addresses = {f"input {n!r}": (b, b.data_ptr()) for n, b in self._buffers.items()}
        assert self._captured is not None
        for n, t in self._captured.static.items():
            self._addresses[f"static argument {n!r}"] = (t, t.data_ptr())
        if isinstance(self.fn, torch.nn.Module):
            for n, p in self.fn.named_parameters():
                self._addresses[f"parameter {n!r}"] = (p, p.data_ptr())
            for n, b in self.fn.named_buffers():
                self._addresses[f"buffer {n!r}"] = (b, b.data_ptr())

    # -- replay --------------------------------------------------------------------------------

    def _replay(self, call: Call) -> Any:
        cfg = self.config
        assert self._template is not None
        reason = template_mismatch(self._template, call.template(cfg))
        if reason:
            raise Unsupported("signature_mismatch", f"call differs from the captured one: {reason}")
        size = choose_bucket(call.batch, self.sizes)
        if size is None:
            kind = "batch_too_large" if call.batch > self.sizes[-1] else "empty_batch"
            raise Unsupported(
                kind, f"batch {call.batch} is outside the captured buckets (1..{self.sizes[-1]})"
            )
        for name, x in call.batched.items():
            buf = self._buffers[name]
            d = cfg.batch_dim(name)
            buf.narrow(d, 0, call.batch).copy_(x)
            if size > call.batch:
                buf.narrow(d, call.batch, size - call.batch).fill_(cfg.pad_value(name))
        host_args = self.padded_host_args(call.host, size)
        if cfg.debug:
            self._check_addresses()
        self._graphs[size].replay(host_args or None)
        self.stats.replays += 1
        return self._slice(self._outputs[size], size, call.batch)

    def padded_host_args(self, host: dict[str, list[Any]], size: int) -> dict[str, list[Any]]:
        """The updatable tasks' host arguments for a call's host lists padded to bucket ``size``
        (``{op argument: values}``, as ``Graph.replay(host_args=...)`` takes them)."""
        cfg = self.config
        return {
            op_name: list(host[call_name]) + [cfg.pad_value(call_name)] * (size - len(host[call_name]))
            for call_name, op_name in cfg.host_args
        }

    def _slice(self, outputs: Any, size: int, batch: int) -> Any:
        leaves, spec = tree_flatten(outputs)
        cut = []
        for leaf, dim in zip(leaves, self._out_dims):
            if isinstance(leaf, torch.Tensor):
                if dim is not None and batch != size:
                    leaf = leaf.narrow(dim, 0, batch)
                if self.config.clone_outputs:
                    leaf = leaf.clone()
            cut.append(leaf)
        return tree_unflatten(cut, spec)

    def _check_addresses(self) -> None:
        for what, (tensor, ptr) in self._addresses.items():
            if tensor.data_ptr() != ptr:
                raise DevgraphError(
                    f"{what} no longer lives at its capture address ({ptr:#x} -> {tensor.data_ptr():#x}); "
                    "the graphs would read stale memory. Call .capture() again after moving or replacing it."
                )
        if isinstance(self.fn, torch.nn.Module):
            live: dict[str, torch.Tensor] = {f"parameter {n!r}": p for n, p in self.fn.named_parameters()}
            live.update({f"buffer {n!r}": b for n, b in self.fn.named_buffers()})
            for what, tensor in live.items():
                if what in self._addresses and self._addresses[what][1] != tensor.data_ptr():
                    raise DevgraphError(
                        f"{what} was replaced since capture ({self._addresses[what][1]:#x} -> "
                        f"{tensor.data_ptr():#x}); call .capture() again after loading weights or moving the model."
                    )

    def _fallback(self, why: Unsupported, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.config.strict:
            raise DevgraphError(f"cannot serve this call from a graph (strict=True): {why.detail}")
        self.stats.fallbacks[why.category] = self.stats.fallbacks.get(why.category, 0) + 1
        self.stats.eager_calls += 1
        if why.category not in self._warned:
            self._warned.add(why.category)
            warnings.warn(
                f"devgraph: running eagerly ({why.category}): {why.detail}. "
                "Further calls like this fall back silently; see .stats.fallbacks.",
                stacklevel=user_stacklevel(),
            )
        return self.fn(*args, **kwargs)


def _output_batch_dims(outputs: dict[int, Any]) -> list[int | None]:
    """Per output leaf, the dim that grows with the bucket (None: not batched).

    With two or more buckets it is the dim whose size equals the bucket size in each of them; with
    one bucket, the first dim equal to that size.
    """
    sizes = sorted(outputs)
    flat = {s: tree_flatten(outputs[s])[0] for s in sizes}
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


def _ranges(sizes: list[int]) -> str:
    return ", ".join(map(str, sizes)) if len(sizes) <= 8 else f"{sizes[0]}..{sizes[-1]} ({len(sizes)})"
