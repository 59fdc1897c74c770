"""Which ``generate()`` calls the graphed decode step can serve, and why the others run eagerly.

``eager_reason(model, args, kwargs, ...)`` resolves the call's generation config the way
``PreTrainedModel.generate`` does (``model._prepare_generation_config``) and returns
``(category, detail)`` naming the option that keeps devgraph out, or None. transformers' ``_sample``
loop (greedy search and sampling, with any logits processors, stopping criteria, streamer or
``return_dict_in_generate``) routes its decode forward through the hook devgraph uses; its assisted
loop (one row), with candidates from prompt lookup (``prompt_lookup_num_tokens``) or from an assistant
model devgraph wrapped, calls the models themselves, which devgraph reaches through the instances'
``forward`` (``_verify``); beam search, assisted generation with a plain assistant model and the
other decoding methods run eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["GenerateCall", "eager_reason", "new_tokens", "read_generate_call", "speculation", "verify_room"]

#: ``PreTrainedModel.generate`` parameters that are not generation-config fields, in its order.
_GENERATE_PARAMS = (
    "inputs",
    "generation_config",
    "logits_processor",
    "stopping_criteria",
    "prefix_allowed_tokens_fn",
    "synced_gpus",
    "assistant_model",
    "streamer",
    "negative_prompt_ids",
    "negative_prompt_attention_mask",
    "custom_generate",
)

#: Arguments that take generation away from the ``_sample`` loop or from devgraph's cache.
_EAGER_ARGUMENTS = {
    "assistant_tokenizer": "universal assisted generation (an assistant with a tokenizer of its own)",
    "custom_generate": "a custom decoding loop is not transformers' own",
    "negative_prompt_ids": "classifier-free guidance runs a second, unshared model pass",
    "synced_gpus": "synchronised multi-GPU generation",
    "past_key_values": "a cache you pass is not devgraph's static cache",
    "cache": "a cache you pass is not devgraph's static cache",
    "cache_params": "a cache you pass is not devgraph's static cache",
    "inputs_embeds": "prompts given as embeddings",
}


class GenerateCall:
    """A ``generate()`` call's arguments by name (``named``) plus the prompt ``input_ids``."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if len(args) > len(_GENERATE_PARAMS):
            raise TypeError(f"generate() takes at most {len(_GENERATE_PARAMS)} positional arguments")
        self.named = dict(zip(_GENERATE_PARAMS, args, strict=False))
        duplicated = set(self.named) & set(kwargs)
        if duplicated:
            raise TypeError(f"generate() got multiple values for {sorted(duplicated)}")
        self.named.update(kwargs)
        ids = self.named.get("inputs")
        self.input_ids = ids if ids is not None else self.named.get("input_ids")

    def config_kwargs(self) -> dict[str, Any]:
        """The keyword arguments ``generate`` hands to ``_prepare_generation_config``."""
        return {k: v for k, v in self.named.items() if k not in _GENERATE_PARAMS}


def read_generate_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> GenerateCall:
    return GenerateCall(args, kwargs)


def speculation(config: Any, call: GenerateCall) -> str | None:
    """Which assisted generation devgraph serves this call as: ``"prompt_lookup"`` (candidates from
    n-grams of the sequence), ``"assistant"`` (drafted by a devgraph-wrapped ``assistant_model``), or
    None (not assisted, or a kind it runs eagerly: early exit, multi-token prediction, DFlash)."""
    if config.assistant_early_exit is not None or getattr(config, "use_mtp", False):
        return None
    if getattr(config, "speculation_type", None) is not None:  # "dflash": a candidate generator of its own
        return None
    assistant = call.named.get("assistant_model")
    if assistant is None:
        return "prompt_lookup" if config.prompt_lookup_num_tokens is not None else None
    if config.prompt_lookup_num_tokens is not None:  # transformers would look up and leave it idle
        return None
    if type(getattr(assistant, "module", assistant)).__name__.startswith(
        ("Gemma4Assistant", "Gemma4Unified")
    ):
        return None  # drafts from the target's shared key/value states: a candidate generator of its own
    return "assistant"


def eager_reason(
    model: Any,
    call: GenerateCall,
    max_batch: int,
    max_cache_len: int,
    graphed: Callable[[Any], bool] | None = None,
) -> tuple[tuple[str, str] | None, Any]:
    """``(reason, generation_config)``: why ``call`` must run eagerly (None: it can be graphed).

    ``generation_config`` is the call's resolved config (None when the reason came first).
    ``graphed(assistant)``: whether an ``assistant_model`` is one devgraph serves (a wrapper of its
    own); None: every assisted generation runs eagerly. For an assisted call the caller checks the
    room its verify graphs need (``verify_room``).
    """
    for name, why in _EAGER_ARGUMENTS.items():
        if call.named.get(name) not in (None, False):
            return (name, f"{name}: {why}"), None
    assistant = call.named.get("assistant_model")
    if assistant is not None and (graphed is None or not graphed(assistant)):
        return (
            "assistant_model",
            f"assistant_model={type(assistant).__name__}: devgraph drafts with an assistant it wrapped itself "
            "(devgraph.wrap(assistant)); a plain model runs the whole assisted generate eagerly",
        ), None
    ids = call.input_ids
    if ids is None or not hasattr(ids, "dim") or ids.dim() != 2:
        return ("inputs", "generate() needs input_ids of shape [batch, prompt_len] to be graphed"), None
    from transformers.generation.configuration_utils import GenerationMode

    config, _ = model._prepare_generation_config(call.named.get("generation_config"), **call.config_kwargs())
    mode = config.get_generation_mode(assistant)
    assisted = (
        mode == GenerationMode.ASSISTED_GENERATION and graphed is not None and speculation(config, call)
    )
    if not assisted and mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        return (
            str(mode.value),
            f"{mode.value} (num_beams={config.num_beams}) calls the model directly; only greedy search, "
            "sampling and their assisted generation by prompt lookup or by a devgraph-wrapped assistant "
            "(not early exit, multi-token prediction or DFlash) run their steps through devgraph",
        ), config
    if config.use_cache is False:
        return (
            "use_cache",
            f"use_cache=False ({_origin(model, call, 'use_cache')}): every step reruns the whole sequence",
        ), config
    if config.cache_implementation not in (None, "static"):
        return (
            "cache_implementation",
            f"cache_implementation={config.cache_implementation!r}: devgraph decodes over its own static cache",
        ), config
    if config.compile_config is not None or config.disable_compile:
        return (
            "compile_config",
            "compile_config/disable_compile: devgraph serves the decode step itself",
        ), config
    if config.output_attentions or config.output_hidden_states:
        return (
            "output_attentions",
            "output_attentions/output_hidden_states: the captured decode step returns logits only",
        ), config
    batch, prompt_len = ids.shape
    rows = batch * max(config.num_return_sequences or 1, 1)
    if rows > max_batch:
        return (
            "batch_too_large",
            f"batch {rows} (with num_return_sequences) is above the largest captured bucket ({max_batch})",
        ), config
    new = new_tokens(config, prompt_len)
    need = prompt_len + new - 1
    if need > max_cache_len:
        return (
            "sequence_too_long",
            f"prompt {prompt_len} + {new} new tokens needs {need} KV-cache slots, max_cache_len is {max_cache_len}",
        ), config
    return None, config


def new_tokens(config: Any, prompt_len: int) -> int:
    """How many tokens a generate with the resolved ``config`` makes at most."""
    return config.max_new_tokens if config.max_new_tokens is not None else config.max_length - prompt_len


def verify_room(
    prompt_len: int, new: int, largest: int, max_cache_len: int, whose: str
) -> tuple[str, str] | None:
    """Why an assisted generate has no room in a cache of ``max_cache_len`` slots for verify graphs of up
    to ``largest`` tokens (``whose``: which model's, said in the message), or None.

    A step starts at slot ``prompt + new - 2`` at the latest (the last new token's); the capture of the
    verify graphs, at whichever step comes first, writes their largest step from there.
    """
    need = prompt_len + new - 2 + largest
    if need <= max_cache_len:
        return None
    return (
        "sequence_too_long",
        f"assisted generation: prompt {prompt_len} + {new} new tokens, with {whose} verify steps of up to {largest} "
        f"tokens, needs {need} KV-cache slots, max_cache_len is {max_cache_len}",
    )


def _origin(model: Any, call: GenerateCall, field: str) -> str:
    """Where a generation setting came from: the call, the ``generation_config`` passed, or the model."""
    if field in call.config_kwargs():
        return "passed to generate()"
    if call.named.get("generation_config") is not None:
        return "from the generation_config passed to generate()"
    where = f"model.generation_config.{field}"
    if getattr(model.config, field, None) is not None:
        where += f", from model.config.{field}, which {type(model.config).__name__} sets"
    return f"not passed: {where}"
