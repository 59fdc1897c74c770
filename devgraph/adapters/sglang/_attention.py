"""The ``devgraph`` SGLang attention backend: graph-safe paged decode for the CPU reference (and NPU).

Prefill (extend) is SGLang's ``torch_native`` extend. Eagerly it runs as it is; inside devgraph's
prefill graphs (``_prefill.DevgraphBreakableBackend``) it is one call of the custom op
``devgraph_sglang::extend_attention`` per layer, the break of the breakable capture: the op writes the
layer's output into a tensor of the graphs' memory and reads everything that changes per batch
(lengths, prefixes, request rows, KV slots: host lists and host loops) from the batch being replayed,
which the prefill backend hands over before each replay (``set_extend_batch``). A batch padded to a
larger graph attends over its real tokens only (the padded rows write no KV and read zeros). Decode
goes through ``devgraph.ops.paged_decode_attention`` over
SGLang's token-indexed KV pool viewed as blocks of ``page_size`` tokens (SGLang's ``--page-size``;
devgraph's NPU kernel needs a multiple of 16, as Ascend's paged attention does), with every
``page_size``-th slot of the request's row of ``req_to_token``, divided by ``page_size``, as the block
table (SGLang allocates whole pages, so a page's slots are consecutive), and the lengths as a *host list*, the way an NPU kernel takes
``actual_seq_lengths_kv``. In a captured graph that list is frozen unless the task is updated; the
backend keeps the current batch's (padded) lengths, set outside the graph in
``init_forward_metadata_out_graph``, and ``devgraph_host_args()`` hands them to
``DevgraphGraphBackend`` at every replay. Like an NPU backend, it also fills the block tables of a
graph batch there, outside the graph, into one static buffer: a task update re-issues the attention
with the new lengths before the replay, and must find that batch's table, not the memory of an
intermediate the graph has yet to recompute. ``torch_native``'s decode reads a device value on the host
and cannot be captured; this one can.

Refused with ``DevgraphError`` when the engine starts (the backend is built after the model is
loaded, and checks every ``RadixAttention`` layer of it), and again at decode for a layer it did not
see: cross attention, sliding windows, attention logit soft-capping (``logit_cap``, Gemma 2, Grok;
neither this decode nor ``torch_native``'s prefill applies it) and ``qk_head_dim != v_head_dim``.
"""

from __future__ import annotations

import copy
import itertools
import weakref
from typing import Any

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from devgraph import ops
from devgraph._errors import DevgraphError

#: Name of the argument of ``devgraph::paged_decode_attention`` that holds the host lengths.
HOST_LENS_ARG = "seq_lens_host"

#: The prefill attention op: the break of devgraph's SGLang prefill graphs.
EXTEND_ATTENTION = "devgraph_sglang::extend_attention"

#: Live ``DevgraphAttentionBackend``s by handle: the op takes the handle (an int), not the backend.
_BACKENDS: weakref.WeakValueDictionary[int, DevgraphAttentionBackend] = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)


@torch.library.custom_op(EXTEND_ATTENTION, mutates_args=("out",))
def extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    backend: int,
    layer_id: int,
    save_kv_cache: bool,
) -> None:
    """One layer's prefill attention into ``out``, for the batch its backend holds (the break op).

    ``backend`` is a ``DevgraphAttentionBackend``'s handle; the batch (lengths, prefixes, KV slots)
    is the one it was last given (``set_extend_batch``), read when the op runs, so a replay of the
    graphs around it attends over the replayed batch.
    """
    owner = _BACKENDS.get(backend)
    if owner is None:
        raise DevgraphError(
            f"{EXTEND_ATTENTION}: attention backend {backend} is gone (its engine was shut down); "
            "the prefill graphs that call it must be released with it"
        )
    owner.extend_into(q, k, v, out, layer_id, save_kv_cache)


@extend_attention.register_fake
def _(q, k, v, out, backend, layer_id, save_kv_cache) -> None:
    return None


@torch.compiler.disable
def _attend(q, key_cache, value_cache, block_table, seq_lens, seq_lens_host, scale, out) -> None:
    """The decode attention, kept out of compiled graphs (SGLang compiles the decode forward when
    ``enable_torch_compile`` is on): inside one, its host lengths would be frozen into the compiled
    graph's recording, and devgraph refuses that at capture. Here Dynamo breaks the graph around
    it, so the capture records it as an updatable task between the compiled pieces."""
    ops.paged_decode_attention(
        q, key_cache, value_cache, block_table, seq_lens, seq_lens_host, scale=scale, out=out
    )


class DevgraphAttentionBackend(TorchNativeAttnBackend):
    """``torch_native`` for prefill; decode via ``devgraph.ops.paged_decode_attention`` with host lengths."""

    def __init__(self, model_runner: Any) -> None:
        check_model(getattr(model_runner, "model", None))
        super().__init__(model_runner)
        #: Tokens per block of the paged cache: SGLang's page size (its allocator hands out whole pages).
        self.page_size = int(getattr(model_runner, "page_size", None) or 1)
        self._seq_lens_host: list[int] = []
        self._graph_block_table: torch.Tensor | None = None  # [max_bs, max_context] static buffer
        self._block_table: torch.Tensor | None = None  # this graph batch's rows of it
        #: This backend's handle for ``devgraph_sglang::extend_attention``.
        self.handle = next(_HANDLES)
        _BACKENDS[self.handle] = self
        #: True while devgraph's prefill graphs run the forward (warm-ups and capture): extend
        #: attention then goes through the break op.
        self.breakable = False
        self._extend_batch: Any = None  # the batch the break op attends over
        self._layers: dict[int, Any] = {}  # RadixAttention by layer id, as the forward met them

    # -- metadata (outside the graph) ---------------------------------------------------------

    def init_forward_metadata(self, forward_batch: Any) -> None:
        """Eager batches: host lengths only (the block table is gathered in the forward)."""
        super().init_forward_metadata(forward_batch)
        self._set_host_lens(forward_batch)
        self._block_table = None

    def init_forward_metadata_out_graph(self, forward_batch: Any, in_capture: bool = False) -> None:
        """Graph batches (capture and every replay): host lengths and the static block table."""
        TorchNativeAttnBackend.init_forward_metadata(self, forward_batch)
        self._set_host_lens(forward_batch)
        if self._graph_block_table is None or not forward_batch.forward_mode.is_decode():
            self._block_table = None
            return
        rows = forward_batch.req_pool_indices.shape[0]
        table = self._graph_block_table[:rows]
        table.copy_(self._block_rows(forward_batch.req_pool_indices))
        self._block_table = table

    def _block_rows(self, req_pool_indices: torch.Tensor) -> torch.Tensor:
        """The block table of these requests: the slot of each page's first token, in pages."""
        slots = self.req_to_token_pool.req_to_token.index_select(0, req_pool_indices)
        if self.page_size == 1:
            return slots
        return slots[:, :: self.page_size] // self.page_size

    def _set_host_lens(self, forward_batch: Any) -> None:
        if not forward_batch.forward_mode.is_decode():
            return
        lens = forward_batch.seq_lens_cpu
        if lens is None:  # only SGLang's eager paths leave it unset; this is outside any graph
            lens = forward_batch.seq_lens.cpu()
        self._seq_lens_host = [int(n) for n in lens.tolist()]

    def devgraph_host_args(self) -> dict[str, list[int]]:
        """The host arguments of this batch's decode attention tasks (``DevgraphGraphBackend`` reads it)."""
        return {HOST_LENS_ARG: list(self._seq_lens_host)}

    # -- graph state --------------------------------------------------------------------------

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        req_to_token = self.req_to_token_pool.req_to_token
        blocks = -(-req_to_token.shape[1] // self.page_size)
        self._graph_block_table = torch.zeros(
            (max_bs, blocks), dtype=req_to_token.dtype, device=req_to_token.device
        )

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        # Padded rows attend over one token (their KV goes to SGLang's reserved slot 0).
        return 1

    # -- prefill ------------------------------------------------------------------------------

    def set_extend_batch(self, forward_batch: Any) -> None:
        """The batch the prefill break op attends over from now on (the prefill backend's replay)."""
        self._extend_batch = forward_batch

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: Any,
        forward_batch: Any,
        save_kv_cache: bool = True,
        **kwargs: Any,
    ) -> torch.Tensor:
        if not self.breakable:
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        self._check_layer(layer)
        self._layers[layer.layer_id] = layer
        self._extend_batch = forward_batch
        out = q.new_empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
        extend_attention(q, k, v, out, self.handle, layer.layer_id, save_kv_cache)
        return out

    def extend_into(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        layer_id: int,
        save_kv_cache: bool,
    ) -> None:
        """The body of the break op: ``torch_native``'s extend over the held batch's real tokens."""
        batch = self._extend_batch
        if batch is None:
            raise DevgraphError(f"{EXTEND_ATTENTION} ran with no batch set (set_extend_batch)")
        layer = self._layers[layer_id]
        real = int(sum(batch.extend_seq_lens_cpu))
        if real < q.shape[0]:
            # A batch padded to a larger graph: its padded rows have no request, write no KV and
            # attend to nothing (zeros, as SGLang's breakable prefill leaves them).
            q, k, v = q[:real], k[:real], v[:real]
            batch = copy.copy(batch)
            batch.out_cache_loc = batch.out_cache_loc[:real]
            out[real:].zero_()
        result = TorchNativeAttnBackend.forward_extend(self, q, k, v, layer, batch, save_kv_cache)
        out[:real].copy_(result.view(real, -1))

    # -- decode -------------------------------------------------------------------------------

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: Any,
        forward_batch: Any,
        save_kv_cache: bool = True,
        **kwargs: Any,
    ) -> torch.Tensor:
        self._check_layer(layer)
        heads, dim = layer.tp_q_head_num, layer.qk_head_dim
        q = q.reshape(-1, heads * dim)
        out = torch.empty_like(q)
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(
                layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v
            )
        key_buffer = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        value_buffer = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        kv_heads, page = layer.tp_k_head_num, self.page_size
        # SGLang's pool is token-indexed and allocated in whole pages (its size a multiple of the
        # page size), and req_to_token maps a request's positions to its slots: page p of a request
        # is block req_to_token[p * page_size] // page_size of the pool viewed in blocks.
        key_cache = key_buffer.view(key_buffer.shape[0] // page, page, kv_heads, dim)
        value_cache = value_buffer.view(value_buffer.shape[0] // page, page, kv_heads, dim)
        block_table = self._block_table
        if block_table is None or block_table.shape[0] != q.shape[0]:  # an eager batch
            block_table = self._block_rows(forward_batch.req_pool_indices)
        _attend(
            q.view(-1, heads, dim),
            key_cache,
            value_cache,
            block_table,
            forward_batch.seq_lens,
            self._seq_lens_host,
            layer.scaling,
            out.view(-1, heads, dim),
        )
        return out

    @staticmethod
    def _check_layer(layer: Any) -> None:
        problem = _unsupported(layer)
        if problem is not None:
            raise DevgraphError(
                f"devgraph attention backend: layer {layer.layer_id} uses {problem}, which its paged "
                "decode does not implement; use another --attention-backend for this model."
            )


def check_model(model: Any) -> None:
    """Refuses, at engine start, a model with an attention layer this backend would compute wrongly.

    Raises:
        DevgraphError: naming the first such layer and what it uses.
    """
    if model is None:
        return
    for name, module in model.named_modules():
        if isinstance(module, RadixAttention) and (problem := _unsupported(module)) is not None:
            raise DevgraphError(
                f"devgraph attention backend: {name} (layer {module.layer_id}) uses {problem}, which "
                "the devgraph backend does not implement (its decode would compute another function); "
                "use another --attention-backend for this model."
            )


def _unsupported(layer: Any) -> str | None:
    window = getattr(layer, "sliding_window_size", None)
    cap = getattr(layer, "logit_cap", None) or 0.0
    if layer.is_cross_attention:
        return "cross attention"
    if window is not None and window > -1:
        return f"a sliding window of {window}"
    if cap > 0:
        return f"attention logit soft-capping (logit_cap {cap})"
    if layer.qk_head_dim != layer.v_head_dim:
        return f"qk_head_dim {layer.qk_head_dim} != v_head_dim {layer.v_head_dim}"
    return None
