"""Graphed ``generate()`` equals eager ``model.generate()`` on every causal-LM architecture transformers
builds from a config in seconds: dense, mixture-of-experts, sliding-window and mixed layer types.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from _hf_models import ARCHITECTURES, prompts, tiny_model

import devgraph

NEW_TOKENS = 6


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_greedy_generate_matches_eager_on_architecture(name):
    model = tiny_model(name)
    graphed = devgraph.wrap(model, "cpu", batch_sizes=[1, 4], max_cache_len=32)
    ids, mask = prompts(3, seed=2)
    mask[0, :2] = 0  # a left-padded row
    out = graphed.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW_TOKENS)
    expected = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW_TOKENS)
    assert torch.equal(out, expected)
    assert graphed.stats.replays == out.shape[1] - ids.shape[1] - 1  # every decode step replayed
    assert graphed.stats.fallbacks == {}
