"""vLLM's PIECEWISE graphs as devgraph breakable graphs of the whole model, with no torch.compile.

vLLM has two ways to serve its PIECEWISE runtime mode: pieces of a Dynamo trace split at its
attention ops (``CompilationMode.VLLM_COMPILE``), or, behind its own flag
``VLLM_USE_BREAKABLE_CUDAGRAPH=1``, one stream capture over the whole uncompiled forward that ends a
segment at each attention call, runs it eagerly and resumes (``BreakableCUDAGraphWrapper``, CUDA
graphs only). With ``DEVGRAPH_VLLM=1`` and that same flag, a breakable ``DevgraphGraphWrapper``
(``DevgraphGraphWrapper.breakable(...)``: breakable is a constructor argument, ``breaks=``) takes the
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

from typing import Any

import torch

from devgraph._errors import DevgraphError
from devgraph.graph import BreakableGraph

__all__ = ["KV_CACHE_UPDATE_OPS", "breakable_enabled", "check_breaks", "vllm_break_ops"]

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


def check_breaks(graph: BreakableGraph, model: Any, breaks: tuple[str, ...], descriptor: Any) -> None:
    """Refuse a breakable capture in which the attention of a layer of ``model`` (vLLM's ``Attention``,
    ``MLAAttention``) did not run as a break: a segment graph then froze the capture step's attention
    metadata, and every replay would attend over it (the torchtitan case, #3685, at vLLM's level).

    Raises:
        DevgraphError: naming the layers and the fix (``splitting_ops``).
    """
    missing = _attention_inside_segments(graph, model)
    if missing:
        raise DevgraphError(
            f"breakable graph for {descriptor}: the attention of layer(s) {', '.join(missing)} did not "
            f"run as a break (breaks: {', '.join(breaks) or 'none'}), so a segment graph captured it "
            "with this step's attention metadata frozen. Add the op the layer calls to "
            "compilation_config={'splitting_ops': [...]}, or unset VLLM_USE_BREAKABLE_CUDAGRAPH"
        )


def _attention_inside_segments(graph: BreakableGraph, model: Any) -> list[str]:
    """The model's attention layers whose attention op did not run as a break of ``graph`` (the layer
    name is the op's ``layer_name`` argument)."""
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.utils.torch_utils import _resolve_layer_name

    modules = model.modules() if isinstance(model, torch.nn.Module) else ()
    layers = [m.layer_name for m in modules if isinstance(m, (Attention, MLAAttention))]
    broken = {
        _resolve_layer_name(b.host_args["layer_name"])
        for b in graph.captured_breaks
        if "layer_name" in b.host_args
    }
    return [name for name in layers if name not in broken]
