"""A model whose attention depends on the static cache's length is refused at wrap, in every mode.

GPT-Neo's local attention slices its window from a mask by the number of cached keys: over devgraph's
static cache of ``max_cache_len`` slots its logits were 0.1-0.4 off, silently, in every mode. The
wrap-time check runs the model over a static and a dynamic cache and compares; architectures that
compute the same there (Llama, Qwen3, and GPT-Neo whose window covers the whole cache) pass. A model
the check cannot run as it runs others (GPT-1 keeps no KV cache, CPM-Ant's forward fails over a static
cache) is refused by name, by mechanism: any exception or missing cache in the check.
"""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("transformers")

from _hf_models import CHECK_FAILS, full_length_static_cache, prompts, tiny_model

import devgraph
from devgraph.adapters.hf._static_check import check_static_cache

MODES = ["full", "piecewise", "full_and_piecewise", "breakable", "full_and_breakable"]


@pytest.mark.parametrize("mode", MODES)
def test_gpt_neo_is_refused_at_wrap_in_every_mode(mode):
    with pytest.raises(devgraph.DevgraphError) as info:
        devgraph.wrap(tiny_model("gpt_neo"), "cpu", mode=mode, max_cache_len=32)
    message = str(info.value)
    assert message.startswith("GPTNeoForCausalLM computes other logits over a static KV cache")
    assert "max_cache_len=32" in message and "_can_compile_fullgraph = False" in message
    assert "use eager model.generate()" in message


def test_gpt_neo_is_refused_in_bfloat16_too():
    with pytest.raises(devgraph.DevgraphError, match="other logits over a static KV cache"):
        devgraph.wrap(tiny_model("gpt_neo", dtype=torch.bfloat16), "cpu", max_cache_len=32)


def test_gpt_neo_whose_window_covers_the_cache_is_served_and_equals_eager():
    # The window then holds every slot, wherever the cache's end is: the check compares, it does not
    # refuse by class.
    model = tiny_model("gpt_neo", window_size=64)
    graphed = devgraph.wrap(model, "cpu", batch_sizes=[1, 2], max_cache_len=32)
    ids, mask = prompts(2, seed=3)
    call = dict(
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=5,
        output_logits=True,
        return_dict_in_generate=True,
    )
    out, expected = graphed.generate(ids, **call), model.generate(ids, **call)
    assert torch.equal(out.sequences, expected.sequences)
    for got, want in zip(out.logits, expected.logits):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert graphed.stats.replays == 4 and graphed.stats.fallbacks == {}


@pytest.mark.parametrize("name", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_architectures_that_read_only_the_tokens_written_pass_the_check(name, dtype):
    model = tiny_model(name, dtype=dtype)
    check_static_cache(model, model.config.num_hidden_layers, 32)
    check_static_cache(model, model.config.num_hidden_layers, 256)


def test_the_check_refuses_any_model_whose_logits_read_the_cache_kind():
    # Any dependence on the cache is found, not GPT-Neo's alone: a Llama whose final norm is scaled
    # when its cache is a static one.
    from transformers.cache_utils import StaticLayer

    model = tiny_model("llama")
    static = []

    def note_the_cache(module, args, kwargs):
        # the cache argument: past_key_values (transformers 5.23), cache (5.24)
        layers = [getattr(v, "layers", ()) for v in kwargs.values()]
        static[:] = [any(isinstance(layer, StaticLayer) for group in layers for layer in group)]

    model.model.register_forward_pre_hook(note_the_cache, with_kwargs=True)
    model.model.norm.register_forward_hook(lambda module, args, out: out * 1.5 if static[0] else out)
    with pytest.raises(devgraph.DevgraphError, match="LlamaForCausalLM computes other logits") as info:
        check_static_cache(model, model.config.num_hidden_layers, 32)
    assert "-token prompt (rounding in float32 stays below 0.001)" in str(info.value)
    assert "_can_compile_fullgraph" not in str(info.value)  # Llama is marked compilable


@pytest.mark.parametrize("name", sorted(CHECK_FAILS))
def test_a_model_the_check_cannot_run_is_refused_by_name_and_eager_generate_runs_it(name):
    # GPT-1 crashed wrap with AttributeError ('CausalLMOutput' object has no attribute ...), CPM-Ant with
    # a raw size mismatch.
    model = tiny_model(name)
    with pytest.raises(devgraph.DevgraphError) as info:
        devgraph.wrap(model, "cpu", max_cache_len=32)
    message = str(info.value)
    assert message.startswith(type(model).__name__) and " at wrap" in message
    assert "model.generate() runs it eagerly" in message and "none serves this model" in message
    ids, mask = prompts(2, seed=0)
    out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4)
    assert out.shape == (2, ids.shape[1] + 4)


def test_a_model_without_a_kv_cache_is_refused_saying_so():
    with pytest.raises(devgraph.DevgraphError) as info:
        devgraph.wrap(tiny_model("openai_gpt"), "cpu")
    message = str(info.value)
    assert "OpenAIGPTLMHeadModel returned no KV cache from a forward with use_cache=True" in message
    # transformers 5.23 names the output's cache past_key_values, 5.24 cache: the message names the one
    # this release uses
    assert re.search(r"\(CausalLMOutput has no (past_key_values|cache)\b", message), message


def test_a_forward_failing_over_the_static_cache_is_refused_naming_the_exception_and_line():
    with pytest.raises(devgraph.DevgraphError) as info:
        devgraph.wrap(tiny_model("cpmant"), "cpu")
    message = str(info.value)
    assert "a 3-token prompt over a static cache raised RuntimeError: The size of tensor a" in message
    assert "(at modeling_cpmant.py:" in message


def test_any_exception_in_the_check_becomes_a_named_refusal():
    # By mechanism, not by model: a Llama whose decode steps over a static cache raise.
    from transformers.cache_utils import StaticLayer

    model = tiny_model("llama")

    def fail_over_a_static_cache(module, args, kwargs):
        layers = [getattr(v, "layers", ()) for v in kwargs.values()]
        if kwargs["input_ids"].shape[1] == 1 and any(isinstance(x, StaticLayer) for g in layers for x in g):
            raise KeyError("no static decode here")

    model.model.register_forward_pre_hook(fail_over_a_static_cache, with_kwargs=True)
    with pytest.raises(devgraph.DevgraphError) as info:
        devgraph.wrap(model, "cpu", max_cache_len=32)
    message = str(info.value)
    assert (
        "decode step 1 after a 3-token prompt over a static cache raised KeyError: 'no static decode here'"
        in message
    )
    assert "test_hf_static_cache.py:" in message and "model.generate() runs it eagerly" in message
    assert isinstance(info.value.__cause__, KeyError)


@pytest.mark.parametrize("name", ["llama", "minicpm3"])
def test_bf16_gap_to_the_dynamic_cache_is_about_two_units_of_the_largest_logit_at_most(name):
    # MiniCPM3's bf16 logits were 0.09 from eager's over the dynamic cache, "more than the last bits":
    # its logits are about ten times larger; in units of the largest logit's last place the gap is
    # the others' (docs/huggingface.md, Equality; benchmarks/hf_static_cache_gap.py measures it).
    import math

    from transformers import DynamicCache

    from devgraph.adapters.hf._compat import cache_kwarg
    from devgraph.adapters.hf._static_check import _compare, _Run

    model = tiny_model(name, dtype=torch.bfloat16)
    with torch.no_grad():
        relative, where = _compare(model, model.config.num_hidden_layers, 32, 24, _Run())
    assert relative <= 5e-2, where  # wrap's bound in 16-bit types
    ids, _ = prompts(2, seed=4, length=8)
    kwarg = cache_kwarg(model)
    static, dynamic = full_length_static_cache(model, 40), DynamicCache(config=model.config)
    gaps, largest = [], 0.0
    with torch.no_grad():
        for _ in range(12):  # the prompt, then decode steps fed eager's greedy tokens
            got = model(input_ids=ids, use_cache=True, **{kwarg: static}).logits.float()
            want = model(input_ids=ids, use_cache=True, **{kwarg: dynamic}).logits.float()
            gaps.append(float((got - want).abs().max()))
            largest = max(largest, float(want.abs().max()))
            ids = want[:, -1:].argmax(-1)
    unit = 2.0 ** (math.floor(math.log2(largest)) - 7)  # bf16's last place at the largest logit
    assert max(gaps) <= 2.5 * unit, (gaps, largest)
    if name == "minicpm3":
        assert largest > 8  # the scale that makes its absolute gap ten times the others'


@pytest.mark.parametrize(
    ("frontend", "rows", "sizes"),
    # Dynamo specialises one row: that graph is captured at size 1 alone
    [("raw", 1, (1, 2, 4, 8)), ("dynamo", 1, (1,)), ("dynamo", 2, (1, 2, 4, 8))],
)
def test_a_first_generate_whose_prompt_nearly_fills_the_cache_captures_every_bucket(frontend, rows, sizes):
    # The warm-ups and captures of the four default buckets (1, 2, 4, 8) write a slot each past the
    # write position: from a prompt of 28 in 32 slots they once ran past the cache's end (IndexError).
    model = tiny_model("llama")
    graphed = devgraph.wrap(model, "cpu", max_cache_len=32, frontend=frontend)
    ids, mask = prompts(rows, seed=1, length=28)
    call = dict(attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert torch.equal(graphed.generate(ids, **call), model.generate(ids, **call))
    assert graphed.stats.replays == 4 and graphed.stats.captured_sizes == sizes
