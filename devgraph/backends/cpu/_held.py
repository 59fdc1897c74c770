"""How a recorded entry holds its tensors: pool memory by metadata, outside memory by address.

``_Ref`` rebuilds a tensor over a pool block; ``_External`` holds a tensor from outside the capture
(weights, static inputs) by storage weak reference, as a device graph holds an address, and raises
``DevgraphError`` naming it when it was freed; ``_Strong`` holds what a device would copy into the
graph (0-d kernel scalars) or a task's own copy.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from devgraph._errors import DevgraphError
from devgraph._source import user_source_line
from devgraph.backends.cpu._pool import Block, block_of, tensor_bytes

__all__ = ["Held", "describe", "materialise"]

#: Externals of at most this many elements remember the source line that read them.
_SOURCE_NUMEL = 64


class _Layout:
    """Where a tensor sits in its storage, rebuilt over that storage at replay.

    The metadata includes the lazy conjugate and negative bits: ``_conj`` views a complex tensor
    without touching its memory, and a rebuilt tensor without the bit would read the wrong values.
    """

    __slots__ = ("conj", "dtype", "neg", "offset", "size", "stride")

    def __init__(self, t: torch.Tensor) -> None:
        self.offset = int(t.storage_offset())
        self.size = tuple(t.shape)
        self.stride = tuple(t.stride())
        self.dtype = t.dtype
        self.conj = t.is_conj()
        self.neg = t.is_neg()

    def _over(self, storage: torch.UntypedStorage) -> torch.Tensor:
        t = torch.empty(0, dtype=self.dtype).set_(storage, self.offset, self.size, self.stride)
        if self.conj:
            torch._C._set_conj(t, True)
        if self.neg:
            torch._C._set_neg(t, True)
        return t


class _Ref(_Layout):
    """A tensor in a pool block, rebuilt from metadata at replay (holds no reference to it)."""

    __slots__ = ("block",)

    def __init__(self, block: Block, t: torch.Tensor) -> None:
        super().__init__(t)
        self.block = block

    def get(self) -> torch.Tensor:
        return self._over(self.block.storage)


class _Strong:
    """A tensor held as is: a 0-d value (a kernel scalar on a device), an empty or non-CPU tensor, or
    a copy a task owns (``Entry.own``)."""

    __slots__ = ("tensor",)

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t

    def get(self) -> torch.Tensor:
        return self.tensor

    def alive(self) -> bool:
        return True


class _External(_Layout):
    """A tensor from outside the capture (weights, static inputs), held as a device graph holds it:
    by address, without keeping it alive.

    The storage is held by weak reference and the tensor rebuilt from metadata at replay. A device
    graph whose input was freed reads whatever memory took its place; here ``get`` raises a
    ``DevgraphError`` naming the input instead (the caller must keep graph inputs alive).
    """

    __slots__ = ("op", "ref", "source")

    def __init__(self, t: torch.Tensor, op: str) -> None:
        super().__init__(t)
        self.ref = StorageWeakRef(t.untyped_storage())
        self.op = op
        # The line that read it, for the error should it be freed before the capture ends. Only for
        # small tensors (indices, positions made on the host: what is made and dropped inside a
        # forward), so reading weights and caches costs no stack walk.
        self.source = user_source_line() if t.numel() <= _SOURCE_NUMEL else None

    def alive(self) -> bool:
        return not self.ref.expired()

    def describe(self) -> str:
        return f"a [{', '.join(map(str, self.size))}] {self.dtype} tensor read by {self.op}"

    def get(self) -> torch.Tensor:
        storage = None if self.ref.expired() else torch.UntypedStorage._new_with_weak_ptr(self.ref.cdata)
        if storage is None:
            raise DevgraphError(
                f"a captured graph input was freed: {self.describe()} no longer exists. A device graph "
                "would read freed memory here; keep every tensor the captured code read from outside the "
                "capture (inputs, weights, buffers) alive as long as the graph is replayed"
            )
        return self._over(storage)


Held = (_Ref, _Strong, _External)


def describe(t: torch.Tensor, op: str) -> _Ref | _Strong | _External:
    block = block_of(t)
    if block is not None:
        return _Ref(block, t)
    if t.dim() == 0 or t.device.type != "cpu" or t.layout != torch.strided or not tensor_bytes(t):
        return _Strong(t)
    return _External(t, op)


def materialise(x: Any) -> Any:
    return x.get() if isinstance(x, Held) else x
