"""vLLM's PIECEWISE graphs as devgraph breakable graphs of the whole model, with no torch.compile.

vLLM has two ways to serve its PIECEWISE runtime mode: pieces of a Dynamo trace split at its
attention ops (``CompilationMode.VLLM_COMPILE``), or, behind its own flag
``VLLM_USE_BREAKABLE_CUDAGRAPH=1``, one stream capture over the whole uncompiled forward that ends a
segment at each attention call, runs it eagerly and resumes (``BreakableCUDAGraphWrapper``, CUDA
graphs only). With ``DEVGRAPH_VLLM=1`` and that same flag, ``DevgraphBreakableWrapper`` takes the
place of vLLM's class: a ``devgraph.BreakableGraph`` per batch descriptor, so the CPU reference, CUDA,
NPU and the accelerator backend all serve it.

Breaks are the ops vLLM's compiled PIECEWISE mode splits at (``vllm_break_ops``): its attention
ops (``CompilationConfig._attention_ops``: ``vllm::unified_attention_with_output``, MLA, mamba,
linear attention...), the KV-cache writes it splits at too (``vllm::unified_kv_cache_update``; on
vLLM's CPU platform its kernel is a C++ function no dispatch mode sees, which a segment could not
record), and any ``splitting_ops`` the user listed. Each break reads the step's attention metadata
from vLLM's forward context when it runs, so a replay hands it no host arguments. An op that should
have been a break (a custom op given per-call host lists) is refused at capture by name.

In ``FULL_AND_PIECEWISE`` the platform's FULL ``DevgraphGraphWrapper`` sits around this one, as
vLLM nests ``CUDAGraphWrapper`` around its breakable wrapper: uniform decode batches replay whole
graphs, every other batch that fits a capture size these breakable graphs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from devgraph._errors import DevgraphError
from devgraph.adapters.vllm import _stats
from devgraph.adapters.vllm._wrapper import DevgraphGraphWrapper
from devgraph.graph import BreakableGraph, GraphSet, SharedPool

__all__ = ["KV_CACHE_UPDATE_OPS", "DevgraphBreakableWrapper", "breakable_enabled", "vllm_break_ops"]

#: vLLM's KV-cache writes, which its compiled PIECEWISE mode splits at besides attention (vLLM #33267).
KV_CACHE_UPDATE_OPS = ("vllm::unified_kv_cache_update", "vllm::unified_mla_kv_cache_update")


def breakable_enabled() -> bool:
    """vLLM's own switch for breakable graphs (``VLLM_USE_BREAKABLE_CUDAGRAPH=1``, or vLLM's per-model
    default, which sets that variable while it resolves the config)."""
    from vllm.compilation.breakable_cudagraph import is_breakable_cudagraph_enabled

    return bool(is_breakable_cudagraph_enabled())


def _registered(name: str) -> bool:
    namespace, _, op = name.partition("::")
    return hasattr(getattr(torch.ops, namespace), op)


def vllm_break_ops(vllm_config: Any) -> list[str]:
    """The ops a breakable capture of the model ends a segment at: where vLLM's compiled PIECEWISE
    mode splits (its attention ops, its KV-cache writes, the user's ``splitting_ops``), those this
    process has registered (a model registers its ops when its module is imported)."""
    cc = vllm_config.compilation_config
    names = [*type(cc)._attention_ops, *KV_CACHE_UPDATE_OPS, *(cc.splitting_ops or ())]
    return [name for name in dict.fromkeys(names) if _registered(name)]


class DevgraphBreakableWrapper(DevgraphGraphWrapper):
    """vLLM's PIECEWISE runtime mode served by one devgraph breakable capture of the whole model.

    Args:
        runnable: the model (uncompiled).
        vllm_config: vLLM's config.
        cudagraph_options: vLLM's ``CUDAGraphOptions``.

    Dispatch, capture phase, pool, debug address checks and ``clear_all_graphs`` are
    ``DevgraphGraphWrapper``'s; each batch descriptor's graph is a ``BreakableGraph`` cut at
    ``vllm_break_ops``. Counted in ``stats()`` as ``capture.BREAKABLE``, ``replay.BREAKABLE``,
    ``eager.BREAKABLE``, with ``segments.BREAKABLE`` and ``breaks.BREAKABLE`` (segment graphs and
    breaks over every capture).
    """

    def __init__(self, runnable: Callable[..., Any], vllm_config: Any, cudagraph_options: Any = None) -> None:
        from vllm.config import CUDAGraphMode

        # Before the base class builds the graph set (``_graph_set`` reads it).
        self.breaks = tuple(vllm_break_ops(vllm_config))
        super().__init__(runnable, vllm_config, CUDAGraphMode.PIECEWISE, cudagraph_options)

    @property
    def label(self) -> str:
        return self.role + "BREAKABLE"

    def _graph_set(self, shared: SharedPool) -> GraphSet[Any, BreakableGraph]:
        device, breaks = self.device, self.breaks
        # A BreakableGraph is a Replayable like a Graph: the set holds one per descriptor.
        return GraphSet(device, shared, make=lambda: BreakableGraph(device, breaks))

    def _capture(self, descriptor: Any, args: tuple[Any, ...], kwargs: dict[str, Any], context: Any) -> Any:
        output = super()._capture(descriptor, args, kwargs, context)
        graph: BreakableGraph = self.graphs.graph(descriptor)
        missing = self._attention_inside_segments(graph)
        if missing:
            # The torchtitan case (#3685) at vLLM's level: the attention ran inside a segment graph, which
            # froze the capture step's metadata; every replay would attend over it.
            self.graphs.discard(descriptor)
            self.entries.pop(descriptor, None)
            raise DevgraphError(
                f"breakable graph for {descriptor}: the attention of layer(s) {', '.join(missing)} did not "
                f"run as a break (breaks: {', '.join(self.breaks) or 'none'}), so a segment graph captured it "
                "with this step's attention metadata frozen. Add the op the layer calls to "
                "compilation_config={'splitting_ops': [...]}, or unset VLLM_USE_BREAKABLE_CUDAGRAPH"
            )
        _stats.count("segments", self.label, len(graph.graphs))
        _stats.count("breaks", self.label, len(graph.captured_breaks))
        return output

    def _attention_inside_segments(self, graph: BreakableGraph) -> list[str]:
        """The model's attention layers (vLLM's ``Attention``, ``MLAAttention``) whose attention op did not
        run as a break of ``graph`` (the layer name is the op's ``layer_name`` argument)."""
        from vllm.model_executor.layers.attention.attention import Attention
        from vllm.model_executor.layers.attention.mla_attention import MLAAttention
        from vllm.utils.torch_utils import _resolve_layer_name

        model = self.unwrap()
        modules = model.modules() if isinstance(model, torch.nn.Module) else ()
        layers = [m.layer_name for m in modules if isinstance(m, (Attention, MLAAttention))]
        broken = {
            _resolve_layer_name(b.host_args["layer_name"])
            for b in graph.captured_breaks
            if "layer_name" in b.host_args
        }
        return [name for name in layers if name not in broken]

    def _step_host_args(self, context: Any, graph: Any) -> Mapping[str, Any] | None:
        # Every break reads the step's attention metadata from vLLM's forward context as it runs.
        return None
