"""Hugging Face causal LMs: greedy ``generate()`` whose decode steps replay captured graphs.

``wrap_hf(model, device)`` (what ``devgraph.wrap`` calls for a transformers ``PreTrainedModel``)
returns a ``GraphedCausalLM``. Its ``generate()`` follows transformers' greedy search step by step:

* The prompt is prefilled eagerly by the model's own forward over a ``DynamicCache``: the very call
  ``model.generate()`` makes, so the first new token and the cached keys/values are eager's own.
* Those keys/values are copied into a static KV cache (transformers ``StaticLayer``s, ``max_cache_len``
  slots; one cache per batch-size bucket), and every decode step (one token per row) is served by a
  ``GraphRunner`` replaying the step captured for that bucket. The cache's write position is a device
  tensor the captured step advances itself, so nothing on the host changes between replays.
  Memory: one cache per bucket means KV memory of ``sum(buckets) * max_cache_len`` rows (about 2x the
  largest bucket's with the default powers of two); choose ``batch_sizes`` and ``max_cache_len`` to fit.

Host syncs in transformers' mask code: given a 2-D mask, ``create_causal_mask`` calls
``Tensor.to(device=...)`` and, for dynamic caches, ``bool(tensor)`` on mask values. The captured step
never lets it: it builds the 4-D mask itself from a fixed-width *slot mask* (``[batch, max_cache_len]``,
True where a slot holds a real token of that row: left padding stays masked, future slots are not
yet set) in the form the attention implementation wants (bool for ``sdpa``, additive float for
``eager``), and transformers returns a 4-D mask as is.

Limits: greedy search only. A generation config with logits processors, beams or stop strings, a
batch above the largest bucket, or a prompt plus ``max_new_tokens`` that overflows ``max_cache_len``
runs eager ``model.generate(do_sample=False)`` with a warning (counted in ``stats.fallbacks``).
Decoders must use full attention (sliding windows only when ``max_cache_len`` fits inside them) with
the ``sdpa`` or ``eager`` attention implementation; needs transformers >= 5.
"""

from __future__ import annotations

import threading
from typing import Any

import attrs
import torch
from torch import nn

from devgraph._contract import Device
from devgraph._errors import DevgraphError
from devgraph._plugins import device as _device
from devgraph._wrap import GraphedModule
from devgraph.runner import GraphRunner, RunnerConfig, choose_bucket, make_config
from devgraph.runner._config import positive_ints

__all__ = ["GraphedCausalLM", "HFOptions", "wrap_hf"]

#: RunnerConfig fields a caller may set; the adapter owns the others (arguments, padding, buckets).
RUNNER_OPTIONS = ("strict", "debug", "warmup_iters")

#: Attention implementations whose 4-D mask the decode step knows how to build.
_MASK_KINDS = ("sdpa", "eager")

#: GenerationConfig fields that change greedy search (logits processors, beams, stopping): when one
#: differs from its default, ``generate`` runs eagerly so that its tokens stay those of HF.
_GREEDY_CHANGING_FIELDS = (
    "bad_words_ids",
    "begin_suppress_tokens",
    "encoder_no_repeat_ngram_size",
    "encoder_repetition_penalty",
    "exponential_decay_length_penalty",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "guidance_scale",
    "max_time",
    "min_length",
    "min_new_tokens",
    "no_repeat_ngram_size",
    "num_beams",
    "prefill_chunk_size",
    "remove_invalid_values",
    "renormalize_logits",
    "repetition_penalty",
    "sequence_bias",
    "stop_strings",
    "suppress_tokens",
    "watermarking_config",
)


def _positive(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise DevgraphError(f"{attribute.name} must be a positive integer, got {value!r}")


@attrs.frozen
class HFOptions:
    """The Hugging Face adapter's own options (``devgraph.wrap(model, ..., max_cache_len=512)``).

    Attributes:
        max_batch_size: the largest batch served from graphs (default 8, or the largest of
            ``batch_sizes`` when those are given).
        batch_sizes: the buckets to capture (default ``devgraph.runner.default_batch_sizes``).
        max_cache_len: KV-cache slots per row: a prompt plus ``max_new_tokens - 1`` must fit.
    """

    max_batch_size: int | None = attrs.field(default=None, validator=_positive)
    batch_sizes: tuple[int, ...] | None = attrs.field(
        default=None, converter=lambda v: None if v is None else positive_ints("batch_sizes", v)
    )
    max_cache_len: int = attrs.field(default=256, validator=_positive)

    def runner_sizes(self) -> tuple[tuple[int, ...] | None, int | None]:
        """``(batch_sizes, max_batch_size)`` for RunnerConfig, with the default of 8 applied."""
        if self.batch_sizes is None and self.max_batch_size is None:
            return None, 8
        return self.batch_sizes, self.max_batch_size


def wrap_hf(model: Any, device: str | Device | None = None, **options: Any) -> GraphedCausalLM:
    """Serve ``model``'s greedy decode steps from graphs captured per batch-size bucket on ``device``.

    Args:
        model: a transformers causal LM (``PreTrainedModel`` with ``generate``), already on the
            device's torch device, in eval mode.
        device: a backend name, a ``devgraph.Device``, or None for the best available.
        options: ``max_batch_size``, ``batch_sizes``, ``max_cache_len`` (see ``HFOptions``) and the
            runner options ``strict``, ``debug``, ``warmup_iters`` (see ``RunnerConfig``).
    Raises:
        DevgraphError: an unknown option (the message lists the valid ones), or a model this adapter
            cannot capture (the message says why and what to change).
    """
    dev = device if isinstance(device, Device) else _device(device)
    hf = make_config(HFOptions, options, extra_valid=RUNNER_OPTIONS, what=" for a Hugging Face model")
    batch_sizes, max_batch_size = hf.runner_sizes()
    runner_config = RunnerConfig(
        batch_sizes=batch_sizes,
        max_batch_size=max_batch_size,
        pad_values={"attention_mask": True},  # padded rows attend to every slot: finite, ignored
        **{k: v for k, v in options.items() if k in RUNNER_OPTIONS},
    )
    return GraphedCausalLM(model, dev, hf, runner_config)


class GraphedCausalLM(GraphedModule):
    """A causal LM whose greedy ``generate()`` replays captured decode steps.

    Calling it runs the model eagerly (``graphed(input_ids)`` is ``model(input_ids)``); attributes it
    does not define are the model's own. Graphs are captured on the first ``generate()`` (or by
    ``capture()``); ``stats`` counts replays and eager fallbacks.
    """

    def __init__(self, model: Any, device: Device, options: HFOptions, runner_config: RunnerConfig) -> None:
        _check_model(model, device, options.max_cache_len)
        self.options = options
        step = _DecodeStep(model, options.max_cache_len)
        # generate() reads every step's logits under self._lock: threads may share the wrapper.
        super().__init__(model, GraphRunner(step, device, runner_config, caller_serialises=True))
        self._step = step
        self._lock = threading.RLock()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @property
    def sizes(self) -> list[int]:
        """The batch-size buckets (one captured decode step and one static KV cache each)."""
        return list(self.runner.sizes)

    def capture(self) -> GraphedCausalLM:  # type: ignore[override]
        """Allocate a static KV cache per bucket and capture every bucket's decode step now."""
        with self._lock, torch.no_grad():
            for size in self.runner.sizes:
                self._step.caches[size] = _static_cache(self.module, self.options.max_cache_len)
                self._step(*self._example(size))  # eager: allocate the cache tensors outside capture
            self.runner.capture(*self._example(1))
            for cache in self._step.caches.values():
                cache.reset()  # warm-up and capture wrote into the caches
        return self

    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        max_new_tokens: int = 20,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
    ) -> torch.Tensor:
        """Greedy generation: the tokens and layout of ``model.generate(..., do_sample=False)``.

        Args:
            input_ids: ``[batch, prompt_len]`` prompts (left-padded when their lengths differ).
            attention_mask: ``[batch, prompt_len]``, 0 at padding (inferred as transformers does when
                None).
            max_new_tokens: tokens to generate per row at most.
            eos_token_id, pad_token_id: override the model's generation config; rows that reached
                ``eos_token_id`` are continued with ``pad_token_id`` (default: the first eos token).
        Returns:
            ``[batch, prompt_len + n]`` token ids, prompt first, ``n <= max_new_tokens`` (fewer when
            every row has finished).
        """
        if input_ids.dim() != 2:
            raise DevgraphError(f"input_ids must be [batch, prompt_len], got shape {tuple(input_ids.shape)}")
        if max_new_tokens < 1:
            raise DevgraphError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        batch, prompt_len = input_ids.shape
        why = self._eager_reason(batch, prompt_len, max_new_tokens)
        if why is not None:
            return self._eager_generate(
                why, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id
            )
        with self._lock, torch.no_grad():
            if not self.runner.captured:
                self.capture()
            return self._generate(input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id)

    def __repr__(self) -> str:
        return (
            f"<GraphedCausalLM {type(self.module).__name__} on {self.runner.device}, "
            f"sizes {self.runner.sizes}, max_cache_len {self.options.max_cache_len}>"
        )

    # -- generation ------------------------------------------------------------------------------

    def _generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        max_new_tokens: int,
        eos_token_id: Any,
        pad_token_id: Any,
    ) -> torch.Tensor:
        model = self.module
        dev = model.device
        input_ids = input_ids.to(dev)
        batch, prompt_len = input_ids.shape
        eos, pad = _special_tokens(model.generation_config, eos_token_id, pad_token_id, dev)
        if attention_mask is None:
            attention_mask = _infer_attention_mask(input_ids, eos, pad)
        attention_mask = attention_mask.to(dev)

        # Prefill: transformers' own first forward (positions from the mask, the mask dropped when
        # it has no padding, logits of the last position only).
        position_ids = attention_mask.long().cumsum(-1) - 1
        position_ids = position_ids.masked_fill(attention_mask == 0, 0)
        prefill_mask = None if bool((attention_mask == 1).all()) else attention_mask
        from transformers.cache_utils import DynamicCache

        prefill_cache: Any = DynamicCache(config=model.config.get_text_config(decoder=True))
        out = model(
            input_ids=input_ids.clone(memory_format=torch.contiguous_format),
            attention_mask=prefill_mask,
            position_ids=position_ids,
            past_key_values=prefill_cache,
            use_cache=True,
            return_dict=True,
            **self._step.extra_kwargs,
        )
        logits = out.logits[:, -1]
        del out
        size = choose_bucket(batch, self.runner.sizes)
        assert size is not None  # _eager_reason sent larger batches to eager generate

        slots = torch.zeros(batch, self.options.max_cache_len, dtype=torch.bool, device=dev)
        slots[:, :prompt_len] = attention_mask.bool()
        positions = position_ids[:, -1:]
        unfinished = torch.ones(batch, dtype=torch.long, device=dev)
        sequences = input_ids
        for new in range(1, max_new_tokens + 1):
            next_tokens = logits.float().argmax(dim=-1)
            if eos is not None and pad is not None:  # pad defaults to eos[0]: never None here
                next_tokens = next_tokens * unfinished + pad * (1 - unfinished)
            sequences = torch.cat([sequences, next_tokens[:, None]], dim=-1)
            if eos is not None:
                unfinished = unfinished & ~torch.isin(next_tokens, eos)
                if not bool(unfinished.any()):
                    break
            if new == max_new_tokens:
                break
            if prefill_cache is not None:  # a decode step follows: hand the prompt's keys/values over
                _load_prefill(self._step.caches[size], prefill_cache, batch, prompt_len)
                prefill_cache = None
            positions = positions + 1
            slots[:, prompt_len + new - 1] = True  # the slot this step writes
            logits = self.runner(input_ids=next_tokens[:, None], position_ids=positions, attention_mask=slots)
        return sequences

    def _eager_reason(self, batch: int, prompt_len: int, max_new_tokens: int) -> tuple[str, str] | None:
        if batch > self.runner.sizes[-1]:
            return (
                "batch_too_large",
                f"batch {batch} is above the largest captured bucket ({self.runner.sizes[-1]})",
            )
        need = prompt_len + max_new_tokens - 1
        if need > self.options.max_cache_len:
            return "sequence_too_long", (
                f"prompt {prompt_len} + max_new_tokens {max_new_tokens} needs {need} KV-cache slots, "
                f"max_cache_len is {self.options.max_cache_len}; wrap with a larger max_cache_len"
            )
        config = self.module.generation_config
        default = type(config)()
        changed = [
            f for f in _GREEDY_CHANGING_FIELDS if getattr(config, f, None) != getattr(default, f, None)
        ]
        if changed:
            return (
                "generation_config",
                f"the model's generation_config sets {changed}, which graphed greedy search lacks",
            )
        return None

    def _eager_generate(
        self,
        why: tuple[str, str],
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        max_new_tokens: int,
        eos_token_id: Any,
        pad_token_id: Any,
    ) -> torch.Tensor:
        self.runner.note_fallback(*why)  # raises when strict; counts; warns once per category
        tokens = {
            k: v for k, v in (("eos_token_id", eos_token_id), ("pad_token_id", pad_token_id)) if v is not None
        }
        return self.module.generate(
            input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=max_new_tokens, **tokens
        )

    def _example(self, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dev = self.module.device
        ids = torch.zeros(size, 1, dtype=torch.long, device=dev)
        return ids, ids.clone(), torch.ones(size, self.options.max_cache_len, dtype=torch.bool, device=dev)


class _DecodeStep(nn.Module):
    """One decode step over the static KV cache of its batch's bucket: what the runner captures.

    ``forward(input_ids[B, 1], position_ids[B, 1], attention_mask[B, max_cache_len] bool)`` returns the
    last-position logits ``[B, vocab]``. ``B`` picks the cache (``caches[B]``), so each bucket's graph
    reads and writes its own cache.
    """

    def __init__(self, model: Any, max_cache_len: int) -> None:
        super().__init__()
        self.model = model
        self.max_cache_len = max_cache_len
        self.caches: dict[int, Any] = {}
        self.mask_kind = model.config._attn_implementation or "sdpa"
        self.extra_kwargs = {"logits_to_keep": 1} if model._supports_logits_to_keep() else {}

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        cache = self.caches[input_ids.shape[0]]
        mask = attention_mask[:, None, None, :]  # [B, 1, q=1, kv]: a 4-D mask skips HF's mask code
        if self.mask_kind == "eager":
            dtype = self.model.dtype
            mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
                ~mask, torch.finfo(dtype).min
            )
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=mask,
            past_key_values=cache,
            use_cache=True,
            return_dict=True,
            **self.extra_kwargs,
        )
        return out.logits[:, -1, :]


# -- model checks and caches ---------------------------------------------------------------------


def _check_model(model: Any, device: Device, max_cache_len: int) -> None:
    """Refuse, with the reason and the fix, models whose decode step this adapter cannot capture."""
    name = type(model).__name__
    config = model.config
    if not (hasattr(model, "can_generate") and model.can_generate()) or config.is_encoder_decoder:
        raise DevgraphError(
            f"{name} is not a decoder-only model with generate(); the Hugging Face adapter graphs causal LMs "
            "(AutoModelForCausalLM). Wrap other modules with devgraph.wrap(module) after exposing a "
            "tensor-only forward."
        )
    from transformers.cache_utils import StaticLayer, get_layer_types_and_kwargs

    if not hasattr(StaticLayer(max_cache_len=1), "cumulative_length"):
        raise DevgraphError(
            "the Hugging Face adapter needs transformers >= 5.0 (StaticLayer.cumulative_length)"
        )
    kind = config._attn_implementation or "sdpa"
    if kind not in _MASK_KINDS:
        raise DevgraphError(
            f"{name} uses attn_implementation={kind!r}; the graphed decode step supports "
            f"{list(_MASK_KINDS)}. Load the model with attn_implementation='sdpa'."
        )
    layer_types, layer_kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    for index, (layer_type, kwargs) in enumerate(zip(layer_types, layer_kwargs)):
        window = kwargs.get("sliding_window")
        if layer_type == "full_attention" or (
            layer_type == "sliding_attention" and window is not None and window >= max_cache_len
        ):
            continue  # a window at least as long as the cache never hides a token
        detail = (
            f"sliding window {window}" if layer_type == "sliding_attention" else f"layer type {layer_type!r}"
        )
        fix = (
            f"wrap with max_cache_len <= {window}" if window else "use eager model.generate() for this model"
        )
        raise DevgraphError(
            f"{name} layer {index} has {detail}; the graphed decode step supports full attention only: {fix}"
        )
    param = next(model.parameters(), None)
    if param is not None and param.device.type != torch.device(device.torch_device).type:
        raise DevgraphError(
            f"{name} lives on {param.device}, the devgraph device {device} on {device.torch_device}; "
            f"move it first: model.to({str(device.torch_device)!r})"
        )


def _static_cache(model: Any, max_cache_len: int) -> Any:
    """A transformers ``Cache`` of full-attention ``StaticLayer``s (allocated on the first update)."""
    from transformers.cache_utils import Cache, StaticLayer

    layers = model.config.get_text_config(decoder=True).num_hidden_layers
    return Cache(layers=[StaticLayer(max_cache_len=max_cache_len) for _ in range(layers)])


def _load_prefill(cache: Any, prefill: Any, batch: int, prompt_len: int) -> None:
    """Copy a prefilled ``DynamicCache`` into rows ``:batch``, slots ``:prompt_len`` of a static cache."""
    for static, dynamic in zip(cache.layers, prefill.layers, strict=True):
        static.reset()
        static.keys[:batch, :, :prompt_len].copy_(dynamic.keys)
        static.values[:batch, :, :prompt_len].copy_(dynamic.values)
        static.cumulative_length.fill_(prompt_len)  # in place: the captured steps hold this tensor


def _special_tokens(
    generation_config: Any, eos_token_id: Any, pad_token_id: Any, dev: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(eos ids [n], pad id [])`` as transformers picks them: the pad id defaults to the first eos id."""
    eos = eos_token_id if eos_token_id is not None else generation_config.eos_token_id
    pad = pad_token_id if pad_token_id is not None else generation_config.pad_token_id
    eos_t = None if eos is None else torch.as_tensor(eos, dtype=torch.long, device=dev).reshape(-1)
    pad_t = None if pad is None else torch.as_tensor(pad, dtype=torch.long, device=dev).reshape(())
    if eos_t is not None and eos_t.numel() == 0:
        eos_t = None
    if pad_t is None and eos_t is not None:
        pad_t = eos_t[0]
    return eos_t, pad_t


def _infer_attention_mask(
    input_ids: torch.Tensor, eos: torch.Tensor | None, pad: torch.Tensor | None
) -> torch.Tensor:
    """transformers' rule: mask out ``pad`` tokens when there are some and pad is not an eos token."""
    ones = torch.ones_like(input_ids, dtype=torch.long)
    if pad is None:
        return ones
    pad_in_inputs = bool(torch.isin(input_ids, pad).any())
    pad_is_eos = eos is not None and bool(torch.isin(eos, pad).any())
    return input_ids.ne(pad).long() if pad_in_inputs and not pad_is_eos else ones
