"""A vLLM attention backend whose decode attention is ``devgraph::paged_decode_attention``.

vLLM's CPU attention backend declares no FULL graph support (its scheduler metadata is a fresh
tensor per step), and its attention runs inside vLLM's Python custom op, which reads the forward
context when called: a device graph freezes what that read at capture, so FULL graphs need attention
whose host arguments devgraph re-issues at replay. This backend is what the devgraph platform uses for FULL
graphs on devices that freeze host arguments (the CPU reference; the NPU kernel reads the same host
list): decode batches call devgraph's paged decode attention, whose host sequence lengths are
re-issued at every replay through task update (``devgraph_host_args`` on the metadata; the
wrapper's ``Graph.replay(host_args=...)``). Prefill and mixed batches attend eagerly (they are not
captured: the backend supports FULL graphs for uniform single-token decode batches only).

Sliding windows and attention logit soft-capping (Mistral, Gemma2) follow vLLM's CPU attention: a
query at position ``p`` sees positions ``p - sliding_window + 1 .. p`` (the window counts the query
itself; vLLM's ``sliding_window`` is the model config's, one-sided), and the scaled scores ``s``
become ``cap * tanh(s / cap)`` before masking and softmax. ALiBi, attention sinks, KV sharing,
encoder attention and quantised KV caches are refused at model build.

KV cache: vLLM's logical per-layer ``[blocks, kv_heads, block_size, 2 * head_size]`` stored in the
``LBNHC`` layout, so that ``permute(0, 2, 1, 3)`` is a contiguous ``[blocks, block_size, kv_heads,
2 * head_size]`` whose halves are the key and value caches devgraph's op takes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

import devgraph.ops
from devgraph._errors import DevgraphError

__all__ = ["BACKEND_QUALNAME", "DevgraphAttentionBackend", "DevgraphAttentionMetadata"]

BACKEND_QUALNAME = "devgraph.adapters.vllm._attention.DevgraphAttentionBackend"


class DevgraphAttentionBackend(AttentionBackend):
    """Decoder self-attention over a paged KV cache; decode through ``devgraph::paged_decode_attention``."""

    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        # vLLM looks the name up in AttentionBackendEnum; CUSTOM is registered to this class.
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[DevgraphAttentionImpl]:
        return DevgraphAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[DevgraphAttentionMetadataBuilder]:
        return DevgraphAttentionMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[int | MultipleOf]:
        return [MultipleOf(16)]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBNHC,)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True


@dataclass
class DevgraphAttentionMetadata:
    """One step's attention metadata (tensors are vLLM's persistent buffers, sliced)."""

    num_actual_tokens: int
    num_reqs: int
    max_query_len: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc_host: list[int]
    seq_lens_host: list[int]
    #: what a replay re-issues the captured attention tasks with (see ``_host_args``).
    devgraph_host_args: dict[str, Any] = field(default_factory=dict)

    @property
    def is_uniform_decode(self) -> bool:
        return self.max_query_len == 1 and self.num_actual_tokens <= self.num_reqs


class DevgraphAttentionMetadataBuilder(AttentionMetadataBuilder[DevgraphAttentionMetadata]):
    """Builds the metadata on the host, outside any captured region (vLLM builds before forward)."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> DevgraphAttentionMetadata:
        m = common_attn_metadata
        if common_prefix_len:
            raise DevgraphError("the devgraph attention backend does not do cascade attention")
        seq_lens_host = [int(n) for n in m.seq_lens.tolist()]
        return DevgraphAttentionMetadata(
            num_actual_tokens=m.num_actual_tokens,
            num_reqs=m.num_reqs,
            max_query_len=m.max_query_len,
            query_start_loc=m.query_start_loc,
            seq_lens=m.seq_lens,
            block_table=m.block_table_tensor,
            slot_mapping=m.slot_mapping,
            query_start_loc_host=[int(n) for n in m.query_start_loc_cpu.tolist()],
            seq_lens_host=seq_lens_host,
            devgraph_host_args={"seq_lens_host": seq_lens_host},
        )


def _split_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(flat [slots, Hkv, 2D], key_cache, value_cache [blocks, block_size, Hkv, D]) views of a layer's cache."""
    paged = kv_cache.permute(0, 2, 1, 3)  # [blocks, block_size, Hkv, 2D]
    if not paged.is_contiguous():
        raise DevgraphError(
            "the devgraph attention backend needs vLLM's LBNHC KV-cache layout; got strides "
            f"{tuple(kv_cache.stride())} for shape {tuple(kv_cache.shape)}"
        )
    d = kv_cache.shape[-1] // 2
    return paged.view(-1, paged.shape[2], paged.shape[3]), paged[..., :d], paged[..., d:]


class DevgraphAttentionImpl(AttentionImpl):
    """Writes the step's keys/values into the paged cache and attends (decode: devgraph's op)."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        unsupported = {
            "alibi_slopes": alibi_slopes,
            "sinks": sinks,
            "kv_sharing_target_layer_name": kv_sharing_target_layer_name,
        }
        used = [name for name, value in unsupported.items() if value is not None]
        if used or attn_type != AttentionType.DECODER or kv_cache_dtype != "auto":
            raise DevgraphError(
                f"the devgraph attention backend (FULL graphs on the CPU reference) does causal "
                f"decoder attention (with or without a sliding window and logit soft-capping) only; "
                f"this layer uses {used or [attn_type, kv_cache_dtype]}: use cudagraph_mode=PIECEWISE "
                "for this model"
            )
        if sliding_window is not None and sliding_window <= 0:
            raise DevgraphError(
                f"the devgraph attention backend: sliding_window={sliding_window} is not a window"
            )
        #: the query sees itself and the ``sliding_window - 1`` tokens before it (0: no window).
        self.sliding_window = int(sliding_window or 0)
        self.logits_soft_cap = float(logits_soft_cap or 0.0)
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_sharing_target_layer_name = None
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type

    def do_kv_cache_update(
        self,
        layer: Any,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        flat, _, _ = _split_cache(kv_cache)
        d = self.head_size
        n = slot_mapping.shape[0]
        # Padded tokens carry slot -1; send them to slot 0 of block 0, vLLM's null block, which no
        # request reads. Tensor ops only: this runs inside captured FULL graphs.
        slots = slot_mapping.clamp(min=0).to(torch.int64)
        flat[:, :, :d].index_copy_(0, slots, key[:n])
        flat[:, :, d:].index_copy_(0, slots, value[:n])

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: DevgraphAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise DevgraphError("the devgraph attention backend does not fuse output quantisation")
        if attn_metadata is None:  # vLLM's profiling run
            return output
        _, key_cache, value_cache = _split_cache(kv_cache)
        m = attn_metadata
        if m.is_uniform_decode:
            b = len(m.seq_lens_host)
            devgraph.ops.paged_decode_attention(
                query[:b],
                key_cache,
                value_cache,
                m.block_table[:b],
                m.seq_lens[:b],
                m.seq_lens_host,
                self.scale,
                output[:b],
                sliding_window=self.sliding_window,
                logits_soft_cap=self.logits_soft_cap,
            )
            return output
        self._prefill(query, key_cache, value_cache, m, output)
        return output

    def _prefill(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        m: DevgraphAttentionMetadata,
        output: torch.Tensor,
    ) -> None:
        # Eager only (vLLM never captures a non-uniform batch with this backend): per request, its
        # queries attend causally over its context (the window of each query, with one), read back
        # from the paged cache. Blocks wholly before the first query's window are not read: vLLM's
        # sliding-window KV manager frees them (their table entries point at the null block).
        block_size = key_cache.shape[1]
        window = self.sliding_window
        for r in range(m.num_reqs):
            start, end = m.query_start_loc_host[r], m.query_start_loc_host[r + 1]
            q_len, ctx = end - start, m.seq_lens_host[r]
            if q_len == 0:
                continue
            first = max(0, ctx - q_len - window + 1) // block_size if window else 0
            blocks = m.block_table[r, first : -(-ctx // block_size)].to(torch.int64)
            base = first * block_size  # position of the first key read
            k = key_cache.index_select(0, blocks).flatten(0, 1)[: ctx - base]  # [ctx - base, Hkv, D]
            v = value_cache.index_select(0, blocks).flatten(0, 1)[: ctx - base]
            q = query[start:end]  # [q_len, Hq, D]
            positions = torch.arange(ctx - q_len, ctx, device=q.device)[:, None]
            keys_at = torch.arange(base, ctx, device=q.device)[None, :]
            allowed = keys_at <= positions  # [q_len, ctx - base]
            if window:
                allowed = allowed & (keys_at > positions - window)
            output[start:end].copy_(self._attend(q, k, v, allowed))

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor
    ) -> torch.Tensor:
        """Attention of ``q[Q, Hq, D]`` over ``k, v[S, Hkv, D]`` where ``allowed[Q, S]``, in float32."""
        if not self.logits_soft_cap:
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1).float(),
                k.transpose(0, 1).float(),
                v.transpose(0, 1).float(),
                attn_mask=allowed,
                scale=self.scale,
                enable_gqa=True,
            )
            return out.transpose(0, 1)
        # SDPA has no soft cap: the scores spelled out, capped before the mask and the softmax.
        group = q.shape[1] // k.shape[1]
        keys = k.float().repeat_interleave(group, dim=1)  # [S, Hq, D]
        values = v.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,shd->hqs", q.float(), keys) * self.scale
        scores = torch.tanh(scores / self.logits_soft_cap) * self.logits_soft_cap
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        return torch.einsum("hqs,shd->qhd", probs, values)
