"""One static KV cache shared by every batch size: a batch of ``n`` rows uses its first ``n`` rows.

transformers' ``StaticLayer`` keeps ``keys``/``values`` as ``[batch, heads, max_cache_len, head_dim]``
tensors it writes in place (``index_copy_`` at its ``cumulative_length``, a device tensor it
advances in place). ``SharedStaticCache`` allocates those tensors once, for the largest bucket, and
hands out ``view(n)``: a ``transformers.cache_utils.Cache`` whose layers are shallow copies of the big
layers with ``keys``/``values`` narrowed to the first ``n`` rows. The copies share the big layers'
``cumulative_length`` tensors, so the eager prefill (``n`` real rows) and the captured decode step
of the bucket above ``n`` write the same memory at the same position. Every layer is a full-length
``StaticLayer``, also for sliding-window layers: transformers' mask code then builds the sliding
mask over the full cache (a rolling ``StaticSlidingWindowLayer`` branches on a host int and cannot
be captured).

A view is a ``CacheRows`` (``cache_rows_class()``): a ``Cache`` that transformers' assisted generation
(prompt lookup, an assistant model) can roll back. Its loop calls ``crop(-n)`` after each verify step to drop the
rejected candidates' keys/values; a static layer has no ``crop`` in transformers, and transformers
refuses its own ``StaticCache`` for assisted generation. Over a full-length static layer the rollback is
the write position moved back by ``n``, in place: the slots past it hold the rejected candidates' keys
and values until the next step writes them again, and the masks (causal: a token sees the slots up to
its own position) hide them meanwhile. ``SharedStaticCache.on_crop`` is told of each rollback (the
adapter counts accepted candidates from it).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from devgraph.adapters.hf._compat import cache_kwarg

__all__ = ["SharedStaticCache", "cache_rows_class"]


def _cache_class() -> Any:
    from transformers.cache_utils import Cache

    return Cache


class _CacheRowsMixin:
    """What ``CacheRows`` adds to transformers' ``Cache`` (a mixin: transformers is imported lazily)."""

    layers: list[Any]
    #: the ``SharedStaticCache`` this view is of (told of each rollback); None inside a trace
    shared: Any = None

    @property
    def is_croppable(self) -> bool:
        return True

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens of every row: move the write positions back.

        Raises:
            ValueError: a positive count (transformers' legacy "crop to this length", which its own
                dynamic layers refuse too).
        """
        # an int from the target's loop, a 0-d tensor from an assistant's (a static layer's length is one)
        count = int(tokens_to_remove)
        if count > 0:
            raise ValueError(
                f"crop({count}): devgraph's static cache rolls back by a negative count of tokens only"
            )
        if count:
            for layer in self.layers:
                layer.cumulative_length.sub_(-count)  # in place: graphs hold the tensor
        if self.shared is not None and self.shared.on_crop is not None:
            self.shared.on_crop(-count)


_CACHE_ROWS: list[Any] = []


def cache_rows_class() -> Any:
    """``CacheRows``: transformers' ``Cache`` with the rollback of ``_CacheRowsMixin`` (built once)."""
    if not _CACHE_ROWS:
        _CACHE_ROWS.append(type("CacheRows", (_CacheRowsMixin, _cache_class()), {"__module__": __name__}))
    return _CACHE_ROWS[0]


class SharedStaticCache:
    """Keys/values for ``rows`` sequences of ``max_cache_len`` slots, viewed per batch size.

    Allocate with ``allocate(model)`` (one eager one-token forward, so that each layer's heads,
    head dims and dtype are the model's own); ``reset()`` before each generation.
    """

    def __init__(self, num_layers: int, rows: int, max_cache_len: int) -> None:
        from transformers.cache_utils import Cache, StaticLayer

        self.rows = rows
        self.max_cache_len = max_cache_len
        # Any: transformers types a cache's layers as a union that includes layers without keys.
        self.base: Any = Cache(layers=[StaticLayer(max_cache_len=max_cache_len) for _ in range(num_layers)])
        self._views: dict[int, Any] = {}
        #: told ``on_crop(tokens)`` of each rollback of a view (``CacheRows.crop``), or None
        self.on_crop: Any = None

    @property
    def allocated(self) -> bool:
        return all(layer.is_initialized for layer in self.base.layers)

    @property
    def nbytes(self) -> int:
        """Bytes of every layer's keys and values (0 before ``allocate``)."""
        if not self.allocated:
            return 0
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in self.base.layers)

    def allocate(self, model: Any, extra_kwargs: dict[str, Any]) -> None:
        """Let the model's own first ``update`` size the tensors: one token for every row, eagerly."""
        if self.allocated:
            return
        ids = torch.zeros(self.rows, 1, dtype=torch.long, device=model.device)
        with torch.no_grad():
            model(input_ids=ids, use_cache=True, **{cache_kwarg(model): self.base}, **extra_kwargs)
        self.reset()

    def release(self) -> None:
        """Forget the tensors (the model's dtype or device changed): ``allocate`` sizes them again."""
        from transformers.cache_utils import Cache, StaticLayer

        self.base = Cache(layers=[StaticLayer(max_cache_len=self.max_cache_len) for _ in self.base.layers])
        self._views.clear()

    def reset(self) -> None:
        """Empty every row: zero keys, values and write positions, in place (graphs hold them)."""
        for layer in self.base.layers:
            if layer.is_initialized:
                layer.keys.zero_()
                layer.values.zero_()
            layer.cumulative_length.zero_()

    def positions(self) -> list[torch.Tensor]:
        """Each layer's write position (a copy): to put back after a capture advanced them."""
        return [layer.cumulative_length.clone() for layer in self.base.layers]

    def restore_positions(self, saved: list[torch.Tensor]) -> None:
        for layer, value in zip(self.base.layers, saved, strict=True):
            layer.cumulative_length.copy_(value)

    def _tensors(self) -> list[torch.Tensor]:
        return [t for layer in self.base.layers for t in (layer.keys, layer.values, layer.cumulative_length)]

    def snapshot(self) -> list[torch.Tensor]:
        """A copy of every key, value and write position (what ``restore`` puts back)."""
        return [t.clone() for t in self._tensors()]

    def restore(self, saved: list[torch.Tensor]) -> None:
        """Put back, in place, what ``snapshot`` copied (graphs hold these tensors)."""
        for t, value in zip(self._tensors(), saved, strict=True):
            t.copy_(value)

    def view(self, n: int) -> Any:
        """A ``Cache`` over the first ``n`` rows (built once per ``n``; needs ``allocate`` first).

        While Dynamo traces (the decode step behind ``frontend='dynamo'``), ``n`` is the symbolic batch
        size: the view is built inside the trace, slicing the big tensors, so that one graph serves
        every batch size instead of one per ``n`` (a dict lookup by ``n`` would specialise it).
        """
        if torch.compiler.is_compiling():
            return self._sliced(n)
        cache = self._views.get(n)
        if cache is None:
            if not 1 <= n <= self.rows:
                raise ValueError(f"a view of {n} rows of a {self.rows}-row cache")
            cache = self._sliced(n)
            cache.shared = self
            self._views[n] = cache
        return cache

    def _sliced(self, n: Any) -> Any:
        layers = []
        for big in self.base.layers:
            layer = copy.copy(big)  # shares cumulative_length: one write position for all views
            layer.keys = big.keys[:n]
            layer.values = big.values[:n]
            layer.batch_size = n
            layers.append(layer)
        return cache_rows_class()(layers=layers)

    def owns(self, cache: Any) -> bool:
        return any(cache is view for view in self._views.values())
