"""The Hugging Face adapter: graphed greedy ``generate()`` gives exactly the tokens of eager ``generate()``.

Tiny random decoders are built in code (no downloads). Every comparison is against the model's own
``model.generate(do_sample=False)``.
"""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _hf_models import DIMS  # noqa: E402

import devgraph  # noqa: E402
from devgraph import DevgraphError  # noqa: E402
from devgraph.adapters.hf import GraphedCausalLM  # noqa: E402

TINY = dict(DIMS, head_dim=16, vocab_size=128)  # no special token ids: the families' own defaults
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
}
PROMPT_LEN = 7
NEW_TOKENS = 6
CACHE_LEN = 32


def tiny_model(family: str, **overrides) -> torch.nn.Module:
    config_name, model_name = FAMILIES[family]
    config = getattr(transformers, config_name)(**{**TINY, **overrides})
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config).eval()


def prompts(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, TINY["vocab_size"], (batch, PROMPT_LEN), generator=gen)
    return ids, torch.ones_like(ids)


def eager_greedy(model, ids, mask, **kwargs) -> torch.Tensor:
    return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW_TOKENS, **kwargs)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def graphed(request) -> GraphedCausalLM:
    """Each family wrapped once per module: buckets 1 and 4."""
    return devgraph.wrap(
        tiny_model(request.param), devgraph.device("cpu"), batch_sizes=[1, 4], max_cache_len=CACHE_LEN
    )


@pytest.fixture(scope="module")
def llama() -> GraphedCausalLM:
    return devgraph.wrap(tiny_model("llama"), "cpu", batch_sizes=[1, 4], max_cache_len=CACHE_LEN)


@pytest.mark.parametrize("batch", [1, 3], ids=["batch1", "batch3_padded_to_4"])
def test_graphed_generate_matches_eager_greedy(graphed, batch):
    ids, mask = prompts(batch, seed=2)  # no row of any family meets an eos token early
    replays = graphed.stats.replays
    out = graphed.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS)
    assert torch.equal(out, eager_greedy(graphed.module, ids, mask))
    assert graphed.stats.replays - replays == NEW_TOKENS - 1  # every decode step after prefill replayed
    assert graphed.stats.fallbacks == {}


def test_wrap_returns_graphed_causal_lm_for_hf_models():
    graphed = devgraph.wrap(tiny_model("llama"), "cpu", batch_sizes=[1], max_cache_len=CACHE_LEN)
    assert isinstance(graphed, GraphedCausalLM)
    assert isinstance(graphed, devgraph.GraphedModule)
    assert graphed.sizes == [1]


def test_left_padded_batch_matches_eager(llama):
    ids, mask = prompts(3, seed=2)
    mask[0, :3] = 0  # three prompt lengths in one batch: 4, 6, 7
    mask[1, :1] = 0
    ids = ids.masked_fill(mask == 0, 0)
    out = llama.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS)
    assert torch.equal(out, eager_greedy(llama.module, ids, mask))
    assert llama.stats.fallbacks == {}


def test_eos_finishes_rows_and_pads_them_like_eager(llama):
    ids, mask = prompts(3, seed=3)
    free = eager_greedy(llama.module, ids, mask)
    eos = int(free[1, PROMPT_LEN + 1])  # row 1 stops after its second token; others may run on
    expected = eager_greedy(llama.module, ids, mask, eos_token_id=eos)
    assert torch.equal(
        llama.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, eos_token_id=eos), expected
    )


def test_second_generate_reuses_the_captured_graphs(llama):
    ids, mask = prompts(1, seed=4)
    llama.generate(ids, attention_mask=mask, max_new_tokens=2)
    captured = llama.stats.capture_seconds
    ids, mask = prompts(1, seed=5)
    assert torch.equal(
        llama.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS),
        eager_greedy(llama.module, ids, mask),
    )
    assert llama.stats.capture_seconds == captured


def test_eager_attention_implementation_matches_eager():
    model = tiny_model("llama", attn_implementation="eager")
    graphed = devgraph.wrap(model, "cpu", batch_sizes=[4], max_cache_len=CACHE_LEN)
    ids, mask = prompts(3, seed=6)
    mask[2, :2] = 0
    assert torch.equal(
        graphed.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS), eager_greedy(model, ids, mask)
    )
    assert graphed.stats.replays == NEW_TOKENS - 1


def test_batch_above_largest_bucket_falls_back_with_warning_and_matches():
    model = tiny_model("llama")
    graphed = devgraph.wrap(model, "cpu", max_batch_size=2, max_cache_len=CACHE_LEN)
    ids, mask = prompts(3, seed=7)
    with pytest.warns(UserWarning, match="batch_too_large"):
        out = graphed.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS)
    assert torch.equal(out, eager_greedy(model, ids, mask))
    assert graphed.stats.fallbacks == {"batch_too_large": 1}
    assert graphed.stats.replays == 0


def test_prompt_overflowing_the_cache_falls_back_with_warning():
    model = tiny_model("llama")
    graphed = devgraph.wrap(model, "cpu", batch_sizes=[1], max_cache_len=PROMPT_LEN + 2)
    ids, mask = prompts(1, seed=8)
    with pytest.warns(UserWarning, match="max_cache_len"):
        out = graphed.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS)
    assert torch.equal(out, eager_greedy(model, ids, mask))
    assert graphed.stats.fallbacks == {"sequence_too_long": 1}


@pytest.mark.parametrize("overflow", [0, 1], ids=["fills_the_cache", "one_slot_over"])
def test_cache_length_boundary(overflow):
    # prompt + max_new_tokens - 1 slots are written (the last token is never fed back): exactly
    # max_cache_len is graphed, one more falls back.
    model = tiny_model("llama")
    ids, mask = prompts(1, seed=8)
    new = 4
    graphed = devgraph.wrap(model, "cpu", batch_sizes=[1], max_cache_len=PROMPT_LEN + new - 1 - overflow)
    call = dict(attention_mask=mask, do_sample=False, max_new_tokens=new, min_new_tokens=new)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*sequence_too_long")  # asserted on the stats below
        out = graphed.generate(ids, **call)
    assert torch.equal(out, model.generate(ids, **call))
    if overflow:
        assert graphed.stats.fallbacks == {"sequence_too_long": 1} and graphed.stats.replays == 0
    else:
        assert graphed.stats.fallbacks == {} and graphed.stats.replays == new - 1


def test_strict_raises_instead_of_falling_back():
    graphed = devgraph.wrap(
        tiny_model("llama"), "cpu", max_batch_size=1, max_cache_len=CACHE_LEN, strict=True
    )
    with pytest.raises(DevgraphError, match="strict=True"):
        graphed.generate(prompts(2, seed=9)[0], max_new_tokens=2)


def test_call_runs_the_model_eagerly():
    model = tiny_model("qwen2")
    graphed = devgraph.wrap(model, "cpu", batch_sizes=[1], max_cache_len=CACHE_LEN)
    ids, _ = prompts(2, seed=10)
    with torch.no_grad(), pytest.warns(UserWarning, match=r"forward_not_graphed.*graphed\.generate"):
        assert torch.equal(graphed(ids).logits, model(ids).logits)
    assert not graphed.runner.captured
    assert graphed.stats.fallbacks == {"forward_not_graphed": 1}


def test_unknown_option_names_the_valid_ones():
    with pytest.raises(DevgraphError, match=r"unknown option\(s\) \['pad_values'\].*max_cache_len"):
        devgraph.wrap(tiny_model("llama"), "cpu", pad_values={"x": 0})


def test_sliding_window_shorter_than_the_cache_matches_eager():
    model = tiny_model("mistral", sliding_window=4)  # the window slides during prompt and decode
    graphed = devgraph.wrap(model, "cpu", batch_sizes=[2], max_cache_len=CACHE_LEN)
    ids, mask = prompts(2, seed=11)
    assert torch.equal(
        graphed.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS), eager_greedy(model, ids, mask)
    )
    assert graphed.stats.replays == NEW_TOKENS - 1


def test_all_buckets_with_their_cache_fit_in_125_percent_of_the_largest_alone():
    def graph_and_cache_bytes(batch_sizes):
        graphed = devgraph.wrap(
            tiny_model("llama"), "cpu", batch_sizes=batch_sizes, max_cache_len=128
        ).capture()
        return graphed.stats.pool_bytes + graphed.cache.nbytes

    assert graph_and_cache_bytes([1, 2, 4, 8]) <= 1.25 * graph_and_cache_bytes([8])


def test_inputs_on_another_device_are_named():
    graphed = devgraph.wrap(tiny_model("llama"), "cpu", batch_sizes=[1], max_cache_len=16)
    ids = torch.zeros(1, 4, dtype=torch.long, device="meta")
    with pytest.raises(
        devgraph.DevgraphError, match=r"input_ids on meta.*model is on cpu.*\.to\(model\.device\)"
    ):
        graphed.generate(ids, max_new_tokens=2)


def test_a_model_in_train_mode_is_warned_about_naming_eval():
    model = tiny_model("llama").train()
    with pytest.warns(UserWarning, match=r"train mode.*model\.eval\(\)"):
        devgraph.wrap(model, "cpu", batch_sizes=[1], max_cache_len=16)


_SCALE = {"norm": 1.0}


def _scale_norm(module, args, output):
    return output * _SCALE["norm"]  # a module-level value the decode step reads at every call


def test_decode_steps_are_traced_by_dynamo_and_a_value_they_read_is_guarded():
    model = tiny_model("llama")
    model.model.norm.register_forward_hook(_scale_norm)
    graphed = devgraph.wrap(model, device="cpu", batch_sizes=[1, 2], max_cache_len=32)
    assert graphed.stats.frontend == "dynamo"
    ids, mask = prompts(2, seed=5)
    call = dict(attention_mask=mask, do_sample=False, max_new_tokens=6)
    try:
        before = model.generate(ids, **call)
        assert torch.equal(graphed.generate(ids, **call), before)
        _SCALE["norm"] = -1.0  # Dynamo's guard on the dict item fails: the step is traced again
        after = model.generate(ids, **call)
        assert not torch.equal(after, before)  # the value matters to the tokens
        assert torch.equal(graphed.generate(ids, **call), after)
    finally:
        _SCALE["norm"] = 1.0
    assert graphed.stats.recompiles >= 1 and graphed.stats.replays == 10


def test_the_raw_frontend_is_an_explicit_opt_in_that_warns():
    model = tiny_model("llama")
    with pytest.warns(UserWarning, match="frontend='raw' captures the forward as it runs, untraced"):
        graphed = devgraph.wrap(model, device="cpu", frontend="raw", max_batch_size=2, max_cache_len=32)
    assert graphed.stats.frontend == "raw"
    with pytest.raises(devgraph.DevgraphError, match="frontend must be 'dynamo'"):
        devgraph.wrap(model, device="cpu", frontend="traced")
