"""Helpers of the assisted-generation tests (prompt lookup, an assistant model): prompts that repeat
themselves, and what eager ``generate`` does step by step, read without changing it."""

from __future__ import annotations

from typing import Any

import torch
from _hf_models import prompts


def repeating(seed: int) -> torch.Tensor:
    """A one-row prompt that repeats itself, so that prompt lookup finds n-grams to propose."""
    ids, _ = prompts(1, seed=seed, length=5)
    return torch.cat([ids, ids, ids[:, :2]], dim=1)


def eager_counts(model: Any, ids: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, list[int], int, int]:
    """Eager assisted ``model.generate(ids, **kwargs)``: ``(tokens, the token counts of the target's forwards
    after its first, candidates proposed, candidates accepted)``, read from a dynamic cache that records its
    rollbacks and from the forward's token counts (an instance attribute for the call, removed after)."""
    from transformers.cache_utils import DynamicCache

    from devgraph.adapters.hf._compat import cache_kwarg  # past_key_values, or cache from transformers 5.24

    rolled_back = []

    class Recorded(DynamicCache):
        def crop(self, tokens_to_remove):
            rolled_back.append(-tokens_to_remove)
            super().crop(tokens_to_remove)

    tokens = []
    forward = model.forward

    def counting(**call):
        tokens.append(call["input_ids"].shape[1])
        return forward(**call)

    model.forward = counting
    try:
        out = model.generate(ids, **{cache_kwarg(model): Recorded(config=model.config)}, **kwargs)
    finally:
        del model.forward
    proposed = tokens[0] - ids.shape[1] + sum(t - 1 for t in tokens[1:])
    return out, tokens[1:], proposed, proposed - sum(rolled_back)
