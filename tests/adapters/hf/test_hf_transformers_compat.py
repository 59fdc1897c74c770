"""The adapter across transformers releases: the cache argument's name (``past_key_values`` until 5.23,
``cache`` from 5.24) and a generation loop that stops calling devgraph's hook, counted and warned
instead of running eagerly unseen. ``nox -s tests-hf-newest`` runs the HF tests on the newest release.
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("transformers")

from _hf_models import prompts, tiny_model

import devgraph


@pytest.mark.parametrize("mode", ["full", "piecewise"])
def test_steps_replay_without_deprecated_cache_arguments(mode):
    # transformers 5.24 renamed past_key_values to cache: a route reading the old name saw no cache,
    # took every step for a foreign prefill and ran it eagerly, with no count and no warning.
    model = tiny_model("llama")
    graphed = devgraph.wrap(model, "cpu", batch_sizes=[2], max_cache_len=16, mode=mode)
    ids, mask = prompts(2, seed=8)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*past_key_values.*deprecated")
        out = graphed.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4)
    assert torch.equal(out, model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4))
    assert graphed.stats.replays == 3 and graphed.stats.fallbacks == {}
    if mode == "piecewise":
        assert graphed.prefill_stats.replays == 2 and graphed.prefill_stats.fallbacks == {}


@pytest.mark.parametrize("mode", ["full", "piecewise"])
def test_a_loop_that_never_calls_the_hook_is_counted_and_warned(mode):
    model = tiny_model("llama")
    graphed = devgraph.wrap(model, "cpu", batch_sizes=[2], max_cache_len=16, mode=mode)
    model.get_compiled_call = lambda config: model.__call__  # a release whose loop bypasses the hook
    ids, mask = prompts(2, seed=9)
    with pytest.warns(UserWarning) as caught:
        out = graphed.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4)
    assert any(
        "decode_hook_not_reached" in str(w.message) and "get_compiled_call" in str(w.message) for w in caught
    )
    del model.get_compiled_call
    assert torch.equal(out, model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4))
    expected = {"decode_hook_not_reached": 1}
    if mode == "piecewise":
        expected["prefill_hook_not_reached"] = 1
    assert graphed.stats.fallbacks == expected and graphed.stats.replays == 0


def test_a_loop_that_never_calls_the_hook_raises_when_strict():
    model = tiny_model("llama")
    graphed = devgraph.wrap(model, "cpu", batch_sizes=[2], max_cache_len=16, strict=True)
    model.get_compiled_call = lambda config: model.__call__
    ids, mask = prompts(2, seed=9)
    with pytest.raises(devgraph.DevgraphError, match=r"get_compiled_call"):
        graphed.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4)
