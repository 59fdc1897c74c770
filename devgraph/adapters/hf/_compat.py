"""The cache argument's name across transformers releases: ``past_key_values`` (5.0-5.23), ``cache`` (5.24+).

transformers 5.24 renamed the cache argument of ``generate`` and of every model's ``forward`` to
``cache`` (``past_key_values`` still works, with a ``FutureWarning``) and the output field likewise;
the generation loop passes ``cache=`` to the forward it calls. The adapter reads whichever a call
carries and passes the name the installed release declares.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

__all__ = ["CACHE_KEYS", "cache_kwarg", "cache_of", "causal_lm_output", "output_cache", "output_field"]

#: The names a forward call's cache may come under (newest first).
CACHE_KEYS = ("cache", "past_key_values")


def cache_kwarg(model: Any) -> str:
    """The cache argument ``model.forward`` declares: ``"cache"`` (transformers 5.24+) or ``"past_key_values"``."""
    try:
        params = inspect.signature(type(model).forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def cache_of(kwargs: dict[str, Any]) -> Any:
    """The cache a forward call carries (under either name), or None."""
    for key in CACHE_KEYS:
        if kwargs.get(key) is not None:
            return kwargs[key]
    return None


@functools.cache
def output_field() -> str:
    """The cache field of a causal LM's output in this release: ``"cache"`` (5.24+) or ``"past_key_values"``."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    fields = getattr(CausalLMOutputWithPast, "__dataclass_fields__", {})
    return "cache" if "cache" in fields else "past_key_values"


def output_cache(output: Any) -> Any:
    """The cache a forward returned (under either field name), or None: a model without a KV cache
    (GPT-1's ``CausalLMOutput`` has no such field) returns none."""
    for key in CACHE_KEYS:
        value = getattr(output, key, None)
        if value is not None:
            return value
    return None


def causal_lm_output(logits: Any, cache: Any) -> Any:
    """``CausalLMOutputWithPast(logits=..., <cache field>=cache)`` in this release's field name."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return CausalLMOutputWithPast(logits=logits, **{output_field(): cache})
