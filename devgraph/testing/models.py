"""A tiny Llama-style decoder with a paged KV cache: the reference model of tests, demo and benchmarks.

``PagedDecoder`` runs one decode step per ``forward`` (one new token per sequence) the way serving
engines do: RMSNorm, fused QKV projection, neox RoPE, the new token's key/value written into a paged
cache at ``slot_mapping``, attention through ``devgraph.ops.paged_decode_attention``, SwiGLU MLP.
Its forward is graph-capture safe (no host syncs, no data-dependent shapes, no Python branching on
tensor values), so a graph runner can capture it per batch size.

Block 0 of the cache is a *scratch block*: ``KVBlockManager`` never hands it out, and padded rows (a
runner pads a batch up to its bucket with ``PagedDecoder.pad_values()``) write their key/value there
and attend over it, so they never touch real sequences.

``dense_reference_logits`` recomputes the same model densely in plain torch (no paged cache, no
devgraph ops) to check the paged path; ``greedy_decode`` generates tokens for a batch of prompts
through any forward callable (the eager model or a graph runner wrapping it).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar, cast

import attrs
import torch
from torch import nn
from torch.nn import functional as F

from devgraph._errors import DevgraphError
from devgraph.ops import add_rms_norm, paged_decode_attention, rms_norm
from devgraph.testing._parallel import (
    COLLECTIVE_STYLES,
    ParallelLMHead,
    TensorParallel,
    VocabParallelEmbedding,
    shard_state_dict,
)

__all__ = [
    "COLLECTIVE_STYLES",
    "SCRATCH_BLOCK",
    "DecoderConfig",
    "DecoderLayer",
    "KVBlockManager",
    "OutOfBlocksError",
    "PagedDecoder",
    "TensorParallel",
    "dense_reference_logits",
    "greedy_decode",
    "make_decoder",
    "pad_batch",
    "shard_decoder",
]

logger = logging.getLogger(__name__)

#: Block 0 is never given to a sequence; padded rows write into it.
SCRATCH_BLOCK = 0


def _positive(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"DecoderConfig.{attribute.name} must be a positive number, got {value!r}")


def _floating(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(
            f"DecoderConfig.{attribute.name} must be a floating torch.dtype (torch.float32, "
            f"torch.bfloat16...), got {value!r}"
        )


@attrs.frozen
class DecoderConfig:
    """Shape of a ``PagedDecoder`` and of its paged KV cache.

    ``head_dim`` is ``hidden_size // num_heads``; ``max_seq_len`` is
    ``block_size * max_blocks_per_seq``. Block 0 is the scratch block, so at most ``num_blocks - 1``
    blocks hold sequences.

    Raises:
        ValueError: naming the field, when a size is not positive, ``hidden_size`` is not a multiple
            of ``num_heads``, ``num_heads`` not a multiple of ``num_kv_heads``, ``head_dim`` is odd
            (RoPE rotates halves), ``num_blocks < 2`` (block 0 is scratch) or ``dtype`` is not a
            floating dtype.
    """

    vocab_size: int = attrs.field(default=256, validator=_positive)
    hidden_size: int = attrs.field(default=64, validator=_positive)
    intermediate_size: int = attrs.field(default=128, validator=_positive)
    num_layers: int = attrs.field(default=2, validator=_positive)
    num_heads: int = attrs.field(default=4, validator=_positive)
    num_kv_heads: int = attrs.field(default=2, validator=_positive)
    rope_theta: float = attrs.field(default=10000.0, validator=_positive)
    rms_eps: float = attrs.field(default=1e-6, validator=_positive)
    block_size: int = attrs.field(default=16, validator=_positive)
    num_blocks: int = attrs.field(default=64, validator=_positive)
    max_blocks_per_seq: int = attrs.field(default=8, validator=_positive)
    dtype: torch.dtype = attrs.field(default=torch.float32, validator=_floating)

    def __attrs_post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "block_size",
            "num_blocks",
            "max_blocks_per_seq",
        ):
            if not isinstance(getattr(self, name), int):
                raise ValueError(f"DecoderConfig.{name} must be an int, got {getattr(self, name)!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"DecoderConfig.hidden_size ({self.hidden_size}) must be a multiple of num_heads "
                f"({self.num_heads})"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"DecoderConfig.num_kv_heads ({self.num_kv_heads}) must divide num_heads "
                f"({self.num_heads}) for grouped-query attention"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"DecoderConfig.hidden_size / num_heads (head_dim {self.head_dim}) must be even: "
                "RoPE rotates the two halves of each head"
            )
        if self.num_blocks < 2:
            raise ValueError(
                f"DecoderConfig.num_blocks must be at least 2 (block 0 is the scratch block for "
                f"padded rows), got {self.num_blocks}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def max_seq_len(self) -> int:
        return self.block_size * self.max_blocks_per_seq


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style RoPE; ``cos``/``sin`` broadcast over the head dimension of ``x``."""
    return x * cos + _rotate_half(x) * sin


def _rope_tables(config: DecoderConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [max_seq_len, head_dim] (float64, so every dtype rounds the same values)."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    t = torch.arange(config.max_seq_len, dtype=torch.float64)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class DecoderLayer(nn.Module):
    """One pre-norm transformer block whose attention reads and writes the paged KV cache.

    With a ``parallel`` shard of more than one rank it holds that rank's heads and intermediate
    slice (column-parallel QKV and gate/up, row-parallel o_proj and down, whose partial sums are
    all-reduced) and caches only its key/value heads; with None (or one rank) it is the whole layer.
    """

    # Registered buffers (declared for type checkers; nn.Module.__getattr__ is untyped).
    k_cache: torch.Tensor
    v_cache: torch.Tensor

    def __init__(self, config: DecoderConfig, parallel: TensorParallel | None = None) -> None:
        super().__init__()
        c = config
        self.config = c
        self.parallel = parallel or TensorParallel(rank=0, world_size=1)
        p = self.parallel
        self.num_heads = p.split(c.num_heads, "DecoderConfig.num_heads")
        self.num_kv_heads = p.split(c.num_kv_heads, "DecoderConfig.num_kv_heads")
        self.intermediate_size = p.split(c.intermediate_size, "DecoderConfig.intermediate_size")
        self.input_norm = nn.Parameter(torch.ones(c.hidden_size))
        self.post_attn_norm = nn.Parameter(torch.ones(c.hidden_size))
        self.qkv_proj = nn.Linear(
            c.hidden_size, (self.num_heads + 2 * self.num_kv_heads) * c.head_dim, bias=False
        )
        self.o_proj = nn.Linear(self.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, c.hidden_size, bias=False)
        shape = (c.num_blocks, c.block_size, self.num_kv_heads, c.head_dim)
        # Not persistent: the cache is state of a run, not of the model's weights.
        self.register_buffer("k_cache", torch.zeros(shape, dtype=c.dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=c.dtype), persistent=False)
        self.scale = 1.0 / math.sqrt(c.head_dim)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        slots: torch.Tensor,
        seq_lens_host: list[int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        if residual is None:  # first layer: a Python-level fact, not a tensor value
            residual = hidden
            x = rms_norm(hidden, self.input_norm, c.rms_eps)
        else:
            x, residual = add_rms_norm(hidden, residual, self.input_norm, c.rms_eps)

        heads, kv_heads = self.num_heads, self.num_kv_heads
        q_size, kv_size = heads * c.head_dim, kv_heads * c.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = _apply_rope(q.reshape(-1, heads, c.head_dim), cos, sin)
        k = _apply_rope(k.reshape(-1, kv_heads, c.head_dim), cos, sin)
        v = v.reshape(-1, kv_heads, c.head_dim)

        # Write the new token's key/value at its slot (a flat index over all blocks); padded rows
        # point at the scratch block, so duplicates there are harmless.
        flat = (-1, kv_heads, c.head_dim)
        self.k_cache.view(flat).index_copy_(0, slots, k.to(self.k_cache.dtype))
        self.v_cache.view(flat).index_copy_(0, slots, v.to(self.v_cache.dtype))

        attn = paged_decode_attention(
            q, self.k_cache, self.v_cache, block_table, seq_lens, seq_lens_host, self.scale
        )
        hidden = self.parallel.all_reduce(self.o_proj(attn.reshape(-1, q_size)))

        x, residual = add_rms_norm(hidden, residual, self.post_attn_norm, c.rms_eps)
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.parallel.all_reduce(self.down_proj(F.silu(gate) * up)), residual


class PagedDecoder(nn.Module):
    """Tiny Llama-style decoder: one decode step per call, KV cache paged in blocks.

    Each layer owns buffers ``k_cache``/``v_cache`` of shape
    ``[num_blocks, block_size, num_kv_heads, head_dim]``; ``forward`` writes the new token of each
    row at ``slot_mapping`` (``block * block_size + offset``) and attends over the row's first
    ``seq_lens`` tokens through ``block_table``. Build one with ``make_decoder``; build its inputs
    with ``KVBlockManager.decode_batch``.

    **Tensor parallel.** With ``parallel`` (a ``TensorParallel`` of ``world_size > 1``) the model is
    that rank's shard: vocab-parallel embedding and logits, column/row-parallel layers (see
    ``DecoderLayer``), collectives on ``parallel.group``. Every rank of the group calls ``forward``
    with the same batch and gets the whole logits. Build one from a single-process model's weights
    with ``shard_decoder`` (or ``make_decoder(..., parallel=...)``).
    """

    # Registered buffers (declared for type checkers; nn.Module.__getattr__ is untyped).
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    embed_tokens: nn.Embedding | VocabParallelEmbedding
    lm_head: nn.Linear | ParallelLMHead

    def __init__(self, config: DecoderConfig | None = None, parallel: TensorParallel | None = None) -> None:
        super().__init__()
        self.config = config = config or DecoderConfig()
        self.parallel = parallel
        if parallel is None:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        else:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, parallel)
            self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, parallel)
        self.layers = nn.ModuleList(DecoderLayer(config, parallel) for _ in range(config.num_layers))
        self.final_norm = nn.Parameter(torch.ones(config.hidden_size))
        cos, sin = _rope_tables(config)
        self.register_buffer("rope_cos", cos.float(), persistent=False)
        self.register_buffer("rope_sin", sin.float(), persistent=False)

    @staticmethod
    def pad_values() -> dict[str, int]:
        """Fill values for padded rows: token 0 at position 0, writing and reading the scratch block."""
        return {
            "input_ids": 0,
            "positions": 0,
            "block_table": SCRATCH_BLOCK,
            "seq_lens": 1,
            "slot_mapping": SCRATCH_BLOCK,
            "seq_lens_host": 1,
        }

    @classmethod
    def devgraph_options(cls) -> dict[str, Any]:
        """What a graph runner needs to know: pad values and which arguments are host values. Host lists
        reach the graph's updatable tasks through the raw front end (Dynamo would make each list a
        constant of its graph), which this model opts into: its forward reads no other Python state."""
        return {"pad_values": cls.pad_values(), "host_args": ("seq_lens_host",), "frontend": "raw"}

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        slot_mapping: torch.Tensor,
        seq_lens_host: list[int],
    ) -> torch.Tensor:
        """Logits ``[B, vocab_size]`` for one new token per row.

        Args:
            input_ids: ``[B]`` int64, the new token of each row.
            positions: ``[B]`` int64, its position (the row's length before this token).
            block_table: ``[B, max_blocks_per_seq]`` int32, the row's cache blocks (zeros past the end).
            seq_lens: ``[B]`` int32, the row's length including this token (device copy).
            slot_mapping: ``[B]`` int32 or int64, flat cache slot of the new token.
            seq_lens_host: ``seq_lens`` as a host list (the CPU and NPU attention kernels read it).
        """
        hidden = self.embed_tokens(input_ids)
        # Gather (not slice) the RoPE rows so positions stay on the device: capture-safe.
        cos = self.rope_cos.index_select(0, positions).to(hidden.dtype).unsqueeze(1)
        sin = self.rope_sin.index_select(0, positions).to(hidden.dtype).unsqueeze(1)
        slots = slot_mapping.long()
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, cos, sin, block_table, seq_lens, slots, seq_lens_host)
        assert residual is not None
        hidden, _ = add_rms_norm(hidden, residual, self.final_norm, self.config.rms_eps)
        return self.lm_head(hidden)

    @torch.no_grad()
    def clear_kv_cache(self) -> None:
        """Zero every layer's KV cache (not needed between runs: slots are written before being read)."""
        for layer in cast("Sequence[DecoderLayer]", self.layers):
            layer.k_cache.zero_()
            layer.v_cache.zero_()

    def dummy_inputs(self, batch_size: int) -> dict[str, Any]:
        """Forward kwargs of ``batch_size`` padded rows (all pad values): shapes for warm-up/capture."""
        return pad_batch({}, batch_size, self.config, device=self.embed_tokens.weight.device)


def pad_batch(
    batch: Mapping[str, Any], batch_size: int, config: DecoderConfig, device: torch.device | str = "cpu"
) -> dict[str, Any]:
    """``batch`` (forward kwargs, possibly empty) padded to ``batch_size`` rows with the pad values."""
    pad = PagedDecoder.pad_values()
    n = len(batch["seq_lens_host"]) if batch else 0
    if n > batch_size:
        raise ValueError(f"batch has {n} rows, more than batch_size={batch_size}")
    extra = batch_size - n
    if batch:
        device = batch["input_ids"].device

    def fill(name: str, ref_dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        padding = torch.full((extra, *shape), pad[name], dtype=ref_dtype, device=device)
        return torch.cat((batch[name], padding)) if batch else padding

    slot_dtype = batch["slot_mapping"].dtype if batch else torch.int64
    return {
        "input_ids": fill("input_ids", torch.int64, ()),
        "positions": fill("positions", torch.int64, ()),
        "block_table": fill("block_table", torch.int32, (config.max_blocks_per_seq,)),
        "seq_lens": fill("seq_lens", torch.int32, ()),
        "slot_mapping": fill("slot_mapping", slot_dtype, ()),
        "seq_lens_host": [*(batch["seq_lens_host"] if batch else []), *[pad["seq_lens_host"]] * extra],
    }


_M = TypeVar("_M", bound=nn.Module)


@torch.no_grad()
def init_weights(model: _M, seed: int) -> _M:
    """Deterministic random weights for a tiny test model, drawn on the CPU from ``seed``.

    Linear weights have std ``1/sqrt(fan_in)`` (activations and logits of order one), embeddings
    std 1, 1-d weights (norms) ``1 + noise`` so that a norm dropping its weight is caught. Returns the
    model in eval mode with ``requires_grad`` off.
    """
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() == 2 and "embed" not in name:
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
        elif p.dim() == 2:
            p.copy_(torch.randn(p.shape, generator=gen))
        else:
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
    return model.requires_grad_(False).eval()


@torch.no_grad()
def make_decoder(
    config: DecoderConfig | None = None,
    seed: int = 0,
    device: torch.device | str = "cpu",
    parallel: TensorParallel | None = None,
) -> PagedDecoder:
    """A ``PagedDecoder`` with deterministic random weights (same ``seed`` -> same weights anywhere).

    Weights are drawn on the CPU from a seeded generator, then moved to ``device`` and cast to
    ``config.dtype``. Linear weights have std ``1/sqrt(fan_in)``, so activations and logits stay of
    order one (attention is far from uniform, logits are neither flat nor saturated); norm weights
    are ``1 + noise`` so a norm that drops its weight is caught. The model is returned in eval mode
    with ``requires_grad`` off (an inference reference: no autograd state in captured graphs).

    With ``parallel`` it is the tensor-parallel shard of ``parallel.rank`` of the model this call
    makes without it (``shard_decoder`` of it), so every rank given the same seed holds one shard of
    the same model.
    """
    config = config or DecoderConfig()
    if parallel is not None:
        return shard_decoder(make_decoder(config, seed, "cpu"), parallel).to(device)
    model = init_weights(PagedDecoder(config), seed)
    model.to(device=device, dtype=config.dtype)
    # RoPE tables stay exact in float32 even for a low-precision model; forward casts the rows it uses.
    cos, sin = _rope_tables(config)
    model.rope_cos = cos.to(device=device, dtype=torch.float32)
    model.rope_sin = sin.to(device=device, dtype=torch.float32)
    return model.requires_grad_(False).eval()


@torch.no_grad()
def shard_decoder(model: PagedDecoder, parallel: TensorParallel) -> PagedDecoder:
    """The tensor-parallel shard ``parallel.rank`` of the single-process ``model`` (a new model).

    Its weights are slices of ``model``'s (see ``devgraph.testing._parallel.shard_state_dict``), on
    the same device and dtype, with a fresh KV cache of the rank's key/value heads. Every rank of
    ``parallel.group`` must build its shard of the same model; the shards' collectives then make
    each rank's logits those of ``model`` (up to the order of the all-reduced partial sums).

    Raises:
        ValueError: naming the size (heads, key/value heads, intermediate or vocabulary size) the
            ranks cannot share evenly.
    """
    if model.parallel is not None:
        raise ValueError("shard_decoder needs a single-process PagedDecoder, got a tensor-parallel shard")
    weight = model.embed_tokens.weight
    shard = PagedDecoder(model.config, parallel)
    shard.load_state_dict(shard_state_dict(model.state_dict(), model.config, parallel))
    shard.to(device=weight.device, dtype=weight.dtype)
    shard.rope_cos, shard.rope_sin = model.rope_cos.clone(), model.rope_sin.clone()
    return shard.requires_grad_(False).eval()


class OutOfBlocksError(DevgraphError):
    """The KV cache has no free block left (or a sequence reached ``max_blocks_per_seq``)."""


@attrs.define
class _Sequence:
    blocks: list[int] = attrs.field(factory=list)
    length: int = 0


class KVBlockManager:
    """Host-side allocator of cache blocks; builds the forward kwargs of one decode step.

    Blocks ``1 .. num_blocks-1`` are handed out (block 0 is the scratch block of padded rows). A
    sequence gets a new block when its length reaches a multiple of ``block_size``.

    Args:
        config: the model's config (cache geometry).
        device: where ``decode_batch`` puts its tensors.
        slot_dtype: dtype of ``slot_mapping`` (int64 like CUDA engines; int32 like NPU's
            ``out_cache_loc``).
    """

    def __init__(
        self,
        config: DecoderConfig,
        device: torch.device | str = "cpu",
        slot_dtype: torch.dtype = torch.int64,
    ) -> None:
        if slot_dtype not in (torch.int32, torch.int64):
            raise ValueError(f"slot_dtype must be torch.int32 or torch.int64, got {slot_dtype}")
        self.config = config
        self.device = torch.device(device)
        self.slot_dtype = slot_dtype
        # Popped from the end: block 1 first, so allocation order is easy to read in tests.
        self._free = list(range(config.num_blocks - 1, SCRATCH_BLOCK, -1))
        self._seqs: dict[Any, _Sequence] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def seq_len(self, seq_id: Any) -> int:
        """Tokens cached for ``seq_id`` so far (0 for an unknown sequence)."""
        seq = self._seqs.get(seq_id)
        return seq.length if seq else 0

    def blocks(self, seq_id: Any) -> list[int]:
        """The blocks held by ``seq_id``, in order."""
        return list(self._seqs[seq_id].blocks)

    def free(self, seq_id: Any) -> None:
        """Release the blocks of ``seq_id`` (unknown ids are ignored)."""
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self._free.extend(reversed(seq.blocks))

    def truncate(self, seq_id: Any, length: int) -> None:
        """Shorten ``seq_id`` to its first ``length`` tokens (a speculative step's rejected tokens);
        blocks no longer needed go back to the free list.

        Raises:
            ValueError: ``length`` is negative or longer than the sequence.
        """
        seq = self._seqs[seq_id]
        if not 0 <= length <= seq.length:
            raise ValueError(f"cannot truncate sequence {seq_id!r} of {seq.length} tokens to {length}")
        keep = -(-length // self.config.block_size)
        self._free.extend(reversed(seq.blocks[keep:]))
        del seq.blocks[keep:]
        seq.length = length

    def decode_batch(self, seq_ids: Sequence[Any], tokens: Sequence[int]) -> dict[str, Any]:
        """Append ``tokens[i]`` to sequence ``seq_ids[i]``; return the forward kwargs of that step.

        Unknown ids start new sequences. The step is all-or-nothing: when it raises, no sequence
        changed.

        Raises:
            ValueError: lengths differ, or an id appears twice.
            OutOfBlocksError: no free block is left, or a sequence would exceed
                ``max_blocks_per_seq * block_size`` tokens.
        """
        c = self.config
        if len(seq_ids) != len(tokens):
            raise ValueError(f"decode_batch got {len(seq_ids)} seq_ids but {len(tokens)} tokens")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"decode_batch got a sequence id twice: {list(seq_ids)}")
        if not seq_ids:
            raise ValueError("decode_batch needs at least one sequence")
        positions = [self.seq_len(s) for s in seq_ids]
        needing = [s for s, pos in zip(seq_ids, positions) if pos % c.block_size == 0]
        for s, pos in zip(seq_ids, positions):
            if pos >= c.max_seq_len:
                raise OutOfBlocksError(
                    f"sequence {s!r} is full: {pos} tokens = max_blocks_per_seq ({c.max_blocks_per_seq}) "
                    f"x block_size ({c.block_size}); finish it or raise DecoderConfig.max_blocks_per_seq"
                )
        if len(needing) > len(self._free):
            raise OutOfBlocksError(
                f"KV cache out of blocks: this step needs {len(needing)} new block(s), "
                f"{len(self._free)} free of {c.num_blocks - 1}; free finished sequences "
                "(KVBlockManager.free) or raise DecoderConfig.num_blocks"
            )

        table = torch.zeros(len(seq_ids), c.max_blocks_per_seq, dtype=torch.int32)
        slots, lens = [], []
        for row, (s, pos) in enumerate(zip(seq_ids, positions)):
            seq = self._seqs.setdefault(s, _Sequence())
            if pos % c.block_size == 0:
                seq.blocks.append(self._free.pop())
            seq.length = pos + 1
            slots.append(seq.blocks[pos // c.block_size] * c.block_size + pos % c.block_size)
            lens.append(seq.length)
            table[row, : len(seq.blocks)] = torch.tensor(seq.blocks, dtype=torch.int32)
        dev = self.device
        return {
            "input_ids": torch.tensor(list(tokens), dtype=torch.int64, device=dev),
            "positions": torch.tensor(positions, dtype=torch.int64, device=dev),
            "block_table": table.to(dev),
            "seq_lens": torch.tensor(lens, dtype=torch.int32, device=dev),
            "slot_mapping": torch.tensor(slots, dtype=self.slot_dtype, device=dev),
            "seq_lens_host": lens,
        }


def _dense_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@torch.no_grad()
def dense_reference_logits(
    model: PagedDecoder,
    token_history: Sequence[Sequence[int]],
    dtype: torch.dtype | None = torch.float64,
) -> torch.Tensor:
    """Logits ``[B, vocab]`` after the last token of each sequence, recomputed densely in plain torch.

    Slow and independent of the paged path: full causal attention over each whole sequence, no KV
    cache, no devgraph ops. Runs in ``dtype`` (float64 by default; None = the model's dtype) on
    the model's device and returns that dtype.
    """
    if model.parallel is not None:
        raise ValueError("dense_reference_logits needs the single-process model, not a tensor-parallel shard")
    c = model.config
    weight = model.embed_tokens.weight
    dtype = dtype or weight.dtype
    device = weight.device

    def w(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(dtype)

    cos_all, sin_all = (t.to(device=device, dtype=dtype) for t in _rope_tables(c))
    group = c.num_heads // c.num_kv_heads
    q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    out = []
    for tokens in token_history:
        if not tokens:
            raise ValueError("dense_reference_logits needs at least one token per sequence")
        ids = torch.tensor(list(tokens), dtype=torch.int64, device=device)
        n = ids.numel()
        cos, sin = cos_all[:n].unsqueeze(1), sin_all[:n].unsqueeze(1)
        h = w(weight)[ids]
        for layer in cast("Sequence[DecoderLayer]", model.layers):
            x = _dense_rms_norm(h, w(layer.input_norm), c.rms_eps)
            q, k, v = (x @ w(layer.qkv_proj.weight).T).split([q_size, kv_size, kv_size], dim=-1)
            q = _apply_rope(q.reshape(n, c.num_heads, c.head_dim), cos, sin)
            k = _apply_rope(k.reshape(n, c.num_kv_heads, c.head_dim), cos, sin)
            v = v.reshape(n, c.num_kv_heads, c.head_dim)
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, k) * layer.scale
            causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
            probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
            attn = torch.einsum("hqk,khd->qhd", probs, v).reshape(n, q_size)
            h = h + attn @ w(layer.o_proj.weight).T
            x = _dense_rms_norm(h, w(layer.post_attn_norm), c.rms_eps)
            gate, up = (x @ w(layer.gate_up_proj.weight).T).chunk(2, dim=-1)
            h = h + (F.silu(gate) * up) @ w(layer.down_proj.weight).T
        last = _dense_rms_norm(h[-1], w(model.final_norm), c.rms_eps)
        out.append(last @ w(model.lm_head.weight).T)
    return torch.stack(out)


@torch.no_grad()
def greedy_decode(
    model: PagedDecoder,
    prompts: Sequence[Sequence[int]],
    steps: int,
    *,
    forward: Callable[..., torch.Tensor] | None = None,
    manager: KVBlockManager | None = None,
    on_step: Callable[[dict[str, Any], torch.Tensor], None] | None = None,
) -> list[list[int]]:
    """Generate ``steps`` tokens per prompt by greedy argmax; returns the generated tokens only.

    Prompts are prefilled one token per decode step, all sequences stepping together, so the batch
    size changes as shorter prompts start generating earlier and finish earlier (exercising a
    runner's buckets).

    Args:
        model: the decoder (its config sizes the block manager).
        prompts: non-empty token lists.
        steps: tokens to generate per prompt (0 returns empty lists).
        forward: called with the step's kwargs instead of ``model`` (e.g. a graph runner).
        manager: block manager to use (a fresh one on the model's device if None); sequence ids are
            the prompt indices, freed at the end.
        on_step: called with ``(batch, logits)`` after every step (for checks in tests).
    """
    if any(len(p) == 0 for p in prompts):
        raise ValueError("greedy_decode needs non-empty prompts")
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    forward = forward or model
    manager = manager or KVBlockManager(model.config, device=model.embed_tokens.weight.device)
    generated: list[list[int]] = [[] for _ in prompts]
    fed = [0] * len(prompts)  # prompt tokens fed so far
    try:
        while True:
            active = [i for i, p in enumerate(prompts) if len(generated[i]) < steps]
            if not active:
                break
            tokens = [prompts[i][fed[i]] if fed[i] < len(prompts[i]) else generated[i][-1] for i in active]
            batch = manager.decode_batch(active, tokens)
            logits = forward(**batch)
            if on_step is not None:
                on_step(batch, logits)
            next_tokens = logits.argmax(-1).tolist()
            for row, i in enumerate(active):
                if fed[i] < len(prompts[i]):
                    fed[i] += 1
                if fed[i] == len(prompts[i]):  # the logits follow the whole prompt (+ generated)
                    generated[i].append(int(next_tokens[row]))
    finally:
        for i in range(len(prompts)):
            manager.free(i)
    logger.debug("greedy_decode: %d prompts, %d steps", len(prompts), steps)
    return generated
