"""``mode="breakable"``/``"full_and_breakable"`` for Hugging Face models: the prompt is prefilled from
breakable graphs cut at attention (no trace), each decode step replays a full graph; greedy tokens
equal eager ``model.generate``, dense and mixture-of-experts, at, below and between capture sizes.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from _hf_models import prompts, tiny_model

import devgraph
from devgraph import DevgraphError

NEW = 5


@pytest.mark.parametrize("name", ["llama", "qwen3", "mixtral", "qwen2_moe", "qwen2_mixed_sliding"])
def test_breakable_prefill_greedy_matches_eager(name):
    model = tiny_model(name)
    graphed = devgraph.wrap(model, "cpu", batch_sizes=[1, 4], max_cache_len=32, mode="breakable")
    for length in (16, 7, 21):  # a capture size, padded up, between sizes
        ids, mask = prompts(3, seed=length, length=length)
        mask[0, :2] = 0  # a left-padded row
        before = graphed.prefill_stats.replays
        out = graphed.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW)
        assert torch.equal(out, model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW))
        assert graphed.prefill_stats.replays - before == 3  # one breakable replay per prompt row
    stats = graphed.prefill_stats
    assert stats.fallbacks == {} and graphed.stats.fallbacks == {}
    layers = model.config.num_hidden_layers
    assert stats.breaks == layers and stats.graphs == len(stats.captured_sizes) * (layers + 1)


def test_full_and_breakable_is_accepted_and_compile_options_are_refused():
    model = tiny_model("llama")
    graphed = devgraph.wrap(model, "cpu", batch_sizes=[2], max_cache_len=32, mode="full_and_breakable")
    ids, mask = prompts(2, seed=3, length=9)
    out = graphed.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW)
    assert torch.equal(out, model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW))
    assert graphed.prefill_stats.replays == 2 and graphed.stats.replays == NEW - 1
    with pytest.raises(DevgraphError, match=r"capture_sizes.*mode='piecewise'"):
        devgraph.wrap(model, "cpu", capture_sizes=[16], mode="breakable")
