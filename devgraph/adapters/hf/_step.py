"""The decode forward transformers' generation loop calls, served from captured graphs.

``DecodeStep`` is what the ``GraphRunner`` captures per bucket: one token per row over the shared
static cache's first ``bucket`` rows. ``DecodeRoute`` is the callable transformers' ``_sample`` loop
uses for every forward after the prefill (see ``hf.py`` for how it gets there): it recognises a
decode call (one token per row, over the cache devgraph owns, with the 4-D mask(s) that
``prepare_inputs_for_generation`` built eagerly for a static cache) and hands its tensors to the
runner; any other call (a chunked prefill, a call asking for attentions or hidden states) runs the
model eagerly.

Masks: for a static cache transformers builds the 4-D masks outside the model (eager code, here
outside the graph), ``[batch, 1, 1, max_cache_len]`` — a tensor, or a dict per layer type
(``full_attention``/``sliding_attention``) for models that mix them. They reach the graph as plain
tensor arguments ``mask0``, ``mask1``, ... (in ``mask_keys`` order), so no mask code, and none of
its host syncs, runs inside the capture.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
from torch import Tensor, nn

from devgraph._errors import CaptureError, DevgraphError
from devgraph.adapters.hf._cache import SharedStaticCache
from devgraph.adapters.hf._compat import CACHE_KEYS, cache_kwarg, cache_of, causal_lm_output

__all__ = ["DecodeRoute", "DecodeStep", "MAX_MASKS", "attention_mask_of"]

#: Mask tensors a decode step takes (one per attention layer type a model mixes).
MAX_MASKS = 3

#: Decode-call arguments the step reproduces itself; any other argument set makes the call eager.
_DECODE_KEYS = {"input_ids", "position_ids", "attention_mask", *CACHE_KEYS, "use_cache", "return_dict"}
_IGNORED_IF_DEFAULT = {"logits_to_keep": (None, 0, 1), "output_attentions": (None, False)}
_IGNORED_IF_DEFAULT["output_hidden_states"] = (None, False)
_IGNORED_IF_DEFAULT["cache_position"] = (None,)


#: How a step hands its masks to the model: ``(None,)`` for one tensor, else the dict keys.
MaskKeys = tuple[str | None, ...]


class MaskedStep(nn.Module):
    """A model's forward over the shared cache, with its attention masks passed as ``mask0..mask2``.

    What ``DecodeStep`` and the verify step share: ``forward(input_ids, position_ids | None, mask0,
    mask1, mask2)`` hands the masks in use (``len(mask_keys)`` of them) to ``_step``. ``mask_keys``
    says how the masks are handed to the model: ``(None,)`` for one tensor, else the dict keys of
    ``mask0, mask1, ...``; the first call through the route fixes it.
    """

    def __init__(self, model: Any, cache: SharedStaticCache) -> None:
        super().__init__()
        self.model = model
        self.cache = cache
        self.mask_keys: MaskKeys | None = None  # fixed by the first call
        self.cache_kwarg = cache_kwarg(model)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        mask0: torch.Tensor | None = None,
        mask1: torch.Tensor | None = None,
        mask2: torch.Tensor | None = None,
    ) -> torch.Tensor:
        assert self.mask_keys is not None
        return self._step(
            input_ids, position_ids, self.mask_keys, (mask0, mask1, mask2)[: len(self.mask_keys)]
        )

    def _step(self, input_ids: Tensor, position_ids: Tensor | None, keys: MaskKeys, masks: Any) -> Tensor:
        raise NotImplementedError

    def _model(
        self, input_ids: Tensor, position_ids: Tensor | None, attention_mask: Any, cache: Any, **extra: Any
    ) -> Any:
        """The model's forward over ``cache`` (a view of the shared cache), with its output as a dict."""
        return self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            **{self.cache_kwarg: cache},
            use_cache=True,
            return_dict=True,
            **extra,
        )


class DecodeStep(MaskedStep):
    """One decode step over the shared cache's first ``B`` rows: what the runner captures.

    ``forward(input_ids[B, 1], position_ids[B, 1] | None, mask0[B, 1, 1, L], mask1, mask2)`` returns
    the logits ``[B, 1, vocab]`` (``MaskedStep`` says how the masks are handed on).
    """

    def __init__(self, model: Any, cache: SharedStaticCache, extra_kwargs: dict[str, Any]) -> None:
        super().__init__(model, cache)
        self.extra_kwargs = extra_kwargs

    def _step(self, input_ids: Tensor, position_ids: Tensor | None, keys: MaskKeys, masks: Any) -> Tensor:
        attention_mask = attention_mask_of(keys, masks)
        cache = self.cache.view(input_ids.shape[0])
        return self._model(input_ids, position_ids, attention_mask, cache, **self.extra_kwargs).logits


def attention_mask_of(keys: tuple[str | None, ...], masks: Any) -> Any:
    """The model's ``attention_mask`` from the step's mask tensors: the one tensor, or a dict by layer
    type (``keys``: ``mask_structure``'s)."""
    return masks[0] if keys == (None,) else dict(zip(keys, masks, strict=True))


def mask_structure(
    attention_mask: Any, tokens: int = 1
) -> tuple[tuple[str | None, ...], list[torch.Tensor]] | None:
    """``(mask_keys, [B, 1, tokens, L] tensors)`` of a call's mask(s) (a decode step: one token), or
    None when they are not all 4-D with ``tokens`` query rows."""
    if isinstance(attention_mask, torch.Tensor):
        items: list[tuple[str | None, Any]] = [(None, attention_mask)]
    elif isinstance(attention_mask, dict) and 0 < len(attention_mask) <= MAX_MASKS:
        items = sorted(attention_mask.items())
    else:
        return None
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 and t.shape[2] == tokens for _, t in items):
        return None
    return tuple(k for k, _ in items), [t for _, t in items]


@attrs.define(eq=False, slots=False)
class DecodeRoute:
    """The forward transformers calls for each step after the prefill; decode steps replay graphs.

    ``runner`` is a ``GraphRunner`` over ``step``. ``on_eager(reason, detail)`` is told about each
    decode call that had to run eagerly (it counts and warns).
    """

    model: Any
    step: DecodeStep
    runner: Any
    on_eager: Any
    #: a PiecewisePrefill (piecewise modes) or None: prefill runs eagerly
    prefill: Any = None
    #: the runner is a ``TracedModule``: Dynamo traces the step and its graphs capture at the first
    #: call (the state the capture's runs write put back by the graphs' own snapshot)
    traced: bool = False
    #: forwards of one token per row that reached this route (hf.py checks)
    decode_calls: int = attrs.field(default=0, init=False)
    #: forwards of several tokens per row that reached it
    prefill_calls: int = attrs.field(default=0, init=False)
    #: what the last call was: which graphs a CaptureError came from
    stage: str = attrs.field(default="decode", init=False)
    #: a StepLog while devgraph.bisect records a generate (_steplog)
    log: Any = attrs.field(default=None, init=False)

    def __call__(self, **kwargs: Any) -> Any:
        why = self._not_decode(kwargs)
        if why == "prefill":
            self.prefill_calls += 1
            self.stage = "prefill"
            return self.run_prefill(kwargs)
        self.decode_calls += 1
        self.stage = "decode"
        if why is not None:
            self.on_eager(*why)
            return self.model(**kwargs)
        keys, masks = mask_structure(kwargs["attention_mask"])  # type: ignore[misc]
        if self.step.mask_keys is None:
            self.step.mask_keys = keys
        elif keys != self.step.mask_keys:
            self.on_eager(
                "mask_structure",
                f"the decode mask has layer types {keys}, the captured one {self.step.mask_keys}",
            )
            return self.model(**kwargs)
        named = {f"mask{i}": m for i, m in enumerate(masks)}
        if not self.traced and not self.runner.captured:
            self._capture(kwargs["input_ids"], kwargs.get("position_ids"), named)
        call = {"input_ids": kwargs["input_ids"], "position_ids": kwargs.get("position_ids"), **named}
        logits = (
            self.runner(**call) if self.log is None else self.log.decode(self.runner, self.step.cache, call)
        )
        return causal_lm_output(logits, cache_of(kwargs))

    def run_prefill(self, kwargs: dict[str, Any]) -> Any:
        """A forward of several tokens per row: from the pieces when there are some, else eagerly."""
        if self.prefill is None or not self.step.cache.owns(cache_of(kwargs)):
            return self.model(**kwargs)  # full mode: the prefill is eager by design, not a fallback
        self.prefill.fill_missing_mask(kwargs)
        why = self.prefill.can_serve(kwargs)
        if why is not None:
            self.on_eager("prefill_not_piecewise", why)
            return self.model(**kwargs)
        runner = self.prefill.runner
        try:
            return self.prefill(kwargs)
        except CaptureError:
            raise
        except DevgraphError as err:
            if runner.captured:
                raise
            # The pieces could not be built (Dynamo could not trace the forward, a pass refused the
            # graph): a refusal of the prefill like a CaptureError, said once; later calls prefill
            # eagerly instead of tracing again (and raising again) at every call.
            raise CaptureError(str(err)) from err

    def _capture(self, input_ids: torch.Tensor, position_ids: Any, masks: dict[str, torch.Tensor]) -> None:
        # Warm-ups and captures of every bucket advance the cache's write positions and write the slots
        # they pass: from the prompt's end they would run past the cache's last slot (a prompt near
        # max_cache_len). They run from slot 0 instead, and the whole cache is put back after.
        cache = self.step.cache
        saved = cache.snapshot()
        try:
            for layer in cache.base.layers:
                layer.cumulative_length.zero_()
            self.runner.capture(input_ids=input_ids, position_ids=position_ids, **masks)
        finally:
            cache.restore(saved)

    def _not_decode(self, kwargs: dict[str, Any]) -> tuple[str, str] | str | None:
        ids = kwargs.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] != 1:
            return "prefill"
        if not self.step.cache.owns(cache_of(kwargs)):
            return "prefill"
        extra = sorted(
            k
            for k, v in kwargs.items()
            if k not in _DECODE_KEYS and not (k in _IGNORED_IF_DEFAULT and v in _IGNORED_IF_DEFAULT[k])
        )
        if extra:
            return (
                "decode_arguments",
                f"the decode step was called with {extra}, which the graph does not take",
            )
        if mask_structure(kwargs.get("attention_mask")) is None:
            return (
                "mask_structure",
                "the decode mask is not a 4-D tensor (or a dict of them) for a static cache",
            )
        return None
