"""Assisted generation with an assistant model (``generate(assistant_model=...)``), both models' steps
from graphs.

The assistant is a second devgraph wrapper (``devgraph.wrap(draft)``) passed as ``assistant_model``:
its drafting steps (one token, or the two it has not seen after a verify) replay its own verify
graphs, the target's verify steps (the last token and the candidates) the target's. Every comparison
is against the model's own ``model.generate(assistant_model=draft)`` (greedy unless said, one row:
transformers' assisted generation takes one only).
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _hf_models import prompts, tiny_model  # noqa: E402
from _speculative import eager_counts  # noqa: E402

import devgraph  # noqa: E402
from devgraph import CaptureError  # noqa: E402

NEW = 20
CACHE_LEN = 64
DRAFT_TOKENS = 3


def _drafting(model, tokens: int = DRAFT_TOKENS, schedule: str = "constant"):
    """``model`` set to draft ``tokens`` candidates per step, every one (no confidence cut-off)."""
    model.generation_config.num_assistant_tokens = tokens
    model.generation_config.num_assistant_tokens_schedule = schedule
    model.generation_config.assistant_confidence_threshold = 0.0
    return model


def close_draft(target, scale: float = 0.005):
    """The target with its head's weights nudged: it agrees on some candidates, not all."""
    draft = copy.deepcopy(target)
    noise = torch.Generator().manual_seed(0)
    with torch.no_grad():
        draft.lm_head.weight.add_(torch.randn(draft.lm_head.weight.shape, generator=noise) * scale)
    return _drafting(draft)


def assisted(model, ids, assistant, **kwargs):
    args = dict(
        attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False, assistant_model=assistant
    )
    return model.generate(ids, **{**args, **kwargs})


@pytest.fixture(scope="module")
def target():
    return devgraph.wrap(tiny_model("llama"), "cpu", batch_sizes=[1], max_cache_len=CACHE_LEN)


@pytest.fixture(scope="module")
def drafts(target):
    """Two assistants, each wrapped: the target nudged (``close``) and a one-layer Llama (``small``)."""
    small = _drafting(tiny_model("llama", num_hidden_layers=1))
    return {
        name: devgraph.wrap(model, "cpu", batch_sizes=[1], max_cache_len=CACHE_LEN)
        for name, model in (("close", close_draft(target.module)), ("small", small))
    }


# nox -s tests runs one draft and seed; tests-hf-newest (slow included) runs all four
@pytest.mark.parametrize("seed", [1, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("draft", ["close", pytest.param("small", marks=pytest.mark.slow)])
def test_assisted_tokens_equal_eager_with_both_models_steps_from_graphs(target, drafts, draft, seed):
    assistant = drafts[draft]
    ids, _ = prompts(1, seed=seed, length=8)
    steps = (target.speculative_stats.graph_steps, assistant.speculative_stats.graph_steps)
    out = assisted(target, ids, assistant)
    assert torch.equal(out, assisted(target.module, ids, assistant.module))
    assert target.speculative_stats.graph_steps > steps[0]  # the target's verify steps
    assert assistant.speculative_stats.graph_steps > steps[1]  # the assistant's drafting steps
    assert target.speculative_stats.eager_steps == assistant.speculative_stats.eager_steps == 0
    assert target.stats.fallbacks == assistant.stats.fallbacks == {}
    # every count of 2..DRAFT_TOKENS + 1 tokens (and 1, once a step of one token came)
    assert target.verify_stats.captured_sizes[-DRAFT_TOKENS:] == tuple(range(2, DRAFT_TOKENS + 2))
    assert assistant.verify_stats.captured_sizes == (1, 2)
    assert "forward" not in target.module.__dict__ and "forward" not in assistant.module.__dict__


def test_acceptance_counts_equal_eager_assisted_generation(target, drafts):
    assistant = drafts["close"]
    ids, _ = prompts(1, seed=3, length=8)
    args = dict(attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
    _, steps, proposed, accepted = eager_counts(target.module, ids, assistant_model=assistant.module, **args)
    assert len(set(steps)) > 1 and 0 < accepted < proposed  # steps of several sizes, candidates both ways
    stats = target.speculative_stats
    before = (stats.steps, stats.proposed, stats.accepted, assistant.speculative_stats.drafts)
    assisted(target, ids, assistant)
    stats = target.speculative_stats
    assert stats.steps - before[0] == len(steps)
    assert (stats.proposed - before[1], stats.accepted - before[2]) == (proposed, accepted)
    assert assistant.speculative_stats.drafts == before[3] + 1
    assert assistant.speculative_stats.proposed == 0  # the assistant proposes; it is not verified


@pytest.mark.slow
def test_scores_and_logits_of_every_step_equal_eager(target, drafts):
    ids, _ = prompts(1, seed=4, length=8)
    kwargs = dict(return_dict_in_generate=True, output_scores=True, output_logits=True)
    out = assisted(target, ids, drafts["close"], **kwargs)
    ref = assisted(target.module, ids, drafts["close"].module, **kwargs)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == len(ref.scores) == NEW
    for got, want in zip(out.scores + out.logits, ref.scores + ref.logits, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_seeded_speculative_sampling_equals_eager(target, drafts):
    # Sampling with an assistant accepts each candidate by the ratio of the two models' probabilities
    # (transformers' speculative sampling): the draws follow both models' logits.
    ids, _ = prompts(1, seed=5, length=8)
    args = dict(do_sample=True, top_k=20, temperature=0.7)
    torch.manual_seed(7)
    out = assisted(target, ids, drafts["close"], **args)
    torch.manual_seed(7)
    assert torch.equal(out, assisted(target.module, ids, drafts["close"].module, **args))


@pytest.mark.slow
def test_a_heuristic_schedule_past_the_verify_graphs_runs_those_steps_eagerly_then_builds_larger():
    # The assistant is the target itself (another copy): every candidate is accepted, so the
    # "heuristic" schedule raises num_assistant_tokens by 2 after each step, past the verify graphs the
    # generate started with (2 + 1 tokens); transformers keeps the raised count for the next generate.
    model = tiny_model("llama")
    draft = _drafting(copy.deepcopy(model), tokens=2, schedule="heuristic")
    target = devgraph.wrap(model, "cpu", batch_sizes=[1], max_cache_len=CACHE_LEN)
    assistant = devgraph.wrap(draft, "cpu", batch_sizes=[1], max_cache_len=CACHE_LEN)
    ids, _ = prompts(1, seed=1, length=8)

    def both(tokens):
        draft.generation_config.num_assistant_tokens = tokens
        ref = assisted(model, ids, draft)
        draft.generation_config.num_assistant_tokens = tokens
        return assisted(target, ids, assistant), ref

    with pytest.warns(UserWarning, match="verify step of 5 tokens is above the 3"):
        out, ref = both(2)
    assert torch.equal(out, ref)
    assert target.stats.fallbacks["verify_too_long"] == target.speculative_stats.eager_steps > 0
    grown = draft.generation_config.num_assistant_tokens
    assert grown > 4
    out, ref = both(grown)
    assert torch.equal(out, ref)
    assert target.verify_stats.captured_sizes[-grown:] == tuple(range(2, grown + 2))


def test_a_plain_assistant_model_runs_the_generate_eagerly(target):
    draft = close_draft(target.module)
    ids, _ = prompts(1, seed=1, length=8)
    before = target.stats.fallbacks.get("assistant_model", 0)
    with pytest.warns(UserWarning, match="devgraph.wrap\\(assistant\\)"):
        out = assisted(target, ids, draft)
    assert torch.equal(out, assisted(target.module, ids, draft))
    assert target.stats.fallbacks["assistant_model"] == before + 1


def test_the_model_as_its_own_assistant_runs_eagerly(target):
    # One model cannot be both: its forward is the target's verify route for the call.
    own = devgraph.wrap(target.module, "cpu", batch_sizes=[1], max_cache_len=CACHE_LEN)
    ids, _ = prompts(1, seed=2, length=8)
    before = target.stats.fallbacks.get("assistant_model", 0)
    assert torch.equal(
        assisted(target, ids, own, max_new_tokens=4),
        assisted(target.module, ids, target.module, max_new_tokens=4),
    )
    assert target.stats.fallbacks["assistant_model"] == before + 1
    assert own.speculative_stats.drafts == 0


def test_an_assistant_cache_without_room_runs_the_generate_eagerly(target):
    # The assistant's steps take 2 tokens at most; prompt 8 + 20 new tokens needs 8 + 20 - 2 + 2 = 28.
    short = devgraph.wrap(close_draft(target.module), "cpu", batch_sizes=[1], max_cache_len=27)
    ids, _ = prompts(1, seed=1, length=8)
    with pytest.warns(UserWarning, match="the assistant's verify steps of up to 2 tokens, needs 28"):
        out = assisted(target, ids, short)
    assert torch.equal(out, assisted(target.module, ids, short.module))
    assert short.speculative_stats.drafts == 0


def test_an_assistant_tokenizer_runs_eagerly_and_raises_as_eager_does(target, drafts):
    # Universal assisted generation (an assistant with a tokenizer of its own) is not served; with the
    # same vocabulary transformers refuses the tokenizers, eagerly as in devgraph's fallback.
    ids, _ = prompts(1, seed=1, length=8)
    tokenizers = dict(tokenizer=object(), assistant_tokenizer=object())
    with pytest.raises(ValueError, match="assistant_tokenizer") as eager:
        assisted(target.module, ids, drafts["small"].module, **tokenizers)
    with pytest.warns(UserWarning, match="universal assisted"), pytest.raises(ValueError) as graphed:
        assisted(target, ids, drafts["small"], **tokenizers)
    assert str(graphed.value) == str(eager.value)


class _SyncsOnTwoTokens:
    """A forward pre-hook: reads a device value on the host for a call of exactly two tokens (the
    assistant's catch-up steps), never for its prefill or its one-token steps."""

    def __call__(self, module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        if hidden is not None and hidden.shape[1] == 2:
            hidden.sum().item()


def test_an_assistant_step_that_cannot_be_captured_is_refused_once_then_runs_eagerly(target):
    draft = close_draft(target.module)
    draft.model.layers[0].register_forward_pre_hook(_SyncsOnTwoTokens(), with_kwargs=True)
    with pytest.warns(UserWarning, match="frontend='raw'"):
        assistant = devgraph.wrap(draft, "cpu", batch_sizes=[1], max_cache_len=CACHE_LEN, frontend="raw")
    ids, _ = prompts(1, seed=1, length=8)
    with (
        pytest.warns(UserWarning, match="forward hooks"),
        pytest.raises(CaptureError, match="LlamaForCausalLM's verify step cannot be captured"),
    ):
        assisted(target, ids, assistant)
    assert assistant.verify_refused is not None and target.verify_refused is None
    assert "forward" not in draft.__dict__ and "forward" not in target.module.__dict__
    before = target.stats.fallbacks.get("capture_refused", 0)
    with pytest.warns(UserWarning, match="the assistant_model"):
        assert torch.equal(assisted(target, ids, assistant), assisted(target.module, ids, draft))
    assert target.stats.fallbacks["capture_refused"] == before + 1


@pytest.mark.slow
def test_the_assistant_takes_no_compiled_call_where_transformers_would_compile(target):
    # On a GPU transformers compiles a forward whose cache is static (its "auto-compile"): an assistant
    # over devgraph's static cache would take model.get_compiled_call instead of its forward. The
    # adapter passes disable_compile, which transformers reads first. Here the assistant's hardware
    # test answers as on a GPU (transformers' own order: disable_compile, then the cache's kind).
    from transformers.cache_utils import DynamicCache

    draft = close_draft(target.module)
    compiled = []

    def as_on_a_gpu(model_kwargs, generation_config):
        if generation_config.disable_compile:
            return False
        cache = model_kwargs.get("past_key_values")
        return cache is not None and cache.is_compileable and type(cache) is not DynamicCache

    assistant = devgraph.wrap(draft, "cpu", batch_sizes=[1], max_cache_len=CACHE_LEN)
    draft._valid_auto_compile_criteria = as_on_a_gpu
    draft.get_compiled_call = lambda compile_config=None: compiled.append(compile_config) or draft.__call__
    try:
        ids, _ = prompts(1, seed=2, length=8)
        steps = assistant.speculative_stats.graph_steps
        assert torch.equal(assisted(target, ids, assistant), assisted(target.module, ids, draft))
        assert compiled == [] and assistant.speculative_stats.graph_steps > steps
    finally:
        del draft._valid_auto_compile_criteria, draft.get_compiled_call
