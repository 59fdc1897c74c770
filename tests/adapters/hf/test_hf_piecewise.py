"""``mode="piecewise"``/``"full_and_piecewise"`` for Hugging Face models: the prompt is prefilled from
pieces split at attention (any length), each decode step replays a full graph; greedy tokens equal
eager ``model.generate``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from _hf_models import prompts, tiny_model

import devgraph
from devgraph import DevgraphError

NEW = 5


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def piecewise(request):
    model = tiny_model(request.param)
    return devgraph.wrap(model, "cpu", batch_sizes=[1, 4], max_cache_len=32, mode="piecewise")


@pytest.mark.parametrize("length", [16, 7, 21], ids=["at_a_capture_size", "padded_up", "between_sizes"])
def test_piecewise_prefill_greedy_matches_eager(piecewise, length):
    ids, mask = prompts(3, seed=length, length=length)
    mask[0, :2] = 0  # a left-padded row
    before = piecewise.prefill_stats.replays
    out = piecewise.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW)
    assert torch.equal(
        out, piecewise.module.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW)
    )
    assert piecewise.prefill_stats.replays - before == 3  # one piecewise replay per prompt row
    assert piecewise.stats.fallbacks == {} and piecewise.prefill_stats.fallbacks == {}


def test_full_and_piecewise_prefills_from_pieces_and_decodes_from_full_graphs():
    model = tiny_model("llama")
    graphed = devgraph.wrap(model, "cpu", batch_sizes=[2], max_cache_len=32, mode="full_and_piecewise")
    ids, mask = prompts(2, seed=3, length=9)
    out = graphed.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW)
    assert torch.equal(out, model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW))
    assert graphed.prefill_stats.replays == 2
    assert graphed.stats.replays == NEW - 1


def test_piecewise_prefill_with_sliding_and_full_layers_matches_eager():
    model = tiny_model("qwen2_mixed_sliding")  # the mask is a dict per layer type
    graphed = devgraph.wrap(model, "cpu", batch_sizes=[2], max_cache_len=32, mode="piecewise")
    ids, mask = prompts(2, seed=4, length=10)
    out = graphed.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW)
    assert torch.equal(out, model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW))
    assert graphed.prefill_stats.replays == 2


@pytest.fixture(scope="module")
def diffllama():
    model = tiny_model("diffllama")
    return model, devgraph.wrap(model, "cpu", batch_sizes=[1, 4], max_cache_len=32, mode="piecewise")


@pytest.mark.parametrize("length", [16, 7], ids=["at_a_capture_size", "padded_up"])
def test_piecewise_prefill_with_two_attention_calls_per_layer_matches_eager(diffllama, length):
    # DiffLlama joins each layer's two attention outputs after the second call; its first output
    # once reached the join as read at capture (issue 48: logits tenths off, no warning).
    model, graphed = diffllama
    ids, mask = prompts(2, seed=length, length=length)
    mask[0, :2] = 0  # a left-padded row
    call = dict(do_sample=False, max_new_tokens=NEW, output_logits=True, return_dict_in_generate=True)
    before = graphed.prefill_stats.replays
    out = graphed.generate(ids, attention_mask=mask, **call)
    expected = model.generate(ids, attention_mask=mask, **call)
    assert torch.equal(out.sequences, expected.sequences)
    for step, (got, want) in enumerate(zip(out.logits, expected.logits)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=lambda m, s=step: f"step {s}: {m}")
    assert graphed.prefill_stats.replays - before == 2  # the prefill came from the pieces
    assert graphed.stats.fallbacks == {} and graphed.prefill_stats.fallbacks == {}


def test_compile_options_without_a_piecewise_mode_are_refused():
    with pytest.raises(DevgraphError, match=r"capture_sizes.*mode='piecewise'"):
        devgraph.wrap(tiny_model("llama"), "cpu", capture_sizes=[16])


def test_moe_fallback_op_is_refused_where_eager_would_not_run_grouped_mm(monkeypatch):
    # transformers' traced experts op reads the routing offsets on the host: a piece would replay the
    # routing of capture time. Where devgraph cannot put eager's torch._grouped_mm in its place, refuse.
    import devgraph.adapters.hf._moe as moe

    monkeypatch.setattr(moe, "eager_uses_grouped_mm", lambda model: False)
    graphed = devgraph.wrap(tiny_model("mixtral"), "cpu", batch_sizes=[1], max_cache_len=16, mode="piecewise")
    ids, mask = prompts(1, seed=3, length=5)
    with pytest.raises(DevgraphError, match=r"transformers::grouped_mm_fallback.*offs\.tolist"):
        graphed.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=2)


def test_moe_decode_graph_runs_as_traced_where_eager_would_not_run_grouped_mm(monkeypatch, caplog):
    # The decode step behind Dynamo meets the same op: that graph runs as traced, eagerly (the
    # routing read at every step), counted and warned, never captured with capture time's routing.
    import devgraph.adapters.hf._moe as moe

    monkeypatch.setattr(moe, "eager_uses_grouped_mm", lambda model: False)
    model = tiny_model("mixtral")
    graphed = devgraph.wrap(model, "cpu", batch_sizes=[2], max_cache_len=16)
    ids, mask = prompts(2, seed=3, length=5)
    call = dict(attention_mask=mask, do_sample=False, max_new_tokens=4)
    out = graphed.generate(ids, **call)
    assert "a graph Dynamo traced runs eagerly (hf_grouped_mm_routing)" in caplog.text
    assert torch.equal(out, model.generate(ids, **call))
    assert graphed.stats.unservable == {"hf_grouped_mm_routing": 1} and graphed.stats.replays == 0
