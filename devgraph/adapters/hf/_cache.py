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
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from devgraph.adapters.hf._compat import cache_kwarg

__all__ = ["SharedStaticCache"]


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
            self._views[n] = cache
        return cache

    def _sliced(self, n: Any) -> Any:
        from transformers.cache_utils import Cache

        layers = []
        for big in self.base.layers:
            layer = copy.copy(big)  # shares cumulative_length: one write position for all views
            layer.keys = big.keys[:n]
            layer.values = big.values[:n]
            layer.batch_size = n
            layers.append(layer)
        return Cache(layers=layers)

    def owns(self, cache: Any) -> bool:
        return any(cache is view for view in self._views.values())
