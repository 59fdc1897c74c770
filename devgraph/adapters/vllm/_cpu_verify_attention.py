"""The target's verify step of vLLM speculative decoding in devgraph FULL graphs (vLLM's CPU platform).

With a ``speculative_config`` vLLM's V1 runner schedules a request that has ``k`` draft tokens as
``k + 1`` query tokens (the verify step of the target) and calls a batch *uniform decode* when every
request has exactly ``uniform_decode_query_len = 1 + num_speculative_tokens`` of them; its dispatcher
then picks a FULL graph keyed by ``BatchDescriptor(num_tokens, uniform=True)`` (the capture sizes are
rounded to multiples of ``k + 1``). Batches where some request has fewer (no draft this step, a
prefill) are mixed: PIECEWISE graphs or eager, never FULL_DECODE_ONLY.

On vLLM's CPU platform devgraph's FULL graphs run vLLM's own CPU attention kernel as an updatable task
(``_cpu_attention``), whose builder declares single-token decode only: vLLM then turns FULL graphs off
for the whole engine as soon as ``k > 0`` (``CUDAGraphMode ... not supported with spec-decode ...;
setting cudagraph_mode=NONE``). With speculative decoding the platform uses
``DevgraphCpuSpecAttentionBackend`` instead: the same backend whose builder declares uniform batches
(``AttentionCGSupport.UNIFORM_BATCH``) and hands the graph the step's host sequence lengths *and*
query start offsets; inside a FULL graph its attention is ``devgraph::vllm_cpu_verify_attention``, which
builds vLLM's scheduler plan from those host values for the real requests of the padded batch (vLLM
pads a uniform batch with empty requests at the end) and runs ``cpu_attention_with_kv_cache`` on
exactly what vLLM's eager step passes it, so a replay computes the eager step bit for bit.
The drafter's graphs and the config check: ``_spec_decode``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata

from devgraph._errors import DevgraphError
from devgraph.adapters.vllm._cpu_attention import (
    DevgraphCpuAttentionBackend,
    DevgraphCpuAttentionImpl,
    DevgraphCpuAttentionMetadata,
    DevgraphCpuAttentionMetadataBuilder,
    _in_full_graph,
    run_cpu_attention,
)
from devgraph.adapters.vllm._host_args import add_updatable_op

__all__ = [
    "VERIFY_OP",
    "DevgraphCpuSpecAttentionBackend",
]

#: The updatable task a FULL graph captures for each attention call of a (uniform) verify batch.
VERIFY_OP = "devgraph::vllm_cpu_verify_attention"


def real_requests(query_start_loc_host: list[int]) -> int:
    """The requests of a padded batch that have query tokens: vLLM pads a uniform batch to its graph
    size with empty requests at the end (their query start repeats the total)."""
    return query_start_loc_host.index(query_start_loc_host[-1])


def vllm_cpu_verify_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    output: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens_host: list[int],
    query_start_loc_host: list[int],
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
    """vLLM's CPU attention of a causal batch, as vLLM's eager step runs it.

    ``seq_lens_host`` and ``query_start_loc_host`` are the step's padded host values (as vLLM's
    metadata holds them); only the real requests (``real_requests``) and their tokens are given to
    the kernel, with the scheduler metadata built from them exactly as ``CPUAttentionMetadataBuilder``
    does: the same call, on the same values, as the eager step.
    """
    n = real_requests(query_start_loc_host)
    run_cpu_attention(
        query, key_cache, value_cache, output, block_table,
        torch.tensor(seq_lens_host[:n], dtype=torch.int32),
        torch.tensor(query_start_loc_host[: n + 1], dtype=torch.int32), query_start_loc_host[n],
        scale=scale, sliding_window=sliding_window, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
        num_heads=num_heads, scheduler_window=scheduler_window, isa=isa, split_kv=split_kv, k_scale=k_scale,
        v_scale=v_scale, kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip


_LIB = torch.library.Library("devgraph", "FRAGMENT")
if not hasattr(torch.ops.devgraph, "vllm_cpu_verify_attention"):  # defined once per process
    _LIB.define(
        "vllm_cpu_verify_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor(a!) output, "
        "Tensor block_table, int[] seq_lens_host, int[] query_start_loc_host, float scale, int sliding_window, "
        "float softcap, Tensor? alibi_slopes, Tensor? sinks, int num_heads, int scheduler_window, str isa, "
        "bool split_kv, float k_scale, float v_scale, str kv_cache_dtype) -> ()"
    )
    _LIB.impl("vllm_cpu_verify_attention", vllm_cpu_verify_attention, "CPU")
add_updatable_op(VERIFY_OP)


@dataclass
class DevgraphCpuSpecAttentionMetadata(DevgraphCpuAttentionMetadata):
    """``DevgraphCpuAttentionMetadata`` whose host arguments are the verify op's."""


class DevgraphCpuSpecAttentionMetadataBuilder(DevgraphCpuAttentionMetadataBuilder):
    """vLLM's CPU builder declaring uniform batches (every request ``k + 1`` query tokens); every causal
    step carries its host sequence lengths and query start offsets."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> DevgraphCpuSpecAttentionMetadata:
        base = super().build(common_prefix_len, common_attn_metadata, fast_build)
        m = common_attn_metadata
        host_args: dict[str, Any] = {}
        if base.causal is True and base.dynamic_causal is None:
            host_args = {
                "seq_lens_host": [int(n) for n in m.seq_lens.tolist()],  # CPU tensors
                "query_start_loc_host": [int(n) for n in m.query_start_loc_cpu.tolist()],
            }
        fields = {k: v for k, v in vars(base).items() if k != "devgraph_host_args"}
        return DevgraphCpuSpecAttentionMetadata(**fields, devgraph_host_args=host_args)


class DevgraphCpuSpecAttentionImpl(DevgraphCpuAttentionImpl):
    """vLLM's CPU attention; inside a FULL graph, ``devgraph::vllm_cpu_verify_attention``."""

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
        if not _in_full_graph():
            return super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
            )
        if not host_args or output_scale is not None:
            # A FULL graph would freeze this step's scheduler plan: refuse rather than replay it.
            raise DevgraphError(
                "FULL graph capture with speculative decoding: this attention call carries no host "
                "sequence lengths and query offsets (a non-causal layer, or an output scale), so a replay "
                "would reuse the capture step's; use compilation_config={'cudagraph_mode': 'PIECEWISE'}"
            )
        num_blocks, num_kv_heads, block_size, _ = kv_cache.size()
        key_cache, value_cache = kv_cache.view(num_blocks, num_kv_heads, block_size * 2, -1).chunk(2, dim=2)
        num_heads, window, isa, split_kv = attn_metadata.devgraph_scheduler
        sinks: torch.Tensor | None = getattr(self, "sinks", None)
        if sinks is not None and sinks.dtype not in (torch.bfloat16, torch.float32):
            sinks = self.sinks = sinks.to(torch.float32)  # as vLLM's forward does
        torch.ops.devgraph.vllm_cpu_verify_attention(
            query,
            key_cache,
            value_cache,
            output,
            attn_metadata.block_table,
            host_args["seq_lens_host"],
            host_args["query_start_loc_host"],
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


class DevgraphCpuSpecAttentionBackend(DevgraphCpuAttentionBackend):
    """vLLM's ``CPU_ATTN`` whose FULL graphs serve uniform verify batches (see the module docstring)."""

    @staticmethod
    def get_impl_cls() -> type[DevgraphCpuSpecAttentionImpl]:
        return DevgraphCpuSpecAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[DevgraphCpuSpecAttentionMetadataBuilder]:
        return DevgraphCpuSpecAttentionMetadataBuilder
