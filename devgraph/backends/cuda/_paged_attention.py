"""Paged decode attention for CUDA: flex attention over the blocks in use, capture-safe.

Two paths, both plain torch (nothing beyond a pip-installed torch with its Triton), both reading
the lengths from the *device* tensor ``seq_lens``, so a captured CUDA graph replays with whatever
lengths were last copied there (the task update of attention is a no-op on CUDA):

* **flex** (``flex_decode``): ``torch.nn.attention.flex_attention``, compiled, over the whole KV
  cache seen as one sequence per KV head (``[1, Hkv, num_blocks * block_size, D]``, a view: nothing
  is gathered or upcast). A ``BlockMask`` built on the device from ``block_table`` and ``seq_lens``
  lists, per sequence, the physical cache blocks it uses (``ceil(seq_lens[b] / block_size)`` of
  them, a device count the kernel loops to), and a ``mask_mod`` cuts the last block at the length.
  The query heads sharing a KV head ride in the query-length dimension (``[B, Hkv, G, D]``), so any
  GQA ratio works and the decoding kernel (split-KV over the blocks in use) is chosen. Used when
  the cache's ``block_size`` is a power of two of at least 16, ``D >= 16`` (Triton's smallest
  matrix tile) and at most 64 query heads share a KV head; ``flex_supported`` says so.
* **window** (``window_decode``): ``scaled_dot_product_attention`` in the cache dtype over the
  gathered block table, masked at the lengths: the fallback for other block sizes (SGLang's token
  pool has block size 1) and head dims.

Cost structure (what a benchmark of this kernel measures):

* flex: the kernel reads K and V only for blocks in use, so its memory traffic grows with the
  tokens attended; its grid is fixed at compile time (``B * Hkv * split_kv`` programs) and each
  split takes an equal share of the sequence's blocks in use. Around it: ``O(B * max_blocks)``
  integer work to build the mask and the query/output copies (``O(B * Hq * D)``). One compile per
  distinct shape (batch rounded up to a power of two, heads, cache size, block table width), in
  the first eager call: warm up before capture (devgraph's runners do); the rounding pads with
  empty sequences, which cost no kernel work. Up to ``MAX_COMPILED_SHAPES`` shapes are compiled
  (the Dynamo recompile limit is raised to that for this call only); past it Dynamo would run
  flex eagerly, over the whole cache.
* window: gathers ``max_blocks * block_size`` positions per sequence in the cache dtype (no fp32
  copy of K/V, SDPA accumulates in fp32 internally), so its cost grows with the block table's
  width, as the old kernel's did, at half the bytes for 16-bit caches.

Measured so far on CPU only (no GPU was lent): flex's *CPU* compiled kernel over the same block
mask (batch 4, 8/2 heads, D 64, block 16, table width 4096 tokens, fp32) took 0.7, 1.1, 2.7 and
6.0 ms at 128, 512, 2048 and 4096 tokens attended, while the old kernel stayed at 11-14 ms and
the window at 5-6 ms whatever the length. That shows the block mask's sparsity, not CUDA speed:
``benchmarks/paged_attention.py`` measures the CUDA kernel, eager and graphed.

Semantics (those of the op, as the CPU reference's device-length math): positions at or past
``seq_lens[b]`` are not attended, lengths are clamped to ``[0, max_blocks * block_size]``, a
sequence of length 0 gets zeros (never NaN), table entries past a sequence's blocks may hold any
value. The query is cast to the cache dtype (flex and SDPA take one dtype); the result is cast to
``out``'s. Preconditions: a sequence lists each physical block at most once in its blocks in use
(flex; a block shared by *different* sequences, prefix caching, is fine), and cache slots past a
length inside a sequence's last block hold finite values (they are read and weighted by zero, as
in any fused attention kernel; the old kernel read the whole table that way).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from devgraph.backends._reference import PagedAttentionArgs, gather_block_table

__all__ = [
    "MAX_COMPILED_SHAPES",
    "block_mask",
    "flex_decode",
    "flex_supported",
    "window_decode",
]

#: Distinct shapes the compiled flex kernel is compiled for before Dynamo gives up (and would fall
#: back to eager flex, which materialises scores over the whole cache). One per batch size rounded
#: up to a power of two, per cache shape.
MAX_COMPILED_SHAPES = 64

# The kernel's query tile spans the G query heads of a KV head (padded to >= 16); flex's decoding
# kernel needs the BlockMask's query block to be a multiple of it.
_Q_BLOCK = 128
_MIN_TILE = 16  # Triton's smallest tl.dot dimension: block_size and D must be at least this


def flex_supported(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether the flex path serves these shapes (block size a power of two >= 16, D >= 16, G <= 64)."""
    block_size, dim = key_cache.shape[1], key_cache.shape[3]
    group = query.shape[1] // key_cache.shape[2]
    pow2 = block_size & (block_size - 1) == 0
    return pow2 and block_size >= _MIN_TILE and dim >= _MIN_TILE and group <= _Q_BLOCK // 2


def _lengths(seq_lens: torch.Tensor, capacity: int) -> torch.Tensor:
    return seq_lens.to(torch.int64).clamp(0, capacity)


def block_mask(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    num_blocks: int,
    block_size: int,
    group: int,
    *,
    dense: bool = False,
    width: int | None = None,
) -> Any:
    """The flex ``BlockMask`` of paged decode: per sequence, its physical blocks in use.

    Built with device ops only (fixed shapes, no host reads): ``kv_num_blocks[b] =
    ceil(seq_lens[b] / block_size)``, ``kv_indices[b] = block_table[b]`` (clamped into the cache),
    and a ``mask_mod`` keeping, in the sequence's last block, the offsets below its length. The
    compiled kernel visits only the listed blocks, so the mask_mod needs no more. Eager flex
    evaluates the mask_mod over the whole cache instead: ``dense=True`` adds the membership of each
    block in the sequence's list, so eager flex computes exactly what the kernel does (tests, CPU).
    ``width`` pads ``kv_indices`` (flex's CPU compiler wants one entry per cache block).
    """
    from torch.nn.attention.flex_attention import BlockMask

    batch, max_blocks = block_table.shape
    lens = _lengths(seq_lens, max_blocks * block_size)
    used = (lens + block_size - 1) // block_size  # [B]: blocks in use
    table = block_table.clamp(0, num_blocks - 1).to(torch.int32)
    last_index = (used - 1).clamp(min=0)
    last_block = table.gather(1, last_index[:, None]).squeeze(1)  # [B]
    last_len = lens - last_index * block_size  # tokens in the last block (block_size when full)

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (kv_idx // block_size != last_block[b]) | (kv_idx % block_size < last_len[b])

    if dense:
        listed = torch.arange(max_blocks, device=table.device)[None, :] < used[:, None]
        member = torch.zeros(batch, num_blocks + 1, dtype=torch.bool, device=table.device)
        member.scatter_(1, torch.where(listed, table.to(torch.int64), num_blocks), True)
        member = member[:, :num_blocks]
        kernel_rule = mask_mod

        def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return kernel_rule(b, h, q_idx, kv_idx) & member[b, kv_idx // block_size]

    if width is not None and width > max_blocks:
        table = torch.cat([table, table.new_zeros(batch, width - max_blocks)], dim=1)
    return BlockMask.from_kv_blocks(
        used.to(torch.int32).view(batch, 1, 1),
        table.view(batch, 1, 1, table.shape[1]),
        BLOCK_SIZE=(_Q_BLOCK, block_size),
        mask_mod=mask_mod,
        seq_lengths=(group, num_blocks * block_size),
        compute_q_blocks=False,
    )


@functools.cache
def _compiled_flex() -> Callable[..., torch.Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    # Static shapes: flex's decoding kernel (split-KV) needs a static batch and head count.
    return torch.compile(flex_attention, fullgraph=True, dynamic=False)


@contextlib.contextmanager
def _no_function_modes() -> Iterator[None]:
    """Run the block with no torch function mode active (restored after).

    Dynamo guards compiled code on the torch function mode stack. devgraph's capture enters one
    (the host-sync check) that warm-up calls do not, so without this the kernel compiled in warm-up
    would be recompiled *inside* the capture, where Triton cannot benchmark or launch freely. The
    compiled kernel makes no host syncs, so the check has nothing to see in it.
    """
    from torch.overrides import _pop_mode_temporarily

    with contextlib.ExitStack() as stack:
        for _ in range(torch._C._len_torch_function_stack()):
            stack.enter_context(_pop_mode_temporarily())
        yield


def flex_decode(call: PagedAttentionArgs, *, compiled: bool = True, width: int | None = None) -> None:
    """Flex attention over the blocks in use, written into ``call.out`` (computed in the cache dtype).

    ``call``: the op's arguments (its host lengths, window and soft cap are not read).
    ``compiled=False`` runs eager flex with the dense mask (same result; cost over the whole cache:
    for tests and CPU). ``width``: see ``block_mask``.
    """
    from torch.nn.attention.flex_attention import flex_attention

    query, key_cache, value_cache, block_table, seq_lens = call[:5]
    batch, hq, dim = query.shape
    num_blocks, block_size, hkv, _ = key_cache.shape
    group = hq // hkv
    # Views, not copies: token t of the flat cache is block t // block_size, offset t % block_size.
    keys = key_cache.flatten(0, 1).unsqueeze(0).transpose(1, 2)  # [1, Hkv, N * bs, D]
    values = value_cache.flatten(0, 1).unsqueeze(0).transpose(1, 2)
    # Query head h = kv * G + g reads KV head kv: the G heads become G query rows of that head.
    q = query.to(key_cache.dtype).reshape(batch, hkv, group, dim)
    # The kernel is compiled per batch size: pad the batch to a power of two with empty sequences
    # (no blocks, no work), so a runner's many capture sizes need few compiles.
    padded = 1 << (batch - 1).bit_length()
    if padded != batch:
        extra = padded - batch
        q = torch.cat([q, q.new_zeros(extra, *q.shape[1:])])
        block_table = torch.cat([block_table, block_table.new_zeros(extra, block_table.shape[1])])
        seq_lens = torch.cat([seq_lens, seq_lens.new_zeros(extra)])
    mask = block_mask(block_table, seq_lens, num_blocks, block_size, group, dense=not compiled, width=width)
    if compiled:
        with _no_function_modes(), torch._dynamo.config.patch(recompile_limit=MAX_COMPILED_SHAPES):
            result = _compiled_flex()(q, keys, values, block_mask=mask, scale=call.scale)
    else:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            result = flex_attention(q, keys, values, block_mask=mask, scale=call.scale)
    call.out.copy_(_zero_empty(result[:batch].reshape(batch, hq, dim), seq_lens[:batch]))


def _zero_empty(result: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """Zeros for sequences of length <= 0, whatever a kernel leaves there (no NaN escapes)."""
    return result.masked_fill((seq_lens <= 0).view(-1, 1, 1), 0.0)


def window_decode(call: PagedAttentionArgs) -> None:
    """SDPA in the cache dtype over every block of the table, masked at the lengths, into ``call.out``.

    ``call``: the op's arguments (its host lengths, window and soft cap are not read).
    """
    query, key_cache, value_cache, block_table, seq_lens = call[:5]
    batch = block_table.shape[0]
    hkv, dim = key_cache.shape[2], key_cache.shape[3]
    group = query.shape[1] // hkv
    keys, values = (t.transpose(1, 2) for t in gather_block_table(key_cache, value_cache, block_table))
    span = keys.shape[2]  # [B, Hkv, S, D]
    q = query.to(key_cache.dtype).reshape(batch, hkv, group, dim)
    positions = torch.arange(span, device=seq_lens.device)
    # Position 0 stays visible to an empty sequence so no row is fully masked (NaN in some SDPA
    # kernels); _zero_empty then zeroes that row.
    visible = (positions[None, :] < _lengths(seq_lens, span)[:, None]) | (positions == 0)
    result = F.scaled_dot_product_attention(
        q, keys, values, attn_mask=visible[:, None, None, :], scale=call.scale
    )
    call.out.copy_(_zero_empty(result.reshape(batch, group * hkv, dim), seq_lens))
