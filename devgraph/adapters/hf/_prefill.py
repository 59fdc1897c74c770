"""Prefill from pieces (``mode="piecewise"``/``"full_and_piecewise"``): the prompt, split at attention.

A piecewise ``GraphRunner`` serves ``PrefillRow``: one sequence's ``T`` prompt tokens as rows (the token
dimension is what the pieces are captured for), its 4-D mask rows ``[T, max_cache_len]`` (built by
transformers' mask code outside the graph, as for decode), writing keys/values into a one-row
*scratch* static cache whose write position the row resets itself (an in-place device op, so every
replay starts at slot 0). ``PiecewisePrefill`` runs the rows of a left-padded batch one after the
other and copies each row's ``T`` slots into its row of the shared cache, then sets the shared
write position to ``T``: the state an eager prefill of the batch leaves.

Exactness: a prompt whose length is a capture size gives bitwise the model's own one-row forward;
a prompt padded up to a capture size runs the projections on more rows, which can change the last
bits of a matmul (the same holds for every piecewise runner); greedy tokens stay eager's in the
tests (fp32, Llama and Qwen3). Memory: the scratch row adds ``1 / largest bucket`` of the cache.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from devgraph.adapters.hf._cache import SharedStaticCache
from devgraph.adapters.hf._compat import CACHE_KEYS, cache_kwarg, cache_of, causal_lm_output
from devgraph.adapters.hf._step import attention_mask_of, mask_structure

__all__ = ["PiecewisePrefill", "PrefillRow"]


class PrefillRow(nn.Module):
    """One prompt's tokens as rows: ``forward(input_ids[T], position_ids[T], mask0[T, L], ...)`` -> logits ``[T, V]``."""

    def __init__(self, model: Any, scratch: SharedStaticCache) -> None:
        super().__init__()
        self.model = model
        self.scratch = scratch
        self.mask_keys: tuple[str | None, ...] | None = None
        self.cache_kwarg = cache_kwarg(model)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        mask0: torch.Tensor,
        mask1: torch.Tensor | None = None,
        mask2: torch.Tensor | None = None,
    ) -> torch.Tensor:
        assert self.mask_keys is not None
        cache = self.scratch.view(1)
        for layer in cache.layers:
            layer.cumulative_length.zero_()  # inside the graph: each replay writes from slot 0
        masks = [m[None, None] for m in (mask0, mask1, mask2)[: len(self.mask_keys)]]  # type: ignore[index]
        attention_mask = attention_mask_of(self.mask_keys, masks)
        out = self.model(
            input_ids=input_ids[None],
            position_ids=position_ids[None],
            attention_mask=attention_mask,
            **{self.cache_kwarg: cache},
            use_cache=True,
            return_dict=True,
        )
        return out.logits[0]


class PiecewisePrefill:
    """Serve transformers' prefill forward (``[B, T]`` over devgraph's shared cache) from pieces."""

    def __init__(self, model: Any, cache: SharedStaticCache, runner_factory: Any) -> None:
        self.model = model
        self.cache = cache
        self.scratch = SharedStaticCache(len(cache.base.layers), 1, cache.max_cache_len)
        self.row = PrefillRow(model, self.scratch)
        self.runner = runner_factory(self.row)
        self.log: Any = None  # a StepLog while devgraph.bisect records a generate (_steplog)

    @property
    def kind(self) -> str:
        """What serves the prompt rows: ``"pieces"`` or ``"breakable graphs"``."""
        return "pieces" if self.runner.pieces is not None else "breakable graphs"

    def fill_missing_mask(self, kwargs: dict[str, Any]) -> None:
        """Give a mask-less prefill (sdpa over an unpadded batch) its explicit causal mask, in place.

        transformers drops the mask when SDPA's ``is_causal`` can stand in for it (a host check of
        the padding, outside the graph); the model would then build it inside the pieces. The
        explicit ``[B, 1, T, max_cache_len]`` bool mask (slot ``j`` visible to token ``i`` when
        ``j <= i``: the prefill starts at slot 0) is the same attention, built here, eagerly.
        """
        ids = kwargs.get("input_ids")
        mask = kwargs.get("attention_mask")
        missing = mask is None or (isinstance(mask, dict) and any(v is None for v in mask.values()))
        if not missing or not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            return
        batch, tokens = ids.shape
        slots = torch.arange(self.cache.max_cache_len, device=ids.device)
        causal = slots[None, :] <= torch.arange(tokens, device=ids.device)[:, None]
        causal = causal[None, None].expand(batch, 1, tokens, -1)
        if mask is None:
            kwargs["attention_mask"] = causal
        else:  # a layer type whose mask was dropped for is_causal (a dict of the model's own)
            kwargs["attention_mask"] = {k: causal if v is None else v for k, v in mask.items()}

    def can_serve(self, kwargs: dict[str, Any]) -> str | None:
        """None, or why this prefill call runs eagerly."""
        ids = kwargs.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            return "the prefill has no [batch, tokens] input_ids"
        extra = sorted(
            k
            for k, v in kwargs.items()
            if k
            not in (
                "input_ids",
                "position_ids",
                "attention_mask",
                *CACHE_KEYS,
                "use_cache",
                "return_dict",
            )
            and k != "logits_to_keep"
            and v is not None
            and v is not False
        )
        if extra:
            return f"the prefill was called with {extra}, which the pieces do not take"
        structure = mask_structure(kwargs.get("attention_mask"), ids.shape[1])
        if structure is None:
            return "the prefill mask is not a 4-D tensor (or a dict of them)"
        if self.row.mask_keys is not None and structure[0] != self.row.mask_keys:
            return f"the prefill mask has layer types {structure[0]}, the captured one {self.row.mask_keys}"
        return None

    def __call__(self, kwargs: dict[str, Any]) -> Any:
        ids = kwargs["input_ids"]
        batch, tokens = ids.shape
        keys, masks = mask_structure(kwargs["attention_mask"], tokens)  # type: ignore[misc]
        self.scratch.allocate(self.model, {})
        self.row.mask_keys = keys
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = torch.arange(tokens, device=ids.device).expand(batch, tokens)
        last = []
        for r in range(batch):
            named = {f"mask{i}": m[r, 0] for i, m in enumerate(masks)}
            call = {"input_ids": ids[r], "position_ids": positions[r], **named}
            if self.log is None:
                logits = self.runner(**call)
            else:
                logits = self.log.prefill_row(self.kind, self.runner, self.scratch, r + 1, batch, call)
            last.append(logits[-1:].clone())  # a view of graph memory: the next row overwrites it
            for big, row in zip(self.cache.base.layers, self.scratch.base.layers, strict=True):
                big.keys[r, :, :tokens].copy_(row.keys[0, :, :tokens])
                big.values[r, :, :tokens].copy_(row.values[0, :, :tokens])
        for big in self.cache.base.layers:
            big.cumulative_length.fill_(tokens)  # in place: the captured decode steps hold it
        return causal_lm_output(torch.stack(last), cache_of(kwargs))
