"""``DevgraphBreakableBackend``: SGLang's prefill graphs captured by devgraph's breakable capture.

SGLang 0.5.23 prepares prefill graphs with its breakable backend (``--cuda-graph-backend-prefill
breakable``, its default on CUDA since sgl-project/sglang#30409): ``PrefillCudaGraphRunner`` builds one
dummy extend batch per token bucket (largest first), captures the transformer body
(``layer_model.forward``) of each, and at replay pads a batch to the next bucket, replays the body
and runs the LM head eagerly. Its backend captures ``torch.cuda.CUDAGraph`` segments cut at
``eager_on_graph`` markers. This backend keeps SGLang's runner whole and captures each bucket as one
``devgraph.BreakableGraph`` instead: segment graphs of devgraph's device (CPU reference, NPU, ...) in
the pool every devgraph SGLang backend shares, cut at the ``devgraph`` attention backend's prefill
op (``devgraph_sglang::extend_attention``, one per layer), which runs eagerly between the segments at
every replay over the replayed batch (``set_extend_batch``). Nothing is traced or compiled.

SGLang's own breakable flag (``enable_breakable_cuda_graph``) stays off: with it, ``RadixAttention``
routes attention through SGLang's CUDA segment splitter instead of the attention backend. Inside a
segment, everything a graph cannot see (a host sync, a per-call host list given to a custom op) is
refused at capture by devgraph's capture checks, with the op and the model's source line: the engine
stops at start rather than replaying a frozen value.

SGLang has no platform hook for the prefill backend (``resolve_prefill_backend`` always builds its
CUDA classes), so ``resolve_prefill_backend_hook`` is registered around it through SGLang's plugin
hook registry (``_plugin.register``), only when ``SGLANG_PLATFORM=devgraph``; it builds this backend
when the platform is devgraph's and passes every other call through.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from sglang.srt.model_executor.runner_backend.breakable_cuda_graph_backend import (
    BreakableCudaGraphBackend,
)

from devgraph._errors import DevgraphError
from devgraph.adapters.sglang import _stats
from devgraph.adapters.sglang._attention import EXTEND_ATTENTION, DevgraphAttentionBackend
from devgraph.adapters.sglang._backend import (
    GraphHolder,
    _weak_outputs,
    devgraph_device_for,
    shared_pool,
    tp_barrier,
    warmup_runs,
)
from devgraph.graph import BreakableGraph, GraphSet

logger = logging.getLogger(__name__)

#: The dotted path of SGLang's prefill backend resolution, which devgraph's hook wraps.
RESOLVE_PREFILL_BACKEND = "sglang.srt.model_executor.runner_backend.utils.resolve_prefill_backend"


class DevgraphBreakableBackend(GraphHolder, BreakableCudaGraphBackend):
    """SGLang's prefill graph backend over ``devgraph.BreakableGraph``: one per token bucket.

    A ``BreakableCudaGraphBackend`` to SGLang's runner (which checks for that class to capture the
    transformer body, keep its static request buffers and run the LM head eagerly), built by
    ``resolve_prefill_backend_hook`` with the runner and SGLang's options. Needs the ``devgraph``
    attention backend (its prefill op is the break); ``--enable-memory-saver`` is refused.

    Raises:
        DevgraphError: another attention backend, or the memory saver.
    """

    def __init__(
        self,
        cuda_graph_runner: Any,
        *,
        enable_memory_saver: bool = False,
        debug_eager: bool = False,
        **_options: Any,
    ) -> None:
        if enable_memory_saver:
            raise DevgraphError(
                "devgraph's SGLang prefill graphs do not support --enable-memory-saver (their pool cannot "
                "be released and restored); turn the memory saver off, or prefill graphs off with "
                "--cuda-graph-backend-prefill disabled."
            )
        attention = getattr(cuda_graph_runner.model_runner, "attn_backend", None)
        if not isinstance(attention, DevgraphAttentionBackend):
            raise DevgraphError(
                "devgraph's SGLang prefill graphs need the devgraph attention backend (its prefill "
                "attention is the op the graphs break at), not "
                f"{type(attention).__name__}: pass --attention-backend devgraph, or turn prefill graphs "
                "off with --cuda-graph-backend-prefill disabled."
            )
        self._runner = cuda_graph_runner
        self._attention = attention
        self._device = devgraph_device_for(cuda_graph_runner.model_runner.device)
        device = self._device

        def make() -> BreakableGraph:
            # A BreakableGraph is a Replayable like a Graph: the set holds one per bucket.
            return BreakableGraph(device, breaks=(EXTEND_ATTENTION,))

        self._graphs: GraphSet[Any, BreakableGraph] = GraphSet(
            device, shared_pool(device), weaken=_weak_outputs, make=make
        )
        self._in_session = False
        self._inputs_keepalive: dict[Any, Any] = {}
        if debug_eager:
            logger.info("devgraph prefill graphs: --debug-cuda-graph has no effect on devgraph's capture")

    @property
    def graphs(self) -> Mapping[Any, BreakableGraph]:
        """The breakable graph of every captured ``ShapeKey`` (read-only view)."""
        return dict(self._graphs.items())

    # -- BaseCudaGraphBackend -----------------------------------------------------------------
    # (SGLang's own breakable flag stays off: attention then reaches the devgraph backend's break op.)

    def capture_one(
        self,
        shape_key: Any,
        forward_fn: Callable[[], Any],
        capture_inputs: Any = None,
        post_warmup_hook: Callable[[], None] | None = None,
    ) -> None:
        self._require_session()
        start = time.perf_counter()
        self._attention.breakable = True
        try:
            for _ in range(warmup_runs(self._device)):
                self._device.synchronize()
                tp_barrier()
                forward_fn()
                if post_warmup_hook is not None:
                    post_warmup_hook()
            if capture_inputs is not None:
                # The segments read these by address: keep their owners alive as long as the graphs.
                self._inputs_keepalive[shape_key] = capture_inputs
            self._graphs.capture(shape_key, lambda graph: forward_fn())
        finally:
            self._attention.breakable = False
        graph = self._graphs.graph(shape_key)
        assert isinstance(graph, BreakableGraph)
        size = getattr(shape_key, "size", shape_key)
        seconds = time.perf_counter() - start
        info = {"segments": len(graph.graphs), "breaks": len(graph.captured_breaks)}

        def update(s: _stats.GraphStats) -> None:
            s.prefill_captured.append(size)
            s.prefill_graphs[size] = info
            s.prefill_capture_s += seconds

        _stats.record(update)
        logger.debug(
            "devgraph: prefill graph of %s tokens on %s: %d segments, %d breaks, %.3f s",
            size,
            self._device,
            info["segments"],
            info["breaks"],
            seconds,
        )

    def replay(self, shape_key: Any, static_forward_batch: Any, **kwargs: Any) -> Any:
        # The breaks attend over the batch being replayed (its lengths, prefixes and KV slots).
        self._attention.set_extend_batch(static_forward_batch)
        output = self._graphs.replay(shape_key)
        size = getattr(shape_key, "size", None)
        raw = getattr(self._runner, "raw_num_tokens", None)
        padded = size - raw if isinstance(size, int) and isinstance(raw, int) and raw < size else 0

        def update(s: _stats.GraphStats) -> None:
            s.prefill_replays[size] += 1
            s.prefill_padded_tokens += padded

        _stats.record(update)
        return output


def _is_devgraph_platform() -> bool:
    from sglang.srt.platforms import current_platform

    return getattr(current_platform, "is_devgraph", False) is True


def resolve_prefill_backend_hook(original: Callable[..., Any], cuda_graph_runner: Any) -> Any:
    """Around SGLang's ``resolve_prefill_backend``: devgraph's breakable backend on devgraph's platform.

    Any other platform gets SGLang's own resolution. On devgraph's platform, the ``breakable``
    prefill backend is ``DevgraphBreakableBackend``; ``full`` (SGLang's whole-forward CUDA graphs) is
    refused, naming the setting to use.

    Raises:
        DevgraphError: ``--cuda-graph-backend-prefill full`` under devgraph.
    """
    if not _is_devgraph_platform():
        return original(cuda_graph_runner)
    from sglang.srt.model_executor.cuda_graph_config import Backend
    from sglang.srt.runtime_context import get_exec

    config = get_exec().graph.cuda_graph_config
    backend = config.prefill.backend if config is not None else Backend.BREAKABLE
    if backend != Backend.BREAKABLE:
        raise DevgraphError(
            f"devgraph's SGLang platform captures prefill graphs by breakable capture only, not "
            f"--cuda-graph-backend-prefill {backend}: pass --cuda-graph-backend-prefill breakable, or "
            "disabled for eager prefill."
        )
    graph = get_exec().graph
    return DevgraphBreakableBackend(
        cuda_graph_runner,
        enable_memory_saver=get_exec().features.enable_memory_saver,
        debug_eager=getattr(graph, "debug_cuda_graph", False),
    )
