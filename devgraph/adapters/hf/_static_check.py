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

The check runs whatever the model's code does, so it must not fail in the model's place: an exception
raised by any of its forwards (CPM-Ant's eager forward over a static cache fails with a size mismatch,
and so does its eager ``generate`` with ``cache_implementation="static"``), or a forward that returns
no KV cache (GPT-1 recomputes the whole sequence at every step), refuses the model with a
``DevgraphError`` naming the class, what ran, what failed (the exception and the model's line) and
that eager ``model.generate()`` runs it over its own cache.
"""

from __future__ import annotations

import os
import traceback
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


class _Run:
    """Which forward of the check is running (for the message when one fails)."""

    def __init__(self) -> None:
        self.what = ""


class _NoCache(Exception):
    """A forward with ``use_cache=True`` returned no KV cache."""


def _compare(model: Any, num_layers: int, max_cache_len: int, length: int, run: _Run) -> tuple[float, str]:
    """The worst relative difference over a ``length``-token prompt and ``_STEPS`` decode steps, and where.

    ``run.what`` names the forward running (read when one raises).
    """
    from transformers.cache_utils import Cache, StaticLayer

    from devgraph.adapters.hf._compat import cache_kwarg, output_cache, output_field

    kwarg = cache_kwarg(model)
    static = Cache(layers=[StaticLayer(max_cache_len=max_cache_len) for _ in range(num_layers)])
    vocab = model.config.get_text_config(decoder=True).vocab_size
    generator = torch.Generator().manual_seed(length)
    ids = torch.randint(min(3, vocab - 1), vocab, (1, length), generator=generator).to(model.device)
    worst, where = 0.0, ""
    run.what = f"a {length}-token prompt over transformers' dynamic cache"
    dynamic = model(input_ids=ids, use_cache=True)
    cache = output_cache(dynamic)
    if cache is None:
        raise _NoCache(f"{type(dynamic).__name__} has no {output_field()}")
    run.what = f"a {length}-token prompt over a static cache"
    over_static = model(input_ids=ids, use_cache=True, **{kwarg: static})
    pairs = [(f"position {{}} of a {length}-token prompt", over_static.logits, dynamic.logits)]
    for step in range(_STEPS):
        token = dynamic.logits[:, -1:].argmax(-1)
        run.what = f"decode step {step + 1} after a {length}-token prompt over transformers' dynamic cache"
        dynamic = model(input_ids=token, use_cache=True, **{kwarg: cache})
        run.what = f"decode step {step + 1} after a {length}-token prompt over a static cache"
        over_static = model(input_ids=token, use_cache=True, **{kwarg: static})
        cache = output_cache(dynamic)
        if cache is None:
            raise _NoCache(f"{type(dynamic).__name__} has no {output_field()}")
        pairs.append(
            (f"decode step {step + 1} after a {length}-token prompt", over_static.logits, dynamic.logits)
        )
    for label, got, want in pairs:
        if got.shape != want.shape:
            return float("inf"), label.format(
                "any"
            ) + f" (logits {tuple(got.shape)}, eagerly {tuple(want.shape)})"
        relative = _relative(got, want).flatten()
        if not torch.isfinite(relative).all():
            return float("inf"), label.format(int((~torch.isfinite(relative)).nonzero()[0])) + " (not finite)"
        value, index = relative.max(0)
        if float(value) > worst:
            worst, where = float(value), label.format(int(index))
    return worst, where


def failing_line(exc: BaseException) -> str:
    """``"modeling_cpmant.py:129: score = score + position_bias"``: the innermost frame of ``exc``'s
    traceback outside torch's own modules (the model's line; torch's when nothing else is there)."""
    frames = traceback.extract_tb(exc.__traceback__)
    torch_dir = os.path.dirname(torch.__file__)
    outside = [f for f in frames if not f.filename.startswith(torch_dir)] or frames
    if not outside:
        return "an unknown line"
    frame = outside[-1]
    return f"{os.path.basename(frame.filename)}:{frame.lineno}: {(frame.line or '').strip()}"


def _refuse_failed(model: Any, max_cache_len: int, run: _Run, exc: BaseException) -> DevgraphError:
    """The refusal of a model whose forward failed (or returned no cache) during the check."""
    name = type(model).__name__
    if isinstance(exc, _NoCache):
        return DevgraphError(
            f"{name} returned no KV cache from a forward with use_cache=True ({exc}; found at wrap, "
            f"running {run.what}): it recomputes the whole sequence at every step, and every "
            "devgraph mode serves generate() by replaying one token per step over a KV cache, so none serves "
            "this model. model.generate() runs it eagerly: use that"
        )
    return DevgraphError(
        f"{name} failed at wrap, where devgraph runs it eagerly over a static KV cache of "
        f"max_cache_len={max_cache_len} slots and over transformers' dynamic cache to compare them: "
        f"{run.what} raised {type(exc).__name__}: {str(exc).strip()} (at {failing_line(exc)}). Every devgraph "
        "mode serves generate() over such a static cache, so none serves this model. model.generate() "
        "runs it eagerly over its own cache: use that"
    )


def check_static_cache(model: Any, num_layers: int, max_cache_len: int) -> None:
    """Raise ``DevgraphError`` when ``model`` computes other logits over a static cache of
    ``max_cache_len`` slots than over transformers' dynamic cache (see the module docstring).

    Runs the model eagerly on two short random prompts (``4 * (1 + _STEPS)`` forwards, batch 1).
    """
    param = next(model.parameters(), None)
    dtype = param.dtype if param is not None else torch.float32
    tolerance = static_cache_tolerance(dtype)
    lengths = sorted({min(_SHORT, max_cache_len - 1 - _STEPS), min(_LONG, max_cache_len - 1 - _STEPS)})
    run = _Run()
    try:
        with torch.no_grad():
            results = [_compare(model, num_layers, max_cache_len, n, run) for n in lengths if n >= 1]
    except Exception as exc:  # whatever the model's code raises: a refusal by name, not a raw crash
        raise _refuse_failed(model, max_cache_len, run, exc) from exc
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
