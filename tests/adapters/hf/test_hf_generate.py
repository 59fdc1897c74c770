"""Graphed ``generate()`` is transformers' own ``generate()``: same arguments, same tokens, same options.

Every comparison is against the model's own ``model.generate`` with the same arguments (and the same
seed when sampling).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _hf_models import prompts, tiny_model  # noqa: E402

import devgraph  # noqa: E402

NEW = 6
CACHE_LEN = 32


@pytest.fixture(scope="module")
def llama():
    return devgraph.wrap(tiny_model("llama"), "cpu", batch_sizes=[1, 4], max_cache_len=CACHE_LEN)


def both(graphed, seed=None, **kwargs):
    """``(graphed.generate(**kwargs), model.generate(**kwargs))``, each after ``manual_seed(seed)``."""
    if seed is not None:
        torch.manual_seed(seed)
    out = graphed.generate(**kwargs)
    if seed is not None:
        torch.manual_seed(seed)
    return out, graphed.module.generate(**kwargs)


def greedy(ids, mask, **more):
    """``generate``'s keywords for ``NEW`` greedy tokens after the prompts ``ids`` (``mask``), and ``more``."""
    return dict(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, **more)


def replays_during(graphed, fn):
    before = graphed.stats.replays
    result = fn()
    return result, graphed.stats.replays - before


def test_generate_accepts_do_sample_false(llama):
    ids, mask = prompts(2, seed=1)
    ((out, ref),) = [both(llama, **greedy(ids, mask))]
    assert torch.equal(out, ref)


def test_positional_inputs_like_model_generate(llama):
    ids, _ = prompts(1, seed=2)
    out, replays = replays_during(
        llama, lambda: llama.generate(ids, None, max_new_tokens=NEW, do_sample=False)
    )
    assert torch.equal(out, llama.module.generate(ids, None, max_new_tokens=NEW, do_sample=False))
    assert replays == NEW - 1


def test_sampling_with_a_seed_matches_eager_sampling(llama):
    ids, mask = prompts(3, seed=3)
    args = dict(input_ids=ids, attention_mask=mask, do_sample=True, top_k=20, top_p=0.9, temperature=1.3)
    (out, ref), replays = replays_during(llama, lambda: both(llama, seed=7, max_new_tokens=NEW, **args))
    assert torch.equal(out, ref)
    greedy = llama.module.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW)
    assert not torch.equal(out, greedy)  # it really sampled
    assert replays == NEW - 1


def test_sampling_set_in_the_models_generation_config_is_honoured():
    model = tiny_model("llama")
    model.generation_config.do_sample = True
    model.generation_config.top_k = 0
    graphed = devgraph.wrap(model, "cpu", batch_sizes=[4], max_cache_len=CACHE_LEN)
    ids, mask = prompts(4, seed=4)
    out, ref = both(graphed, seed=11, input_ids=ids, attention_mask=mask, max_new_tokens=NEW)
    assert torch.equal(out, ref)
    assert not torch.equal(out, model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW))
    assert graphed.stats.replays == NEW - 1 and graphed.stats.fallbacks == {}


def test_num_return_sequences_samples_each_copy_like_eager(llama):
    ids, mask = prompts(2, seed=5)
    out, ref = both(
        llama,
        seed=3,
        input_ids=ids,
        attention_mask=mask,
        do_sample=True,
        num_return_sequences=2,
        max_new_tokens=NEW,
    )
    assert out.shape[0] == 4
    assert torch.equal(out, ref)


def test_streamer_receives_the_same_tokens(llama):
    class Collect(transformers.generation.streamers.BaseStreamer):
        def __init__(self):
            self.chunks = []

        def put(self, value):
            self.chunks.append(value.tolist())

        def end(self):
            self.chunks.append("end")

    ids, mask = prompts(1, seed=6)
    graphed_stream, eager_stream = Collect(), Collect()
    llama.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, streamer=graphed_stream)
    llama.module.generate(
        ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, streamer=eager_stream
    )
    assert graphed_stream.chunks == eager_stream.chunks
    assert len(graphed_stream.chunks) == NEW + 2  # the prompt, each new token, end


def test_logits_processors_from_generation_options_match_eager(llama):
    ids, mask = prompts(2, seed=7)
    options = dict(repetition_penalty=1.5, no_repeat_ngram_size=2, suppress_tokens=[5, 6], min_new_tokens=3)
    (out, ref), replays = replays_during(
        llama,
        lambda: both(llama, **greedy(ids, mask, **options)),
    )
    assert torch.equal(out, ref)
    assert replays == NEW - 1


def test_generation_config_object_is_honoured(llama):
    ids, mask = prompts(1, seed=8)
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=4, repetition_penalty=2.0)
    out, ref = both(llama, input_ids=ids, attention_mask=mask, generation_config=config)
    assert torch.equal(out, ref)
    assert out.shape[1] == ids.shape[1] + 4


def test_custom_stopping_criteria_stop_like_eager(llama):
    class StopAtLength(transformers.StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= 10, dtype=torch.bool)

    ids, mask = prompts(1, seed=9)
    criteria = transformers.StoppingCriteriaList([StopAtLength()])
    out, ref = both(llama, **greedy(ids, mask, stopping_criteria=criteria))
    assert torch.equal(out, ref)
    assert out.shape[1] == 10


def test_scores_and_logits_in_return_dict_match_eager(llama):
    ids, mask = prompts(2, seed=10)
    out, ref = both(llama, **greedy(ids, mask, return_dict_in_generate=True, output_logits=True))
    assert torch.equal(out.sequences, ref.sequences)
    for got, want in zip(out.logits, ref.logits, strict=True):
        torch.testing.assert_close(got, want)


def test_beam_search_runs_eagerly_with_a_warning_naming_num_beams():
    model = tiny_model("llama")
    graphed = devgraph.wrap(model, "cpu", batch_sizes=[2], max_cache_len=CACHE_LEN)
    ids, mask = prompts(1, seed=11)
    with pytest.warns(UserWarning, match="num_beams=2"):
        out = graphed.generate(ids, attention_mask=mask, num_beams=2, do_sample=False, max_new_tokens=NEW)
    assert torch.equal(
        out, model.generate(ids, attention_mask=mask, num_beams=2, do_sample=False, max_new_tokens=NEW)
    )
    assert graphed.stats.fallbacks == {"beam_search": 1}
    assert graphed.stats.replays == 0


def test_output_hidden_states_runs_eagerly_with_a_warning():
    model = tiny_model("llama")
    graphed = devgraph.wrap(model, "cpu", batch_sizes=[1], max_cache_len=CACHE_LEN)
    ids, mask = prompts(1, seed=12)
    kwargs = dict(
        attention_mask=mask, max_new_tokens=3, return_dict_in_generate=True, output_hidden_states=True
    )
    with pytest.warns(UserWarning, match="output_hidden_states"):
        out = graphed.generate(ids, **kwargs)
    assert len(out.hidden_states) == 3
    assert graphed.stats.fallbacks == {"output_attentions": 1}


def test_generate_leaves_the_models_compiled_call_alone(llama):
    model = llama.module
    assert "_compiled_call" not in vars(model)
    llama.generate(prompts(1, seed=13)[0], do_sample=False, max_new_tokens=3)
    assert "_compiled_call" not in vars(model) and "_last_compile_config" not in vars(model)


def test_fp16_greedy_matches_eager():
    model = tiny_model("llama", dtype=torch.float16)
    graphed = devgraph.wrap(model, "cpu", batch_sizes=[4], max_cache_len=CACHE_LEN)
    ids, mask = prompts(4, seed=14)
    mask[1, :3] = 0
    out, ref = both(graphed, **greedy(ids, mask))
    assert torch.equal(out, ref)
    assert graphed.stats.replays == NEW - 1


def test_bf16_logits_are_bitwise_those_of_eager_generate_with_a_static_cache():
    model = tiny_model("llama", dtype=torch.bfloat16)
    graphed = devgraph.wrap(model, "cpu", batch_sizes=[4], max_cache_len=64)
    ids, mask = prompts(3, seed=15)
    mask[0, :2] = 0
    common = dict(
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=24,
        return_dict_in_generate=True,
        output_logits=True,
    )
    out = graphed.generate(ids, **common)
    ref = model.generate(ids, cache_implementation="static", max_cache_len=64, **common)
    assert torch.equal(out.sequences, ref.sequences)
    assert all(torch.equal(got, want) for got, want in zip(out.logits, ref.logits, strict=True))
    assert graphed.stats.replays == 23
