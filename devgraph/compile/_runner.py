"""PiecewiseRunner: a model cut at its splitting ops, each piece captured per token-count bucket.

The runner reads calls like ``GraphRunner`` (batched tensors padded into static buffers, host lists
padded and forwarded, outputs sliced back), but instead of one graph per size it traces the model
once with Dynamo (``DevgraphBackend``: aten lowering, passes, split, per-piece compile), then
captures every piece per size into one shared pool, largest size first. A call replays the pieces'
graphs with the splitting ops (attention) run eagerly in between, so attention sees the call's real
metadata. A call larger than every captured size runs the compiled pieces uncaptured.

Modes (after vLLM's CUDAGraphMode): ``piecewise`` serves every call this way;
``full_and_piecewise`` sends uniform decode batches (``is_decode``) to a full-graph
``GraphRunner`` and everything else (prefill, mixed batches) through the pieces.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch.utils._pytree import tree_unflatten

from devgraph._capture import user_stacklevel
from devgraph._contract import Device
from devgraph._errors import CaptureError, DevgraphError
from devgraph.compile._config import CompileConfig
from devgraph.compile._planner import CapturePlan, plan_capture_sizes
from devgraph.compile._trace import DevgraphBackend, Traced, trace_call
from devgraph.runner import GraphRunner, RunnerConfig, RunnerStats, choose_bucket, normalise_batch_sizes
from devgraph.runner._calls import Call, Unsupported, read_call, signature_of, template_mismatch
from devgraph.runner._runner import _gc_frozen, _progress, _ranges

__all__ = ["PiecewiseRunner", "PiecewiseStats", "piecewise_runner"]

logger = logging.getLogger("devgraph")


@attrs.define
class PiecewiseStats:
    """Counters of a PiecewiseRunner (``graphed.stats``).

    ``replays`` counts piecewise replays; ``eager_calls`` calls that ran without graphs (a size
    above the captured ones runs the compiled pieces uncaptured: ``fallbacks['size_not_captured']``);
    ``full`` holds the full-graph runner's own stats in ``full_and_piecewise`` mode.
    """

    replays: int = 0
    eager_calls: int = 0
    fallbacks: dict[str, int] = attrs.field(factory=dict)
    compile_seconds: float = 0.0
    capture_seconds: float = 0.0
    pool_bytes: int = 0
    captured_sizes: tuple[int, ...] = ()
    dropped_sizes: tuple[int, ...] = ()
    pieces: int = 0
    splitting_ops: int = 0
    passes: dict[str, int] = attrs.field(factory=dict)
    full: RunnerStats | None = None


class PiecewiseRunner:
    """Serve calls of ``fn`` from per-piece graphs (see the module docstring).

    Args:
        fn: the model (an ``nn.Module`` or callable taking tensors).
        device: the devgraph device to capture on.
        config: a ``RunnerConfig`` (pad values, host args, batch dims, the full graph's batch sizes).
        compile_config: a ``CompileConfig`` (mode, splitting ops, compile backend, passes, sizes).
    Raises:
        DevgraphError: ``full_and_piecewise`` without a way to tell decode batches (``is_decode``).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        device: Device,
        config: RunnerConfig | None = None,
        compile_config: CompileConfig | None = None,
    ) -> None:
        self.fn = fn
        self.device = device
        self.compile_config = compile_config or CompileConfig()
        mode = self.compile_config.mode
        if mode == "full":
            raise DevgraphError(
                "PiecewiseRunner serves mode='piecewise' or 'full_and_piecewise'; use GraphRunner"
            )
        self.config = attrs.evolve(config or RunnerConfig(), mode=mode)
        full_sizes = normalise_batch_sizes(self.config.batch_sizes, self.config.max_batch_size)
        requested = self.compile_config.capture_sizes
        self.sizes: list[int] = list(requested) if requested else full_sizes
        self.full: GraphRunner | None = None
        self.is_decode: Callable[..., bool] | None = None
        if mode == "full_and_piecewise":
            self.is_decode = self.compile_config.is_decode or getattr(fn, "devgraph_is_decode", None)
            if self.is_decode is None:
                raise DevgraphError(
                    "mode='full_and_piecewise' needs to tell uniform decode batches (full graph) from prefill "
                    "and mixed batches (piecewise): pass is_decode=fn, called with the call's arguments by "
                    "name and returning True for a decode batch (or give the model a devgraph_is_decode method)"
                )
            self.full = GraphRunner(fn, device, attrs.evolve(self.config, mode="full"))
        from devgraph.compile.passes import resolve_passes

        resolve_passes(self.compile_config.passes, device)  # unknown pass names fail here, not at trace
        self.stats = PiecewiseStats(full=self.full.stats if self.full else None)
        self.plan: CapturePlan | None = None
        self._signature = signature_of(fn)
        self._traced: Traced | None = None
        self._buffers: dict[str, torch.Tensor] = {}
        self._template: dict[str, Any] | None = None
        self._weights: dict[str, tuple[torch.Tensor, int]] = {}
        self._warned: set[str] = set()
        self._lock = threading.RLock()

    # -- public --------------------------------------------------------------------------------

    @property
    def module(self) -> Any:
        """The ``PiecewiseModule`` (None before the first call or ``capture``)."""
        return self._traced.compiled.module if self._traced else None

    @property
    def traced(self) -> Traced | None:
        """The trace: compiled graph, pieces, pass counts (None before the first call)."""
        return self._traced

    @property
    def captured(self) -> bool:
        return self._traced is not None

    @property
    def cache_key(self) -> str:
        """A key of everything that changes what this runner compiles and captures."""
        parts = (
            self.config.uuid(),
            self.compile_config.uuid(self.device),
            self.device.name,
            torch.__version__,
        )
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock, torch.no_grad():
            if self.full is not None and self._is_decode(args, kwargs):
                return self.full(*args, **kwargs)
            try:
                call = read_call(self._signature, self.config, args, kwargs)
                if self._traced is None:
                    self._build(call)
                return self._serve(call)
            except Unsupported as why:
                return self._fallback(why, args, kwargs)

    def capture(self, *example_args: Any, **example_kwargs: Any) -> PiecewiseRunner:
        """Trace, compile and capture now from an example call (any size); the full graphs too."""
        with self._lock, torch.no_grad():
            try:
                call = read_call(self._signature, self.config, example_args, example_kwargs)
            except Unsupported as why:
                raise DevgraphError(f"cannot capture from this example call: {why.detail}") from None
            self.reset()
            self._build(call)
            if self.full is not None:
                self.full.capture(*example_args, **example_kwargs)
        return self

    def reset(self) -> None:
        """Drop the trace and every captured graph (the next call builds them again)."""
        with self._lock:
            if self._traced is not None:
                self._traced.compiled.module.reset()
            self._traced = None
            self._buffers.clear()
            self._template = None
            self.plan = None
            if self.full is not None:
                self.full.reset()

    # -- build ---------------------------------------------------------------------------------

    def _is_decode(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        assert self.is_decode is not None
        try:
            bound = self._signature.bind(*args, **kwargs)
        except TypeError:
            return False
        bound.apply_defaults()
        return bool(self.is_decode(**bound.arguments))

    def _build(self, example: Call) -> None:
        cfg = self.config
        largest = max(self.sizes)
        # The trace marks the token dim dynamic; Dynamo specialises sizes 0 and 1, so trace with >= 2.
        trace_size = max(2, largest)
        for name, x in example.batched.items():
            d = cfg.batch_dim(name)
            shape = list(x.shape)
            shape[d] = trace_size
            self._buffers[name] = torch.full(shape, cfg.pad_value(name), dtype=x.dtype, device=x.device)
        self._template = example.template(cfg)

        def invoke(tensors: dict[str, torch.Tensor], traced: bool) -> Any:
            values: dict[str, Any] = dict(tensors)
            values.update(example.consts)
            for name in example.host:
                values[name] = [] if traced else [cfg.pad_value(name)] * trace_size
            args, kwargs = example.bind(self._signature, values)
            return self.fn(*args, **kwargs)

        tensors = {n: b.narrow(cfg.batch_dim(n), 0, trace_size) for n, b in self._buffers.items()}
        tensors.update(example.static)
        dynamic = {n: cfg.batch_dim(n) for n in example.batched}
        host = {op: [cfg.pad_value(arg)] * trace_size for arg, op in cfg.host_args}
        backend = DevgraphBackend(self.device, self.compile_config, host_args=[op for _, op in cfg.host_args])
        start = time.perf_counter()
        self._traced = traced = trace_call(invoke, tensors, dynamic, backend, host)
        self.stats.compile_seconds = time.perf_counter() - start
        module = traced.compiled.module
        self.stats.pieces = module.captured_pieces
        self.stats.splitting_ops = sum(p.is_splitting_op for p in traced.compiled.split.pieces)
        self.stats.passes = dict(traced.compiled.pass_counts)
        self._remember_weights()
        self._capture_all(example)

    def _budget(self) -> int | None:
        budget = self.compile_config.capture_budget or self.device.capture_stream_budget
        if budget is not None and self.full is not None:
            budget -= len(self.full.sizes)  # one graph per decode batch size (assumed one stream each)
        return budget

    def _capture_all(self, example: Call) -> None:
        assert self._traced is not None
        module = self._traced.compiled.module
        traffic = dict(self.compile_config.traffic) if self.compile_config.traffic else None
        budget = self._budget()
        if budget is not None and budget < 1:
            logger.warning("devgraph: the full graphs use the whole capture budget; pieces are not captured")
            self.plan = CapturePlan((), tuple(self.sizes), max(1, module.captured_pieces), budget)
        else:
            self.plan = plan_capture_sizes(self.sizes, max(1, module.captured_pieces), budget, traffic)
        self.stats.captured_sizes = self.plan.sizes
        self.stats.dropped_sizes = self.plan.dropped
        pool = self.device.pool()
        stream = self.device.stream()  # one side stream for every size (pool reuse is per stream on CUDA)
        start = time.perf_counter()
        with _gc_frozen():
            before = self.device.memory_stats().reserved
            for size in _progress(
                sorted(self.plan.sizes, reverse=True), f"devgraph piecewise capture ({self.device})"
            ):
                self._capture_size(example, size, pool, stream)
        self.stats.capture_seconds = time.perf_counter() - start
        self.stats.pool_bytes = self.device.memory_stats().reserved - before
        if self.plan.sizes:
            logger.info(
                "devgraph: captured %d pieces x %d sizes (%s) on %s in %.2f s, pool %.1f MiB; %d splitting ops "
                "run eagerly in between",
                module.captured_pieces,
                len(self.plan.sizes),
                _ranges(list(self.plan.sizes)),
                self.device,
                self.stats.capture_seconds,
                self.stats.pool_bytes / 2**20,
                self.stats.splitting_ops,
            )

    def _host(self, call: Call, size: int) -> dict[str, list[Any]]:
        cfg = self.config
        return {
            op: list(call.host.get(arg, [])) + [cfg.pad_value(arg)] * (size - call.batch)
            for arg, op in cfg.host_args
        }

    def _inputs(self, call: Call, size: int | None) -> list[Any]:
        assert self._traced is not None
        inputs = []
        for kind, value in self._traced.inputs:
            if kind == "fixed":
                inputs.append(value)
            elif value in call.static:
                inputs.append(call.static[value])
            elif size is None:
                inputs.append(call.batched[value])
            else:
                inputs.append(self._buffers[value].narrow(self.config.batch_dim(value), 0, size))
        return inputs

    def _capture_size(self, example: Call, size: int, pool: Any, stream: Any) -> None:
        assert self._traced is not None
        cfg = self.config
        module = self._traced.compiled.module
        for name, buf in self._buffers.items():
            buf.fill_(cfg.pad_value(name))  # padded rows are what warm-up and capture see
        padding = attrs.evolve(example, batch=0, host={})
        host = self._host(padding, size)
        inputs = self._inputs(example, size)
        with stream:
            for _ in range(cfg.warmup_iters):
                module(*inputs, host=host)
        self.device.synchronize()
        try:
            module.capture(inputs, size, pool, stream, host)
        except CaptureError as err:
            remedy = (
                f"{err.remedy}; or run the offending op eagerly between the pieces (splitting_ops=[...]), "
                "or capture fewer sizes (capture_sizes=[...])"
            )
            raise err.with_batch_size(size, remedy) from err
        self.device.synchronize()

    # -- serve ---------------------------------------------------------------------------------

    def _serve(self, call: Call) -> Any:
        assert self._traced is not None and self._template is not None and self.plan is not None
        cfg = self.config
        reason = template_mismatch(self._template, call.template(cfg))
        if reason:
            raise Unsupported("signature_mismatch", f"call differs from the traced one: {reason}")
        module = self._traced.compiled.module
        size = choose_bucket(call.batch, list(self.plan.sizes)) if self.plan.sizes else None
        if size is None:
            # Larger than every captured size (or nothing captured): the compiled pieces, uncaptured.
            self.stats.eager_calls += 1
            self.stats.fallbacks["size_not_captured"] = self.stats.fallbacks.get("size_not_captured", 0) + 1
            if "size_not_captured" not in self._warned:
                self._warned.add("size_not_captured")
                logger.info(
                    "devgraph: %d tokens is above the captured sizes (%s); such calls run the compiled pieces "
                    "without graphs",
                    call.batch,
                    _ranges(list(self.plan.sizes)) or "none",
                )
            host = {op: list(call.host.get(arg, [])) for arg, op in cfg.host_args}
            out = module(*self._inputs(call, None), host=host)
            return self._assemble(out, call.batch, call.batch)
        for name, x in call.batched.items():
            buf = self._buffers[name]
            d = cfg.batch_dim(name)
            buf.narrow(d, 0, call.batch).copy_(x)
            if size > call.batch:
                buf.narrow(d, call.batch, size - call.batch).fill_(cfg.pad_value(name))
        if cfg.debug:
            self._check_weights()
        out = module.replay(self._inputs(call, size), size, self._host(call, size))
        self.stats.replays += 1
        return self._assemble(out, size, call.batch)

    def _assemble(self, flat: Any, size: int, batch: int) -> Any:
        assert self._traced is not None
        traced = self._traced
        outputs = list(flat) if isinstance(flat, (list, tuple)) else [flat]
        leaves = []
        for kind, value in traced.outputs:
            if kind == "const":
                leaves.append(value)
                continue
            t = outputs[value]
            if size != batch:
                for d in traced.batch_dims[value]:
                    t = t.narrow(d, 0, batch)
            leaves.append(t.clone() if self.config.clone_outputs else t)
        return tree_unflatten(leaves, traced.spec)

    def _remember_weights(self) -> None:
        self._weights = {}
        if isinstance(self.fn, torch.nn.Module):
            for n, p in self.fn.named_parameters():
                self._weights[f"parameter {n!r}"] = (p, p.data_ptr())
            for n, b in self.fn.named_buffers():
                self._weights[f"buffer {n!r}"] = (b, b.data_ptr())

    def _check_weights(self) -> None:
        if not isinstance(self.fn, torch.nn.Module):
            return
        live: dict[str, torch.Tensor] = {f"parameter {n!r}": p for n, p in self.fn.named_parameters()}
        live.update({f"buffer {n!r}": b for n, b in self.fn.named_buffers()})
        for what, tensor in live.items():
            if what in self._weights and self._weights[what][1] != tensor.data_ptr():
                raise DevgraphError(
                    f"{what} was replaced since the trace ({self._weights[what][1]:#x} -> {tensor.data_ptr():#x}); "
                    "call .capture() again after loading weights or moving the model"
                )

    def _fallback(self, why: Unsupported, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.config.strict:
            raise DevgraphError(f"cannot serve this call piecewise (strict=True): {why.detail}")
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

    def __repr__(self) -> str:
        return (
            f"<PiecewiseRunner {type(self.fn).__name__} on {self.device}, mode {self.compile_config.mode}, "
            f"sizes {self.sizes}>"
        )


def piecewise_runner(
    fn: Callable[..., Any], device: Device, config: RunnerConfig, **options: Any
) -> PiecewiseRunner:
    """The runner ``devgraph.wrap`` builds for ``mode='piecewise'`` / ``'full_and_piecewise'``.

    ``options`` are ``CompileConfig`` fields (``splitting_ops``, ``compile_backend``, ``passes``,
    ``capture_sizes``, ``capture_budget``, ``traffic``, ``is_decode``); the mode is ``config.mode``.
    """
    return PiecewiseRunner(fn, device, config, CompileConfig(mode=config.mode, **options))
