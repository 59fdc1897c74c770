"""Graphed ``generate()`` equals eager ``model.generate()`` on every causal-LM architecture transformers
builds from a config in seconds: dense, mixture-of-experts, sliding-window and mixed layer types.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from _hf_models import ARCHITECTURES, REFUSED, full_length_static_cache, prompts, tiny_model

import devgraph
from devgraph.adapters.hf._compat import cache_kwarg

NEW_TOKENS = 6


#: Architectures every test here runs by default (mixture-of-experts, latent attention, sliding and
#: soft-capped layers, OPT, the shadowed decode hook); the rest are marked slow: ``nox -s
#: tests-hf-newest`` runs every architecture, on the transformers release users get (``nox -s tests``
#: runs these on the pinned one).
_DEFAULT = {
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "deepseek_v3",
    "gemma3_text",
    "qwen2_mixed_sliding",
    "opt",
    "llama",
}
_SOME_SLOW = [n if n in _DEFAULT else pytest.param(n, marks=pytest.mark.slow) for n in sorted(ARCHITECTURES)]
#: The piecewise and bf16 tests' default architectures: mixture-of-experts with latent attention, sliding
#: layers, the plain case (each architecture is a trace and captures of every prefill size)
_PIECEWISE_DEFAULT = {"mixtral", "deepseek_v3", "gemma3_text", "llama"}
_MOSTLY_SLOW = [
    n if n in _PIECEWISE_DEFAULT else pytest.param(n, marks=pytest.mark.slow) for n in sorted(ARCHITECTURES)
]


@pytest.mark.parametrize("name", _SOME_SLOW)
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


@pytest.mark.parametrize("name", _MOSTLY_SLOW)
def test_piecewise_prefill_matches_eager_on_architecture(name):
    # Mixture-of-experts layers once replayed the routing of capture time here (logits 0.01-0.1 off).
    model = tiny_model(name)
    graphed = devgraph.wrap(model, "cpu", batch_sizes=[1, 4], max_cache_len=16, mode="piecewise")
    ids, mask = prompts(1, seed=5, length=9)
    call = dict(do_sample=False, max_new_tokens=3, output_logits=True, return_dict_in_generate=True)
    out = graphed.generate(ids, attention_mask=mask, **call)
    expected = model.generate(ids, attention_mask=mask, **call)
    assert torch.equal(out.sequences, expected.sequences)
    for step, (got, want) in enumerate(zip(out.logits, expected.logits)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=lambda m, s=step: f"step {s}: {m}")
    steps = len(out.logits) - 1  # decode steps (fewer than 2 where the greedy call ends on the end token)
    # Seeded sampling, a left-padded batch of 3 in the bucket of 4.
    ids, mask = prompts(3, seed=6, length=6)
    mask[0, :2] = 0
    sample = dict(attention_mask=mask, do_sample=True, top_k=0, max_new_tokens=4)
    torch.manual_seed(7)
    out = graphed.generate(ids, **sample)
    torch.manual_seed(7)
    assert torch.equal(out, model.generate(ids, **sample))
    steps += out.shape[1] - ids.shape[1] - 1
    assert graphed.prefill_stats.replays == 1 + 3 and graphed.stats.replays == steps
    assert graphed.stats.fallbacks == {} and graphed.prefill_stats.fallbacks == {}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_architecture_the_decode_step_cannot_serve_is_refused_at_wrap(name):
    # Bloom was accepted, then every decode step fell back (mask_structure) with no fix named.
    with pytest.raises(devgraph.DevgraphError, match=r"ALiBi.*eager model\.generate"):
        devgraph.wrap(tiny_model(name), "cpu")


@pytest.mark.parametrize("name", _MOSTLY_SLOW)
def test_bf16_logits_are_bitwise_those_of_eager_over_the_same_cache_on_architecture(name):
    # The same cache: full-length static layers. For sliding-window layers transformers' own static
    # cache keeps a window-length rolling layer, whose attention sums in another order (README).
    model = tiny_model(name, dtype=torch.bfloat16)
    graphed = devgraph.wrap(model, "cpu", batch_sizes=[1, 4], max_cache_len=24)
    ids, mask = prompts(3, seed=15)
    mask[0, :2] = 0
    call = dict(attention_mask=mask, do_sample=False, max_new_tokens=8, return_dict_in_generate=True)
    out = graphed.generate(ids, output_logits=True, **call)
    cache = {cache_kwarg(model): full_length_static_cache(model, 24)}
    expected = model.generate(ids, output_logits=True, **cache, **call)
    assert torch.equal(out.sequences, expected.sequences)
    assert all(torch.equal(got, want) for got, want in zip(out.logits, expected.logits, strict=True))
    assert graphed.stats.replays == 7 and graphed.stats.fallbacks == {}
