"""vLLM's CPU attention, with its decode captured in FULL graphs as an updatable devgraph task.

On vLLM's CPU platform the devgraph platform uses this backend for FULL graphs (devgraph's CPU
reference freezes host arguments). It *is* vLLM's ``CPU_ATTN`` backend (same KV-cache layout, block
sizes, metadata builder and kernels) with two additions:

* the builder declares FULL-graph support for uniform single-token decode batches and hands the
  step's host sequence lengths to the graph wrapper (``devgraph_host_args``);
* inside a FULL graph (vLLM's forward context says ``FULL``), a decode batch calls
  ``devgraph::vllm_cpu_decode_attention``, an updatable task: from the host lengths it builds vLLM's
  scheduler metadata (the per-step work plan vLLM's builder makes on the host, a fresh tensor a
  graph would otherwise freeze) and runs vLLM's own kernel ``cpu_attention_with_kv_cache``. A
  replay re-issues it with the step's lengths (``Graph.replay(host_args=...)``).

Everywhere else (prefill, mixed batches, every eager step) the forward is vLLM's, unchanged. So a
graph step computes what vLLM computes, bit for bit: the same kernel on the same inputs. vLLM's
CPU kernel attends each request independently of the others and of padding rows (checked: rows of
a batch equal the same requests alone, and with zero-length padding rows), so a padded FULL replay
equals the unpadded eager step. Why not devgraph's own ``paged_decode_attention`` on the CPU: its
reference kernel is written with torch ops (a matmul, then softmax), while vLLM's is a vectorised C++
kernel with its own accumulation order and online softmax; they agree to about 1e-6, not bit for bit
(logprobs drifted by up to 4e-5, issue 35).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from vllm import _custom_ops as vllm_ops
from vllm import envs
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType, CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from devgraph._errors import DevgraphError
from devgraph.adapters.vllm._host_args import add_updatable_op

__all__ = ["DECODE_OP", "DevgraphCpuAttentionBackend"]

#: The updatable task a FULL graph captures for each decode attention call.
DECODE_OP = "devgraph::vllm_cpu_decode_attention"


# In devgraph's namespace (defined below): the capture records the call whole (a pure function of its arguments, host
# lengths included), so the scheduler metadata it makes inside, whose size follows the lengths, is not
# a captured intermediate; a task update re-issues the whole call.
def vllm_cpu_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    output: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens_host: list[int],
    scale: float,
    sliding_window: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    sinks: torch.Tensor | None,
    num_heads: int,
    scheduler_window: int,
    isa: str,
    split_kv: bool,
    k_scale: float,
    v_scale: float,
    kv_cache_dtype: str,
) -> None:
    """vLLM's CPU decode attention of ``len(seq_lens_host)`` one-token queries, as vLLM runs it.

    ``seq_lens_host`` are the step's sequence lengths (padding rows: 0); the scheduler metadata is
    built from them exactly as ``CPUAttentionMetadataBuilder.build`` does (``num_heads``,
    ``scheduler_window``, ``isa``, ``split_kv``: the builder's values).
    """
    n = len(seq_lens_host)
    run_cpu_attention(
        query, key_cache, value_cache, output, block_table,
        torch.tensor(seq_lens_host, dtype=torch.int32), torch.arange(n + 1, dtype=torch.int32), n,
        scale=scale, sliding_window=sliding_window, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
        num_heads=num_heads, scheduler_window=scheduler_window, isa=isa, split_kv=split_kv, k_scale=k_scale,
        v_scale=v_scale, kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip


def run_cpu_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    output: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    tokens: int,
    *,
    scale: float,
    sliding_window: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    sinks: torch.Tensor | None,
    num_heads: int,
    scheduler_window: int,
    isa: str,
    split_kv: bool,
    k_scale: float,
    v_scale: float,
    kv_cache_dtype: str,
) -> None:
    """vLLM's CPU attention of ``len(seq_lens)`` requests' first ``tokens`` query tokens, with the
    scheduler metadata built exactly as ``CPUAttentionMetadataBuilder.build`` does (``num_heads``,
    ``scheduler_window``, ``isa``, ``split_kv``: the builder's values): the decode and the verify ops'
    one kernel call."""
    n = seq_lens.numel()
    scheduler_metadata = vllm_ops.cpu_attn_get_scheduler_metadata(
        num_reqs=n,
        num_heads=num_heads,
        num_kv_heads=key_cache.shape[1],
        head_dim=query.shape[-1],
        seq_lens=seq_lens,
        dtype=query.dtype,
        query_start_loc=query_start_loc,
        causal=True,
        sliding_window_size=scheduler_window,
        isa=isa,
        enable_kv_split=split_kv,
        kv_cache_dtype=kv_cache_dtype,
    )
    vllm_ops.cpu_attention_with_kv_cache(
        query=query[:tokens],
        key_cache=key_cache,
        value_cache=value_cache,
        output=output[:tokens],
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        scale=scale,
        causal=True,
        alibi_slopes=alibi_slopes,
        sliding_window=sliding_window,
        block_table=block_table[:n],
        softcap=softcap,
        scheduler_metadata=scheduler_metadata,
        s_aux=sinks,
        k_scale=k_scale,
        v_scale=v_scale,
        kv_cache_dtype=kv_cache_dtype,
    )


# vLLM registers its CPU kernels as CompositeImplicitAutograd C++ functions that call no further
# op: no dispatch mode sees them, so a capture on the CPU reference could not record them and a
# replay would skip them. Called through a devgraph op, the KV-cache write is recorded (whole).
def vllm_cpu_kv_cache_update(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    isa: str,
    k_scale: float,
    v_scale: float,
    kv_cache_dtype: str,
) -> None:
    """vLLM's ``cpu_attn_reshape_and_cache``; padding rows (slot -1) go to slot 0 of the null block."""
    # vLLM itself never hands this kernel padding; its slot -1 would be written out of bounds.
    # Block 0 is vLLM's null block, which no request reads. Real rows keep their slots.
    vllm_ops.cpu_attn_reshape_and_cache(
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping.clamp(min=0),
        isa,
        k_scale=k_scale,
        v_scale=v_scale,
        kv_cache_dtype=kv_cache_dtype,
    )


# Defined with torch.library's Library (not custom_op, which reads each function's source file at
# definition, a measurable part of the engine start): CPU kernels only, never compiled.
_LIB = torch.library.Library("devgraph", "FRAGMENT")
_SCHEMAS = {
    vllm_cpu_decode_attention: (
        "vllm_cpu_decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor(a!) output, "
        "Tensor block_table, int[] seq_lens_host, float scale, int sliding_window, float softcap, "
        "Tensor? alibi_slopes, Tensor? sinks, int num_heads, int scheduler_window, str isa, bool split_kv, "
        "float k_scale, float v_scale, str kv_cache_dtype) -> ()"
    ),
    vllm_cpu_kv_cache_update: (
        "vllm_cpu_kv_cache_update(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_mapping, str isa, float k_scale, float v_scale, str kv_cache_dtype) -> ()"
    ),
}
for _kernel, _schema in _SCHEMAS.items():
    if not hasattr(torch.ops.devgraph, _kernel.__name__):  # defined once per process
        _LIB.define(_schema)
        _LIB.impl(_kernel.__name__, _kernel, "CPU")
add_updatable_op(DECODE_OP)


class DevgraphCpuAttentionBackend(CPUAttentionBackend):
    """vLLM's ``CPU_ATTN`` whose FULL-graph decode is a devgraph task (see the module docstring)."""

    @staticmethod
    def get_name() -> str:
        # vLLM looks the name up in AttentionBackendEnum; CUSTOM is registered to this class.
        return "CUSTOM"

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        # FULL decode graphs of causal decoder layers only (encoder attention has no decode step).
        return attn_type == AttentionType.DECODER

    @staticmethod
    def get_impl_cls() -> type[DevgraphCpuAttentionImpl]:
        return DevgraphCpuAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[DevgraphCpuAttentionMetadataBuilder]:
        return DevgraphCpuAttentionMetadataBuilder


@dataclass
class DevgraphCpuAttentionMetadata(CPUAttentionMetadata):
    """vLLM's CPU metadata, plus what a FULL decode graph needs at replay."""

    #: the step's host lengths (uniform decode batches only), re-issued to the captured tasks.
    devgraph_host_args: dict[str, Any] = field(default_factory=dict)
    #: the builder's scheduler parameters (num_heads, window, isa, split_kv) for the captured task.
    devgraph_scheduler: tuple[int, int, str, bool] = (0, -1, "", False)
    #: fields a FULL graph never reads (the task builds its own scheduler metadata from the host
    #: lengths; vLLM's, a fresh tensor per step, serves its eager steps): DEVGRAPH_DEBUG's address
    #: check skips them.
    devgraph_unread_fields: ClassVar[tuple[str, ...]] = ("scheduler_metadata",)


class DevgraphCpuAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    """vLLM's CPU builder; uniform decode batches also carry their host lengths."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> DevgraphCpuAttentionMetadata:
        base = super().build(common_prefix_len, common_attn_metadata, fast_build)
        m = common_attn_metadata
        host_args: dict[str, Any] = {}
        if m.max_query_len == 1 and base.causal is True and base.dynamic_causal is None:
            host_args = {"seq_lens_host": [int(n) for n in m.seq_lens.tolist()]}  # CPU tensors
        return DevgraphCpuAttentionMetadata(
            **vars(base),
            devgraph_host_args=host_args,
            devgraph_scheduler=(
                self.num_heads,
                self.window_size,
                self.isa,
                bool(envs.VLLM_CPU_ATTN_SPLIT_KV),
            ),
        )


class DevgraphCpuAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention; inside a FULL graph, a decode batch is ``devgraph::vllm_cpu_decode_attention``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # A backstop: the platform's config check refuses a quantised cache_dtype with FULL graphs, but
        # vLLM's Attention itself turns an 'auto' cache into fp8 when the checkpoint's quantisation
        # config declares an fp8 KV-cache scheme (vLLM's engine arguments resolve that before the
        # config check; a VllmConfig built without them reaches the check with 'auto').
        if self.is_fp8_kv_cache:
            raise DevgraphError(
                "FULL graphs with devgraph on vLLM's CPU platform keep the KV cache unquantised "
                f"(kv_cache_dtype={self.kv_cache_dtype!r}); use kv_cache_dtype='auto' or cudagraph_mode=PIECEWISE"
            )

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        host_args = getattr(attn_metadata, "devgraph_host_args", None)
        if not host_args or output_scale is not None or not _in_full_graph():
            return super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
            )
        num_blocks, num_kv_heads, block_size, _ = kv_cache.size()
        key_cache, value_cache = kv_cache.view(num_blocks, num_kv_heads, block_size * 2, -1).chunk(2, dim=2)
        num_heads, window, isa, split_kv = attn_metadata.devgraph_scheduler
        sinks: torch.Tensor | None = getattr(self, "sinks", None)  # vLLM sets it in __init__
        if sinks is not None and sinks.dtype not in (torch.bfloat16, torch.float32):
            sinks = self.sinks = sinks.to(torch.float32)  # as vLLM's forward does
        torch.ops.devgraph.vllm_cpu_decode_attention(
            query,
            key_cache,
            value_cache,
            output,
            attn_metadata.block_table,
            host_args["seq_lens_host"],
            self.scale,
            self.sliding_window,
            float(self.logits_soft_cap),
            self.alibi_slopes,
            sinks,
            num_heads,
            window,
            isa,
            split_kv,
            layer._k_scale_float,
            layer._v_scale_float,
            self.kv_cache_dtype,
        )
        return output

    def do_kv_cache_update(
        self,
        layer: Any,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        if not _in_full_graph() or self.attn_type != AttentionType.DECODER:
            super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
            return
        num_blocks, num_kv_heads, block_size, _ = kv_cache.size()
        key_cache, value_cache = kv_cache.view(num_blocks, num_kv_heads, block_size * 2, -1).chunk(2, dim=2)
        torch.ops.devgraph.vllm_cpu_kv_cache_update(
            key,
            value,
            key_cache,
            value_cache,
            slot_mapping,
            layer.isa,
            layer._k_scale_float,
            layer._v_scale_float,
            self.kv_cache_dtype,
        )


def _in_full_graph() -> bool:
    """True while a FULL graph step is being captured: the step devgraph's task serves.

    A replay never runs this forward (the task is re-issued with the step's lengths); an eager run of
    the same step (``DEVGRAPH_COMPARE_EAGER``'s comparison, vLLM's warm-ups) takes vLLM's own path."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import get_forward_context, is_forward_context_available

    from devgraph.graph import current_graph

    return (
        current_graph() is not None
        and is_forward_context_available()
        and get_forward_context().cudagraph_runtime_mode == CUDAGraphMode.FULL
    )
