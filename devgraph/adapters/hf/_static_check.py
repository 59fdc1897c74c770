"""Wrap-time proof that a model computes over devgraph's static KV cache what it computes eagerly.

Every devgraph mode serves ``generate`` over one static cache of ``max_cache_len`` slots
(``SharedStaticCache``): the prefill writes into it (eagerly, from pieces or from breakable graphs)
and the decode steps replay over it. A model whose attention reads the cache's *length* rather than
the number of tokens written computes something else there: GPT-Neo's local attention slices its
window from a mask by the number of cached keys, so over ``max_cache_len`` slots its window sits at
the end of the cache, and logits are off by 0.1-0.3 from the first token, with no error. transformers
itself marks such classes ``_can_compile_fullgraph = False``, but that flag is also False on classes
nobody has tried, so it cannot decide alone.

``check_static_cache`` decides by running the model: the same random prompts eagerly over
transformers' dynamic cache and over a one-row static cache laid out as devgraph's, a short one
(3 tokens: the cache's length differs most from the tokens written) and a longer one (up to 64
tokens), each followed by decode steps, and compares every position's logits. A difference above
rounding (relative L2 per position: 1e-3 in float32, 5e-2 in 16-bit types, where the two caches'
attention sums round differently) refuses the model by name.
"""

from __future__ import annotations

from typing import Any

import torch

from devgraph._errors import DevgraphError

__all__ = ["check_static_cache", "static_cache_tolerance"]

#: Prompt lengths compared (the longer one is capped by the cache: ``max_cache_len - 2``).
_SHORT, _LONG = 3, 64
#: Decode steps after each prompt.
_STEPS = 2


def static_cache_tolerance(dtype: torch.dtype) -> float:
    """The largest relative L2 difference of one position's logits accepted as rounding."""
    return 5e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-3


def _relative(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per position: ``|got - want| / |want|`` over the vocabulary, in float32."""
    got, want = got.float(), want.float()
    return (got - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-6)


def _compare(model: Any, num_layers: int, max_cache_len: int, length: int) -> tuple[float, str]:
    """The worst relative difference over a ``length``-token prompt and ``_STEPS`` decode steps, and where."""
    from transformers.cache_utils import Cache, StaticLayer

    from devgraph.adapters.hf._compat import cache_kwarg

    kwarg = cache_kwarg(model)
    static = Cache(layers=[StaticLayer(max_cache_len=max_cache_len) for _ in range(num_layers)])
    vocab = model.config.get_text_config(decoder=True).vocab_size
    generator = torch.Generator().manual_seed(length)
    ids = torch.randint(min(3, vocab - 1), vocab, (1, length), generator=generator).to(model.device)
    worst, where = 0.0, ""
    dynamic = model(input_ids=ids, use_cache=True)
    over_static = model(input_ids=ids, use_cache=True, **{kwarg: static})
    pairs = [(f"position {{}} of a {length}-token prompt", over_static.logits, dynamic.logits)]
    cache = dynamic.past_key_values
    for step in range(_STEPS):
        token = dynamic.logits[:, -1:].argmax(-1)
        dynamic = model(input_ids=token, use_cache=True, **{kwarg: cache})
        over_static = model(input_ids=token, use_cache=True, **{kwarg: static})
        cache = dynamic.past_key_values
        pairs.append((f"decode step {step + 1} after a {length}-token prompt", over_static.logits, dynamic.logits))
    for label, got, want in pairs:
        if got.shape != want.shape:
            return float("inf"), label.format("any") + f" (logits {tuple(got.shape)}, eagerly {tuple(want.shape)})"
        relative = _relative(got, want).flatten()
        if not torch.isfinite(relative).all():
            return float("inf"), label.format(int((~torch.isfinite(relative)).nonzero()[0])) + " (not finite)"
        value, index = relative.max(0)
        if float(value) > worst:
            worst, where = float(value), label.format(int(index))
    return worst, where


def check_static_cache(model: Any, num_layers: int, max_cache_len: int) -> None:
    """Raise ``DevgraphError`` when ``model`` computes other logits over a static cache of
    ``max_cache_len`` slots than over transformers' dynamic cache (see the module docstring).

    Runs the model eagerly on two short random prompts (``4 * (1 + _STEPS)`` forwards, batch 1).
    """
    param = next(model.parameters(), None)
    dtype = param.dtype if param is not None else torch.float32
    tolerance = static_cache_tolerance(dtype)
    lengths = sorted({min(_SHORT, max_cache_len - 1 - _STEPS), min(_LONG, max_cache_len - 1 - _STEPS)})
    with torch.no_grad():
        results = [_compare(model, num_layers, max_cache_len, n) for n in lengths if n >= 1]
    if not results:
        return  # a cache too short for a prompt and a decode step: generate() sends such calls to eager
    worst, where = max(results)
    if worst <= tolerance:
        return
    name = type(model).__name__
    flag = (
        f"; transformers marks {name} _can_compile_fullgraph = False (not compilable as one graph)"
        if getattr(type(model), "_can_compile_fullgraph", None) is False
        else ""
    )
    raise DevgraphError(
        f"{name} computes other logits over a static KV cache of max_cache_len={max_cache_len} slots than "
        f"eagerly over transformers' dynamic cache: a relative difference of {worst:.3g} at {where} "
        f"(rounding in {str(dtype).replace('torch.', '')} stays below {tolerance:g}). Its attention depends on "
        f"the cache's length rather than the tokens written (GPT-Neo sizes its local-attention window by the "
        f"number of cached keys){flag}. Every devgraph mode serves generate() over such a static cache, so "
        "none serves this model: use eager model.generate() for it"
    )
