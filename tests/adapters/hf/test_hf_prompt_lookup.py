"""Prompt-lookup decoding (``generate(prompt_lookup_num_tokens=k)``) with its verify steps from graphs.

transformers' assisted loop calls the model itself for each verify step (the last token and up to
``k`` candidates from an n-gram match); devgraph serves those of 2..k+1 tokens from one graph per
token count (1..k+1). Every comparison is against the model's
own ``model.generate`` with the same arguments (greedy unless said, one row: transformers' assisted
generation takes one only).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _hf_models import tiny_model  # noqa: E402
from _speculative import eager_counts, repeating  # noqa: E402

import devgraph  # noqa: E402
from devgraph import CaptureError  # noqa: E402

K = 3
NEW = 20
CACHE_LEN = 64


def lookup(model, ids, **kwargs):
    args = dict(
        attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False, prompt_lookup_num_tokens=K
    )
    return model.generate(ids, **{**args, **kwargs})


@pytest.fixture(scope="module")
def llama():
    return devgraph.wrap(tiny_model("llama"), "cpu", batch_sizes=[1, 2], max_cache_len=CACHE_LEN)


# nox -s tests runs one prompt; tests-hf-newest (slow included) runs all three
@pytest.mark.parametrize("seed", [1, *(pytest.param(s, marks=pytest.mark.slow) for s in (2, 3))])
def test_prompt_lookup_tokens_equal_eager_with_verify_steps_from_graphs(llama, seed):
    ids = repeating(seed)
    before = (llama.speculative_stats.graph_steps, llama.verify_stats.replays if llama.verify_stats else 0)
    out = lookup(llama, ids)
    assert torch.equal(out, lookup(llama.module, ids))
    assert llama.stats.fallbacks == {}
    assert llama.verify_stats.replays > before[1]  # steps of 1..K+1 tokens replayed the verify graphs
    assert llama.speculative_stats.graph_steps > before[0]
    assert llama.speculative_stats.eager_steps == 0
    assert llama.verify_stats.captured_sizes == tuple(range(1, K + 2))
    assert "forward" not in llama.module.__dict__  # the instance's forward is put back


def test_acceptance_counts_equal_eager_prompt_lookups(llama):
    ids = repeating(4)
    args = dict(
        attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False, prompt_lookup_num_tokens=K
    )
    _, steps, proposed, accepted = eager_counts(llama.module, ids, **args)
    assert any(t > 1 for t in steps) and 0 < accepted < proposed  # candidates, some accepted, some not
    before = llama.speculative_stats
    before = (before.steps, before.proposed, before.accepted)
    lookup(llama, ids)
    stats = llama.speculative_stats
    assert stats.steps - before[0] == len(steps)
    assert (stats.proposed - before[1], stats.accepted - before[2]) == (proposed, accepted)
    assert stats.acceptance == stats.accepted / stats.proposed


@pytest.mark.slow
def test_scores_and_logits_of_every_step_equal_eager(llama):
    # The verify graphs' output memory is overwritten by the next replay: the loop keeps each step's
    # logits (scores), so the route hands it copies.
    ids = repeating(8)  # verify steps of 2, 3 and 4 tokens, candidates accepted and rejected
    kwargs = dict(return_dict_in_generate=True, output_scores=True, output_logits=True)
    out, ref = lookup(llama, ids, **kwargs), lookup(llama.module, ids, **kwargs)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == len(ref.scores) == NEW
    assert llama.stats.fallbacks == {}
    for got, want in zip(out.scores + out.logits, ref.scores + ref.logits, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_seeded_sampling_equals_eager_sampling(llama):
    ids = repeating(6)
    args = dict(do_sample=True, top_k=20, temperature=0.7)
    torch.manual_seed(11)
    out = lookup(llama, ids, **args)
    torch.manual_seed(11)
    assert torch.equal(out, lookup(llama.module, ids, **args))


@pytest.mark.slow
def test_more_candidates_build_verify_graphs_up_to_the_new_count(llama):
    ids = repeating(7)
    lookup(llama, ids)  # the verify graphs of up to K + 1 tokens (built here when this test runs first)
    out = lookup(llama, ids, prompt_lookup_num_tokens=K + 2)
    assert torch.equal(out, lookup(llama.module, ids, prompt_lookup_num_tokens=K + 2))
    assert llama.verify_stats.captured_sizes == tuple(range(1, K + 4))
    assert llama.stats.fallbacks == {}
    assert llama.speculative_stats.eager_steps == 0


def test_a_sequence_without_room_for_the_largest_verify_step_runs_eagerly():
    # A verify step starts at slot prompt + new - 2 at the latest, and the capture at the first one
    # writes k + 1 slots from there: prompt 12 + 20 new tokens with k = 3 needs 12 + 20 - 2 + 4 = 34.
    ids = repeating(1)
    graphed = devgraph.wrap(tiny_model("llama"), "cpu", batch_sizes=[1], max_cache_len=34)
    assert torch.equal(lookup(graphed, ids), lookup(graphed.module, ids))
    assert graphed.stats.fallbacks == {} and graphed.speculative_stats.graph_steps > 0
    short = devgraph.wrap(tiny_model("llama"), "cpu", batch_sizes=[1], max_cache_len=33)
    with pytest.warns(UserWarning, match="assisted generation.*up to 4 tokens, needs 34 KV-cache slots"):
        assert torch.equal(lookup(short, ids), lookup(short.module, ids))
    assert short.stats.fallbacks == {"sequence_too_long": 1}


@pytest.mark.slow
def test_mixed_sliding_and_full_layers_equal_eager():
    graphed = devgraph.wrap(
        tiny_model("qwen2_mixed_sliding"), "cpu", batch_sizes=[1], max_cache_len=CACHE_LEN
    )
    for seed in (2, 3):  # both with verify steps of several tokens
        ids = repeating(seed)
        assert torch.equal(lookup(graphed, ids), lookup(graphed.module, ids))
    assert graphed.stats.fallbacks == {} and graphed.verify_stats.replays > 0


def test_a_batch_of_two_raises_as_eager_does_and_puts_the_forward_back(llama):
    ids = torch.cat([repeating(1), repeating(2)])
    with pytest.raises(ValueError, match="batch_size = 1") as eager:
        lookup(llama.module, ids)
    with pytest.raises(ValueError, match="batch_size = 1") as graphed:
        lookup(llama, ids)
    assert str(graphed.value) == str(eager.value)
    assert "forward" not in llama.module.__dict__
    assert torch.equal(lookup(llama, repeating(1)), lookup(llama.module, repeating(1)))


@pytest.mark.slow
def test_raw_frontend_serves_verify_steps_too():
    with pytest.warns(UserWarning, match="frontend='raw'"):
        graphed = devgraph.wrap(
            tiny_model("llama"), "cpu", batch_sizes=[1], max_cache_len=CACHE_LEN, frontend="raw"
        )
    ids = repeating(2)
    assert torch.equal(lookup(graphed, ids), lookup(graphed.module, ids))
    assert graphed.verify_stats.frontend == "raw" and graphed.verify_stats.replays > 0
    assert graphed.stats.fallbacks == {}


class _SyncsOnSeveralTokens(torch.nn.Module):
    """A forward pre-hook's body: reads a device value on the host when a call has several tokens
    (eager prefill and verify steps), never for one token (decode steps)."""

    def __call__(self, module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        if hidden is not None and hidden.shape[1] > 1:
            hidden.sum().item()


def test_a_verify_step_that_cannot_be_captured_is_refused_once_then_runs_eagerly():
    model = tiny_model("llama")
    model.model.layers[0].register_forward_pre_hook(_SyncsOnSeveralTokens(), with_kwargs=True)
    with pytest.warns(UserWarning, match="frontend='raw'"):
        graphed = devgraph.wrap(model, "cpu", batch_sizes=[1], max_cache_len=CACHE_LEN, frontend="raw")
    ids = repeating(1)
    with (
        pytest.warns(UserWarning, match="forward hooks"),
        pytest.raises(CaptureError, match="verify step cannot be captured"),
    ):
        lookup(graphed, ids)
    assert "forward" not in model.__dict__
    with pytest.warns(UserWarning, match="capture_refused|cannot be captured"):
        assert torch.equal(lookup(graphed, ids), lookup(model, ids))
    assert graphed.stats.fallbacks == {"capture_refused": 1}
    plain = dict(attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    replays = graphed.stats.replays
    with pytest.warns(UserWarning, match="forward hooks"):  # the decode graphs' capture says it too
        assert torch.equal(graphed.generate(ids, **plain), model.generate(ids, **plain))
    assert graphed.stats.replays == replays + 3  # greedy generates still decode from graphs
    assert graphed.stats.fallbacks == {"capture_refused": 1}
