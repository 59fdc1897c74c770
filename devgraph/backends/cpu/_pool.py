"""Memory pools of the CPU reference backend: a caching allocator with CUDA's reuse rules.

A pool is a list of blocks (untyped storages). During capture every freshly computed tensor is
placed in a block of the capturing graph's pool. A block is free again once no tensor outside the
pool refers to it (its storage use count falls back to the pool's own reference) -- the rule that
lets graphs captured one after another into one pool share memory, and lets a later replay of one
graph overwrite memory another graph's dead outputs used, exactly as on CUDA.

``BlockPool`` is that allocator (the torch_npu simulator's graph pools are bare ones); ``CpuPool``
is the reference backend's ``MemoryPool`` over it. Both add the bytes they hold to their device's
``PoolBytes``.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING

import attrs
import torch

from devgraph.graph import MemoryPool

if TYPE_CHECKING:
    from devgraph.graph import Device

__all__ = ["Block", "BlockPool", "CpuPool", "PoolBytes", "block_of", "storage_bytes", "tensor_bytes"]

_ALIGN = 512  # CUDA's caching allocator rounds small blocks to 512 bytes; do the same.

# data_ptr of a block's storage -> Block, for every live pool (to find the block behind a tensor).
_blocks_by_ptr: weakref.WeakValueDictionary[int, Block] = weakref.WeakValueDictionary()
_lock = threading.Lock()


@attrs.define
class PoolBytes:
    """Bytes held by the pools of one device (the reference device, or the simulated NPU)."""

    reserved: int = 0
    peak: int = 0

    def add(self, delta: int) -> None:
        self.reserved += delta
        self.peak = max(self.peak, self.reserved)


class Block:
    """One allocation of a pool: an untyped storage of ``nbytes`` bytes."""

    __slots__ = ("__weakref__", "nbytes", "pool", "storage")

    def __init__(self, pool: BlockPool, nbytes: int) -> None:
        self.pool = pool
        self.nbytes = nbytes
        self.storage = torch.UntypedStorage(nbytes)

    def in_use(self) -> bool:
        """True while a tensor other than the pool's own reference uses the block."""
        return torch._C._storage_Use_Count(self.storage._cdata) > 1


def storage_bytes(size: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes a tensor of this size/stride spans from its first element."""
    if any(s == 0 for s in size):
        return 0
    extent = 1 + sum((s - 1) * st for s, st in zip(size, stride))
    return extent * dtype.itemsize  # no allocation: this runs inside captures, under their modes


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes ``t`` spans in its storage from its first element."""
    return storage_bytes(tuple(t.shape), tuple(t.stride()), t.dtype)


def block_of(tensor: torch.Tensor) -> Block | None:
    """The pool block ``tensor``'s storage is, if it lives in a pool."""
    return _blocks_by_ptr.get(tensor.untyped_storage().data_ptr())


class BlockPool:
    """The blocks of one pool and their allocator; adds the bytes it holds to ``counter``."""

    def __init__(self, counter: PoolBytes) -> None:
        self.counter = counter
        self.blocks: list[Block] = []

    def allocate(self, nbytes: int) -> Block:
        """The smallest free block of at least ``nbytes`` bytes, or a new one."""
        nbytes = max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
        free = [b for b in self.blocks if b.nbytes >= nbytes and not b.in_use()]
        if free:
            return min(free, key=lambda b: b.nbytes)
        block = Block(self, nbytes)
        self.blocks.append(block)
        with _lock:
            _blocks_by_ptr[block.storage.data_ptr()] = block
        self.counter.add(nbytes)
        return block

    def reserved_bytes(self) -> int:
        """Bytes held by this pool's blocks."""
        return sum(b.nbytes for b in self.blocks)

    def allocated_bytes(self) -> int:
        """Bytes of blocks some tensor still uses."""
        return sum(b.nbytes for b in self.blocks if b.in_use())

    def __del__(self) -> None:
        try:
            self.counter.add(-self.reserved_bytes())
        except Exception:  # interpreter shutdown
            pass


class CpuPool(BlockPool, MemoryPool):
    """A memory pool on the CPU reference backend (see the module docstring)."""

    def __init__(self, device: Device, counter: PoolBytes) -> None:
        MemoryPool.__init__(self, device)
        BlockPool.__init__(self, counter)
