"""What a user of a Hugging Face model devgraph cannot serve is told: where, why, and what to do.

Falcon (both layouts) writes a decode step only a capture's recording refuses (found at the first
capture); XGLM and the mixture-of-experts models that route on the host (JetMoE, DBRX, LongCat-Flash)
write decode steps that read device values on the host, refused at wrap by the dry run of the decode
step, in every mode; MPT adds ALiBi biases; Llama4's ``get_compiled_call`` ignores devgraph's switch;
MPT's config turns the cache off. Every message is checked for the fix it names, and that fix is run.
"""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _hf_models import CAPTURE_REFUSED, HOST_READING_DECODE, prompts, tiny_model  # noqa: E402

import devgraph  # noqa: E402
from devgraph import CaptureError, DevgraphError  # noqa: E402
from devgraph._fallback_fixes import FIXES  # noqa: E402
from devgraph.adapters.hf import decode_hook_reachable, position_bias_source  # noqa: E402

CALL = dict(do_sample=False, max_new_tokens=4)


def _first_generate_refused(graphed, ids, mask):
    """The first generate's CaptureError; skip where this transformers release captures the model."""
    try:
        graphed.generate(ids, attention_mask=mask, **CALL)
    except CaptureError as err:
        return err
    pytest.skip(f"transformers {transformers.__version__} writes a decode step devgraph captures")


@pytest.mark.parametrize("name", sorted(CAPTURE_REFUSED))
@pytest.mark.parametrize("mode", ["full", "piecewise"])
def test_a_refused_capture_names_the_models_line_and_what_the_user_can_do(name, mode):
    model = tiny_model(name)
    graphed = devgraph.wrap(model, "cpu", batch_sizes=[1, 2], max_cache_len=32, mode=mode)
    ids, mask = prompts(2, seed=0)
    err = _first_generate_refused(graphed, ids, mask)
    module = type(model).__module__
    assert err.source is not None and f"{module.rsplit('.', 1)[-1]}.py:" in err.source  # the model's line
    text = str(err)
    assert module in text and f"transformers release (this is {transformers.__version__}" in text
    assert "model.generate(" in text and "mode= does not help" in text
    assert "mode='piecewise'" not in text and "create the tensor before capture" not in text


@pytest.mark.parametrize("name", sorted(CAPTURE_REFUSED))
def test_after_a_refused_capture_generate_runs_eagerly_counted_with_the_fix(name):
    model = tiny_model(name)
    graphed = devgraph.wrap(model, "cpu", batch_sizes=[1, 2], max_cache_len=32)
    ids, mask = prompts(2, seed=0)
    _first_generate_refused(graphed, ids, mask)
    with pytest.warns(UserWarning, match=r"capture_refused") as caught:
        out = graphed.generate(ids, attention_mask=mask, **CALL)
    assert FIXES["capture_refused"] in str(caught[0].message)
    assert torch.equal(out, model.generate(ids, attention_mask=mask, **CALL))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once
        graphed.generate(ids, attention_mask=mask, **CALL)
    assert graphed.stats.fallbacks == {"capture_refused": 2}
    with pytest.raises(DevgraphError, match=r"Fix: try another transformers release"):
        graphed.capture()


def test_after_a_refused_capture_strict_raises_naming_the_fix():
    graphed = devgraph.wrap(
        tiny_model("falcon_multi_query"), "cpu", batch_sizes=[1], max_cache_len=32, strict=True
    )
    ids, mask = prompts(1, seed=0)
    _first_generate_refused(graphed, ids, mask)
    with pytest.raises(DevgraphError, match=r"strict=True.*Fix: try another transformers release"):
        graphed.generate(ids, attention_mask=mask, **CALL)


@pytest.mark.parametrize("name", sorted(HOST_READING_DECODE))
@pytest.mark.parametrize("mode", ["full", "piecewise", "breakable"])
def test_a_decode_step_reading_the_host_is_refused_at_wrap_in_every_mode_with_the_fix_that_works(name, mode):
    # JetMoE, DBRX and LongCat-Flash were refused only at the first generate(); in the piecewise and
    # breakable modes first by the prefill, with a message sending the user to mode='full', which
    # failed too (DBRX and LongCat-Flash raised Dynamo's "annotate your code with torch._check" on every
    # piecewise call).
    model = tiny_model(name)
    with pytest.raises(CaptureError) as info:
        devgraph.wrap(model, "cpu", batch_sizes=[1, 2], max_cache_len=32, mode=mode)
    err = info.value
    module = type(model).__module__
    assert err.source is not None and f"{module.rsplit('.', 1)[-1]}.py:" in err.source  # the model's line
    text = str(err)
    assert text.startswith(f"{type(model).__name__}'s decode step cannot be captured")
    assert "found at wrap" in text and module in text and "No devgraph mode serves this model" in text
    assert "Use eager model.generate() for it" in text
    assert "mode='full'" not in text and "torch._check" not in text and "create the tensor" not in text
    # ...and the fix named works: eager generate runs the model.
    ids, mask = prompts(2, seed=0)
    out = model.generate(ids, attention_mask=mask, **CALL)
    assert out.shape == (2, ids.shape[1] + CALL["max_new_tokens"])


def _read_on_host_when(tokens_per_row):
    def hook(module, args, out):
        hidden = out[0] if isinstance(out, tuple) else out
        if (hidden.shape[1] == 1) == (tokens_per_row == 1):
            hidden.sum().item()  # a host read

    return hook


def test_any_decode_step_reading_the_host_is_refused_at_wrap_naming_your_line():
    # By mechanism, not by model: a Llama whose decode steps (one token per row) read a value on the host.
    model = tiny_model("llama")
    model.model.layers[1].register_forward_hook(_read_on_host_when(tokens_per_row=1))
    with pytest.raises(CaptureError) as info:
        devgraph.wrap(model, "cpu", max_cache_len=32)
    text = str(info.value)
    assert "op: Tensor.item" in text and "test_hf_refusals.py:" in text and "hidden.sum().item()" in text
    assert "the refused line is your code" in text and "keep the value on the device" in text
    assert "Use eager model.generate() for it" in text


@pytest.mark.parametrize("frontend", ["dynamo", "raw"])
def test_host_reads_in_the_eager_prefill_are_not_refused_at_wrap(frontend, recwarn):
    # Only the decode step is captured in mode='full': the prefill runs eagerly and may read the host.
    model = tiny_model("llama")
    model.model.layers[1].register_forward_hook(_read_on_host_when(tokens_per_row=7))
    graphed = devgraph.wrap(model, "cpu", batch_sizes=[1], max_cache_len=32, frontend=frontend)
    ids, mask = prompts(1, seed=0)
    out = graphed.generate(ids, attention_mask=mask, **CALL)
    # Dynamo traces the hook with the step (run at every replay as traced); a raw capture runs it
    # once, at capture, and says so
    hooks = [w for w in recwarn if "forward hooks" in str(w.message)]
    assert bool(hooks) == (frontend == "raw")
    assert torch.equal(out, model.generate(ids, attention_mask=mask, **CALL))
    assert graphed.stats.replays == CALL["max_new_tokens"] - 1


def test_alibi_is_found_in_a_sub_config_and_refused_without_sending_the_user_to_another_mode():
    model = tiny_model("mpt")
    assert position_bias_source(model) == "config.attn_config.alibi=True"
    for mode in ("full", "piecewise"):
        with pytest.raises(DevgraphError) as info:
            devgraph.wrap(model, "cpu", mode=mode)
        text = str(info.value)
        assert "config.attn_config.alibi=True" in text and "eager model.generate()" in text
        assert "no devgraph mode serves it" in text and "Use mode=" not in text


def test_alibi_is_found_by_the_models_own_function_where_the_config_has_no_field():
    assert "alibi" in position_bias_source(tiny_model("bloom"))


def test_a_config_that_turns_alibi_off_is_not_refused():
    model = tiny_model("falcon_multi_query", alibi=False)
    assert position_bias_source(model) is None
    assert position_bias_source(tiny_model("falcon_multi_query", alibi=True)) == "config.alibi=True"


def test_use_cache_off_in_the_models_config_says_so_and_names_the_fix():
    model = tiny_model("llama")
    model.config.use_cache = False
    model.generation_config.use_cache = False
    graphed = devgraph.wrap(model, "cpu", batch_sizes=[1], max_cache_len=32)
    ids, mask = prompts(1, seed=0)
    with pytest.warns(
        UserWarning, match=r"use_cache=False \(not passed: model\.generation_config\.use_cache"
    ) as w:
        graphed.generate(ids, attention_mask=mask, **CALL)
    text = str(w[0].message)
    assert "model.config.use_cache, which LlamaConfig sets" in text and "pass use_cache=True" in text
    # ...and passing it on fixes it: the decode steps replay.
    graphed.generate(ids, attention_mask=mask, use_cache=True, **CALL)
    assert graphed.stats.replays == CALL["max_new_tokens"] - 1


def test_use_cache_false_passed_by_the_user_says_it_was_passed():
    graphed = devgraph.wrap(tiny_model("llama"), "cpu", batch_sizes=[1], max_cache_len=32)
    ids, mask = prompts(1, seed=0)
    with pytest.warns(
        UserWarning, match=r"use_cache=False \(passed to generate\(\)\).*Fix: pass use_cache=True"
    ):
        graphed.generate(ids, attention_mask=mask, use_cache=False, **CALL)


def test_llama4_decode_hook_is_reached_by_shadowing_get_compiled_call():
    model = tiny_model("llama4_text")
    if decode_hook_reachable(model):
        pytest.skip(f"transformers {transformers.__version__}'s llama4 get_compiled_call reads the switch")
    graphed = devgraph.wrap(model, "cpu", batch_sizes=[1, 2], max_cache_len=32)
    ids, mask = prompts(2, seed=3)
    out = graphed.generate(ids, attention_mask=mask, **CALL)
    assert torch.equal(out, model.generate(ids, attention_mask=mask, **CALL))
    assert graphed.stats.replays == CALL["max_new_tokens"] - 1 and graphed.stats.fallbacks == {}
    assert "get_compiled_call" not in model.__dict__  # the shadow is put back


def test_decode_hook_reachable_on_a_model_whose_switch_works():
    assert decode_hook_reachable(tiny_model("llama"))


def test_decode_steps_that_never_reach_the_hook_are_warned_about_naming_the_check():
    model = tiny_model("llama")
    graphed = devgraph.wrap(model, "cpu", batch_sizes=[1], max_cache_len=32)
    # A release whose generate never asks get_compiled_call: the plain forward runs every step.
    model.__dict__["_valid_auto_compile_criteria"] = lambda *args, **kwargs: False
    ids, mask = prompts(1, seed=0)
    try:
        with pytest.warns(UserWarning, match=r"decode_hook_not_reached") as w:
            graphed.generate(ids, attention_mask=mask, **CALL)
    finally:
        del model.__dict__["_valid_auto_compile_criteria"]
    text = str(w[0].message)
    assert (
        "LlamaForCausalLM" in text and "Fix: check devgraph.adapters.hf.decode_hook_reachable(model)" in text
    )


def test_a_refused_prefill_piece_sends_the_user_to_mode_full_and_later_prefills_eagerly(monkeypatch):
    from devgraph.adapters.hf._prefill import PiecewisePrefill

    model = tiny_model("llama")
    graphed = devgraph.wrap(model, "cpu", batch_sizes=[1], max_cache_len=32, mode="piecewise")
    ids, mask = prompts(1, seed=0)

    def refused(self, kwargs):
        raise CaptureError("host synchronisation inside graph capture", op="Tensor.item", source=None)

    with monkeypatch.context() as patch:
        patch.setattr(PiecewisePrefill, "__call__", refused)
        with pytest.raises(CaptureError) as info:
            graphed.generate(ids, attention_mask=mask, **CALL)
    text = str(info.value)
    assert "prefill step cannot be captured" in text and "wrap with mode='full'" in text
    assert "transformers release" in text and "model.generate(" in text
    with pytest.warns(
        UserWarning, match=r"capture_refused.*mode='full'.*Fix: try another transformers release"
    ):
        out = graphed.generate(ids, attention_mask=mask, **CALL)
    assert torch.equal(out, model.generate(ids, attention_mask=mask, **CALL))
    assert graphed.stats.fallbacks == {"capture_refused": 1}
    assert graphed.stats.replays == CALL["max_new_tokens"] - 1  # decode still replays


def test_pieces_that_cannot_be_built_refuse_the_prefill_once_then_it_runs_eagerly(monkeypatch):
    # DBRX and LongCat-Flash raised Dynamo's trace failure at every piecewise generate(), tracing again
    # each time. A prefill whose pieces cannot be built is refused once, like a refused capture.
    from devgraph.adapters.hf._prefill import PiecewisePrefill

    model = tiny_model("llama")
    graphed = devgraph.wrap(model, "cpu", batch_sizes=[1], max_cache_len=32, mode="piecewise")
    ids, mask = prompts(1, seed=0)
    traces = []

    def untraceable(self, kwargs):
        traces.append(1)
        raise DevgraphError(
            "piecewise mode could not trace the model as one graph with Dynamo: UserError: ..."
        )

    with monkeypatch.context() as patch:
        patch.setattr(PiecewisePrefill, "__call__", untraceable)
        with pytest.raises(CaptureError) as info:
            graphed.generate(ids, attention_mask=mask, **CALL)
        text = str(info.value)
        assert "prefill step cannot be captured: piecewise mode could not trace" in text
        assert "wrap with mode='full'" in text
        with pytest.warns(UserWarning, match=r"capture_refused.*prefill step cannot be captured \(the first"):
            out = graphed.generate(ids, attention_mask=mask, **CALL)
    assert traces == [1]  # not traced again
    assert torch.equal(out, model.generate(ids, attention_mask=mask, **CALL))
    assert graphed.stats.replays == CALL["max_new_tokens"] - 1  # decode still replays
    # ...and the fix named works: mode='full' serves the model without a warning.
    full = devgraph.wrap(model, "cpu", batch_sizes=[1], max_cache_len=32, mode="full")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(full.generate(ids, attention_mask=mask, **CALL), out)
    assert full.stats.replays == CALL["max_new_tokens"] - 1
