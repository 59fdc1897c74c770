"""What a user can do about each reason a call runs eagerly: the one reason -> fix table.

Every reason devgraph counts an eager call under (the runners' ``stats.fallbacks`` keys, the Hugging
Face adapter's, vLLM's ``eager.<reason>`` counters) has an entry here, and every fallback warning
(``Accounts.note_fallback``) ends with it through ``with_fix``. ``tests/test_fallback_fixes.py``
collects the reasons from the code, as ``tests/test_docs.py`` does for the troubleshooting page,
and fails on one without a fix. The troubleshooting page explains the same reasons at length.
"""

from __future__ import annotations

__all__ = ["FIXES", "fallback_fix", "with_fix"]

_NO_CACHE_OF_YOURS = "let devgraph own the cache: pass no past_key_values / cache / cache_params"
_GREEDY_OR_SAMPLING = (
    "use greedy search or sampling (num_beams=1, no penalty_alpha/dola_layers/constraints); "
    "other decoding methods run as plain model.generate"
)
_HOOK_REASON = (
    "check devgraph.adapters.hf.decode_hook_reachable(model) (False: this model type's "
    "get_compiled_call never returns devgraph's route in this transformers release); use a transformers "
    "release in the range of devgraph's pyproject.toml, or report it with the model type and transformers version"
)

#: reason -> the fix the warning names (imperative, something the user can apply).
FIXES: dict[str, str] = {
    # devgraph.wrap(frontend="dynamo")
    "dynamo_untraced": (
        "pass a value the forward reads that changes every call as a tensor, or raise "
        "torch._dynamo.config.recompile_limit if it takes few values"
    ),
    "python_random": "draw with torch's generators on tensors, or pass the number in as a tensor",
    # devgraph.runner.GraphFamilies
    "verify_token_count": (
        "give a verify family requests x (k + 1) tokens (each request's last token and its k drafted ones), "
        "or serve other token counts from a decode family"
    ),
    # devgraph.wrap's runners (full, piecewise)
    "batch_too_large": "wrap with a larger max_batch_size (or a larger last entry in batch_sizes)",
    "padding_changes_result": (
        "make rows independent (model.eval(), mask padded tokens), or call with batch sizes that are buckets "
        "(batch_sizes=[...] / capture_sizes=[...])"
    ),
    "signature_mismatch": (
        "call as at capture (same shapes beyond the batch, dtypes, devices, static_args tensors and constants), "
        "or wrap the model once per call form"
    ),
    "autocast_or_dtype_mismatch": (
        "call under the same torch.autocast state and torch.get_default_dtype() as the capture"
    ),
    "unsupported_call": (
        "pass tensors as separate arguments and declare the others: batch_dims=, static_args=, host_args="
    ),
    "empty_batch": "nothing to fix: a call with 0 rows runs eagerly (skip empty batches to avoid the call)",
    "size_not_captured": "add the size to capture_sizes (or raise capture_budget where sizes were dropped)",
    "token_count_branch": (
        "make the forward the same code for every token count (torch.where instead of Python branching on "
        "x.shape), or add the size to capture_sizes (it is then traced at that size), or use mode='full'"
    ),
    # Hugging Face generate(): whole calls
    "inputs": "pass input_ids of shape [batch, prompt_len]",
    "inputs_embeds": "pass input_ids instead of inputs_embeds",
    "assistant_model": (
        "pass the assistant wrapped by devgraph (assistant_model=devgraph.wrap(draft, ...)), another model than "
        "the one generating; or call model.generate for assisted generation"
    ),
    "assistant_tokenizer": (
        "draft with an assistant that shares the model's tokenizer (the same vocabulary), or call "
        "model.generate for universal assisted generation"
    ),
    "custom_generate": "use transformers' own greedy search or sampling (drop custom_generate)",
    "negative_prompt_ids": "generate without negative_prompt_ids (classifier-free guidance)",
    "synced_gpus": "pass synced_gpus=False",
    "past_key_values": _NO_CACHE_OF_YOURS,
    "cache": _NO_CACHE_OF_YOURS,
    "cache_params": _NO_CACHE_OF_YOURS,
    "beam_search": _GREEDY_OR_SAMPLING,
    "beam_sample": _GREEDY_OR_SAMPLING,
    "group_beam_search": _GREEDY_OR_SAMPLING,
    "constrained_beam_search": _GREEDY_OR_SAMPLING,
    "contrastive_search": _GREEDY_OR_SAMPLING,
    "dola_generation": _GREEDY_OR_SAMPLING,
    "assisted_generation": (
        "draft with prompt_lookup_num_tokens or with a devgraph-wrapped assistant_model, one at a time; "
        "assistant_early_exit, use_mtp and speculation_type run as plain model.generate"
    ),
    "use_cache": "pass use_cache=True to generate() (or set model.generation_config.use_cache = True)",
    "cache_implementation": 'leave cache_implementation unset (or "static"): devgraph decodes over its own static cache',
    "compile_config": "drop compile_config / disable_compile: devgraph serves the decode step itself",
    "output_attentions": "drop output_attentions / output_hidden_states (the graph returns logits only)",
    "sequence_too_long": "wrap with a larger max_cache_len (or ask for fewer max_new_tokens)",
    "capture_refused": (
        "try another transformers release (the refused line is in the model's own code), or call "
        "model.generate() directly; wrap again after changing either"
    ),
    # Hugging Face generate(): steps, and calls of the wrapper
    "forward_not_graphed": "call graphed.generate(...) (only generate() replays graphs)",
    "decode_arguments": "report it to devgraph with your transformers version and the model type",
    "mask_structure": "report it to devgraph with the model type and its attention layer types",
    "decode_hook_not_reached": _HOOK_REASON,
    "verify_too_long": (
        "keep the candidates per step at most those the generate starts with: "
        "num_assistant_tokens_schedule='constant' on the assistant's generation_config (its 'heuristic' "
        "schedule raises num_assistant_tokens during a generate; the next generate captures up to the raised count)"
    ),
    "prefill_hook_not_reached": "wrap with mode='full' (prefill eagerly, decode from graphs), or "
    + _HOOK_REASON,
    "prefill_chunk_size": "leave prefill_chunk_size unset (devgraph asks for one chunk as long as the cache)",
    "prefill_not_piecewise": "wrap with mode='full' (prefill eagerly, decode from graphs)",
    # vLLM (devgraph.adapters.vllm.stats()["eager.<reason>"])
    "over_capture_size": (
        "raise compilation_config.max_cudagraph_capture_size (or list the size in cudagraph_capture_sizes) to "
        "at least max_num_seqs, or lower max_num_seqs"
    ),
    "FULL": "nothing by itself: vLLM chose eager for this step; compare with vLLM's cudagraph_mode and capture sizes",
    "PIECEWISE": "nothing by itself: vLLM chose eager for this step; compare with vLLM's cudagraph_mode and capture sizes",
}


def fallback_fix(reason: str) -> str | None:
    """The fix for ``reason`` (None for a reason devgraph does not know: a third party's own)."""
    return FIXES.get(reason)


def with_fix(reason: str, detail: str) -> str:
    """``detail``, ending with ``Fix: <the reason's fix>`` unless it already says it."""
    fix = FIXES.get(reason)
    if fix is None or fix.lower() in detail.lower():
        return detail
    return f"{detail.rstrip('. ')}. Fix: {fix}"
