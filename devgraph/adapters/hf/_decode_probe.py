"""Wrap-time dry run of the decode step: run eagerly as its graph would run, under the capture check.

Every devgraph mode replays each decode step as one graph (the modes differ in the prefill only). A
model whose decode step makes the host read a device value cannot be captured in any mode:
mixture-of-experts layers that route on the host (JetMoE's ``expert_size.tolist()``; DBRX and
LongCat-Flash loop over the experts ``nonzero()`` finds, and on the CPU their ``one_hot(top_k_index,
num_classes=...)`` checks the indices on the host first), or a branch on a device value (XGLM).
Found only at the first capture, that refused the first ``generate``, and in the piecewise and
breakable modes the prefill pieces first, with a message that sent the user to ``mode='full'``,
which then failed the same way at decode.

``probe_decode_step`` finds it at wrap, by mechanism: a short greedy ``generate`` through devgraph's
own decode route over a one-row static cache (the layout of devgraph's shared cache, the masks built
by transformers outside the step, as for the graphs), whose decode steps run the captured module
(``DecodeStep``) eagerly; the first is a warm-up (a capture has those too), the second runs under
``devgraph.graph.host_sync_check``, the capture check without a capture. What the check refuses there
a capture refuses too, on every device; what only a recording finds (Falcon's index list, made inside
the capture and freed when it ends) is still found at the first capture.

Cost: one eager prefill of 3 tokens and 2 decode steps, batch 1, and a one-row cache of
``max_cache_len`` slots while it runs (the static-cache check allocates the same).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from devgraph._errors import CaptureError, DevgraphError
from devgraph.adapters.hf._cache import SharedStaticCache
from devgraph.adapters.hf._compat import cache_kwarg
from devgraph.adapters.hf._refusal import refusal
from devgraph.adapters.hf._route import decode_route, route_config
from devgraph.adapters.hf._static_check import failing_line
from devgraph.adapters.hf._step import DecodeRoute, DecodeStep
from devgraph.graph import host_sync_check

__all__ = ["probe_decode_step"]

#: New tokens the probe generates: the prefill's, a warm-up decode step, a checked one.
_NEW = 3


class _CheckedStep:
    """What the route calls in place of the decode step's ``GraphRunner``: the step, run eagerly; from
    the second call on under the capture check of ``device_type``."""

    captured = True  # the route captures nothing

    def __init__(self, step: DecodeStep, device_type: str) -> None:
        self.step = step
        self.device_type = device_type
        self.calls = 0

    def __call__(self, **kwargs: Any) -> torch.Tensor:
        self.calls += 1
        if self.calls == 1:  # the warm-up: lazy initialisation a capture's warm-ups would absorb
            return self.step(**kwargs)
        with host_sync_check(self.device_type):
            return self.step(**kwargs)


def probe_decode_step(
    model: Any,
    num_layers: int,
    max_cache_len: int,
    extra_kwargs: dict[str, Any],
    device_type: str,
    shadow: bool,
) -> None:
    """Raise when ``model``'s decode step cannot be captured in any mode (see the module docstring).

    Args:
        extra_kwargs: what the decode step passes besides the cache (``logits_to_keep``).
        device_type: the torch device type devgraph captures on.
        shadow: reach the route by shadowing ``get_compiled_call`` (``decode_hook_reachable`` is False).
    Raises:
        CaptureError: the decode step does what a capture refuses; the message names the op and the
            model's line, and eager ``model.generate()``, which runs it.
        DevgraphError: the probe's ``generate`` failed otherwise (named, with the model's line).
    """
    prompt = min(3, max_cache_len - _NEW + 1)
    if prompt < 1:
        return  # a cache too short for a prompt and two decode steps: such calls run eagerly anyway
    cache = SharedStaticCache(num_layers, 1, max_cache_len)
    step = DecodeStep(model, cache, extra_kwargs)
    runner = _CheckedStep(step, device_type)
    route = DecodeRoute(model, step, runner, on_eager=lambda *why: None)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(min(3, vocab - 1), vocab, (1, prompt), generator=generator).to(model.device)
    config = route_config()
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter(
                "ignore"
            )  # transformers' notes about generation settings: not the user's call
            cache.allocate(model, extra_kwargs)
            with decode_route(model, route, config, shadow=shadow):
                model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=False,
                    num_beams=1,
                    num_return_sequences=1,
                    max_new_tokens=_NEW,
                    min_new_tokens=_NEW,  # no early end of sequence: both decode steps run
                    use_cache=True,
                    cache_implementation=None,
                    compile_config=config,
                    **{cache_kwarg(model): cache.view(1)},
                )
    except CaptureError as err:
        raise refusal(model, err, "decode", at_wrap=True) from None
    except DevgraphError:
        raise
    except Exception as exc:  # the model's own code failed: a refusal by name, not a raw crash
        raise DevgraphError(
            f"{type(model).__name__} failed at wrap, where devgraph runs a short greedy generate() whose decode "
            f"steps run as its graphs would (a one-row static cache of max_cache_len={max_cache_len} slots, "
            f"eagerly): {type(exc).__name__}: {str(exc).strip()} (at {failing_line(exc)}). Every devgraph mode "
            "serves generate() this way, so none serves this model. model.generate() runs it eagerly over its "
            "own cache: use that"
        ) from exc
