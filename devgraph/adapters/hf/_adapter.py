"""Hugging Face causal LMs: transformers' own ``generate()`` with decode steps replayed from graphs.

``wrap_hf(model, device)`` (what ``devgraph.wrap`` calls for a transformers ``PreTrainedModel``)
returns a ``GraphedCausalLM``. Its ``generate(...)`` takes everything ``model.generate`` takes and
runs ``model.generate`` itself — transformers' loop, logits processors, stopping criteria,
``streamer``, ``generation_config``, sampling — with two differences:

* the KV cache is devgraph's: one static cache (transformers ``StaticLayer``s, ``max_cache_len``
  slots) for the largest bucket, shared by every bucket; a batch of ``n`` rows prefills into its
  first ``n`` rows (``SharedStaticCache``);
* every decode forward (one token per row) is served from the graph captured for the batch's
  bucket (``DecodeRoute``/``DecodeStep``): by default the step is traced by Dynamo, which guards what
  it reads, and devgraph captures the graph Dynamo hands over (``frontend='dynamo'``, a
  ``TracedModule`` of the step); ``frontend='raw'`` captures it as it runs with a ``GraphRunner``
  (untraced, warned once). The prefill runs eagerly (or,
  with ``mode="piecewise"``/``"full_and_piecewise"``, from pieces split at attention; with
  ``mode="breakable"``/``"full_and_breakable"``, from breakable graphs cut at attention).

How the decode forward reaches devgraph: transformers' ``_sample`` loop calls
``model.get_compiled_call(generation_config.compile_config)`` for every step after the prefill when
the cache is a compilable (static) one; that method returns the instance's ``_compiled_call`` when
it was made for an equal ``compile_config``. For the duration of one ``generate`` (under a lock)
devgraph sets that per-instance attribute to its route and passes its own ``CompileConfig`` (a
backend name torch.compile does not know, so nothing is ever compiled by mistake); the model's
own attributes are put back afterwards. Where a model type's ``get_compiled_call`` ignores them
(``llama4``: ``decode_hook_reachable`` is False at wrap), devgraph shadows that method on the
instance for the same duration (``_route``). Nothing in transformers or torch is patched. In the
piecewise modes devgraph also sets ``prefill_chunk_size`` to ``max_cache_len``: transformers sends
a chunked prefill (here: one chunk, the whole prompt) through the same hook.

Assisted generation (one row) with candidates from prompt lookup or from an assistant model devgraph
wrapped calls the models themselves: for one ``generate`` each instance's ``forward`` is devgraph's
route (``_route.forward_route``), whose steps of 1 to candidates + 1 tokens replay a graph per token
count (``_verify``). Calls the decode step cannot serve (beam search and other decoding methods, a cache or
``compile_config`` of your own, attentions or hidden states as outputs, a batch above the largest
bucket, a sequence longer than ``max_cache_len``) run plain ``model.generate`` with a one-time
warning naming the option, counted in ``stats.fallbacks`` (``strict=True`` raises instead). A
decode step that cannot be captured raises a ``CaptureError`` once, said for the model's user
(``_refusal``); later calls run eagerly as ``capture_refused``. Needs transformers >= 5 and attention layers only (full, sliding-window or chunked).
At wrap the model runs a few short prompts eagerly over a static cache and over transformers' dynamic
cache; a model whose attention depends on the cache's length (GPT-Neo), whose forward fails there
(CPM-Ant) or that keeps no KV cache (GPT-1) is refused there (``_static_check``). Then one short greedy
``generate`` runs its decode steps eagerly as the graphs would, the second under the capture check: a
decode step that reads device values on the host (mixture-of-experts layers routing on the host:
JetMoE, DBRX, LongCat-Flash) cannot be captured in any mode and is refused there (``_decode_probe``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

import attrs
import torch

from devgraph._errors import CaptureError, DevgraphError
from devgraph._fallback_fixes import fallback_fix
from devgraph._plugins import device as _device
from devgraph._source import user_stacklevel
from devgraph.adapters.hf import _moe
from devgraph.adapters.hf._cache import SharedStaticCache
from devgraph.adapters.hf._checks import decode_hook_reachable, position_bias_source
from devgraph.adapters.hf._compat import cache_kwarg
from devgraph.adapters.hf._decode_probe import probe_decode_step
from devgraph.adapters.hf._plan import eager_reason, new_tokens, read_generate_call, speculation, verify_room
from devgraph.adapters.hf._prefill import PiecewisePrefill
from devgraph.adapters.hf._refusal import refusal
from devgraph.adapters.hf._route import decode_route, forward_route, route_config
from devgraph.adapters.hf._static_check import check_static_cache
from devgraph.adapters.hf._step import MAX_MASKS, DecodeRoute, DecodeStep
from devgraph.adapters.hf._steplog import MAX_STEPS, StepLog
from devgraph.adapters.hf._verify import SpeculativeStats, Verifier, VerifyStats, VerifyStep
from devgraph.frontend import wrap_traced
from devgraph.graph import Device
from devgraph.runner import (
    MODE_TABLE,
    GraphedModule,
    GraphRunner,
    RunnerConfig,
    make_config,
    normalise_batch_sizes,
    positive_ints,
)

__all__ = ["GraphedCausalLM", "HFOptions", "wrap_hf"]

logger = logging.getLogger("devgraph")


def _transformers_version() -> str:
    from transformers import __version__

    return __version__


#: RunnerConfig fields a caller may set; the adapter owns the others (arguments, padding, buckets).
RUNNER_OPTIONS = ("strict", "debug", "warmup_iters", "process_group", "check_ranks")

#: Attention layer types whose keys/values a full-length ``StaticLayer`` holds (transformers'
#: mask code hides what a sliding or chunked layer must not see).
_ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")

# Modes (``MODE_TABLE``): ``full`` prefills eagerly; the piecewise ones prefill from pieces, the
# breakable ones from breakable graphs (cut at attention, no trace). Decode is always full graphs.

#: CompileConfig fields for the piecewise prefill (``is_decode`` is the adapter's own business).
_COMPILE_OPTIONS = (
    "splitting_ops",
    "compile_backend",
    "passes",
    "capture_sizes",
    "capture_budget",
    "traffic",
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
    """Serve ``model.generate``'s decode steps from graphs captured per batch-size bucket on ``device``.

    Args:
        model: a transformers causal LM (``PreTrainedModel`` with ``generate``), already on the
            device's torch device, in eval mode.
        device: a backend name, a ``devgraph.Device``, or None for the best available.
        options: ``max_batch_size``, ``batch_sizes``, ``max_cache_len`` (see ``HFOptions``) and the
            runner options ``strict``, ``debug``, ``warmup_iters``, ``process_group``, ``check_ranks``
            (see ``RunnerConfig``).
    Raises:
        DevgraphError: an unknown option (the message lists the valid ones), or a model this adapter
            cannot capture (the message says why and what to change).
    """
    dev = device if isinstance(device, Device) else _device(device)
    frontend = options.pop("frontend", "dynamo")
    if frontend not in ("dynamo", "raw"):
        raise DevgraphError(
            "frontend must be 'dynamo' (each decode step traced by Dynamo, its graphs captured; the default) "
            f"or 'raw' (the decode step captured as it runs, untraced), got {frontend!r}"
        )
    mode = options.pop("mode", "full")
    if mode not in MODE_TABLE:
        raise DevgraphError(f"mode must be one of {list(MODE_TABLE)} for a Hugging Face model, got {mode!r}")
    compile_options = {k: options.pop(k) for k in list(options) if k in _COMPILE_OPTIONS}
    if compile_options and MODE_TABLE[mode].serves != "pieces":
        raise DevgraphError(
            f"option(s) {sorted(compile_options)} apply to the piecewise prefill: add mode='piecewise' or drop them"
        )
    hf = make_config(
        HFOptions,
        options,
        extra_valid=RUNNER_OPTIONS + _COMPILE_OPTIONS + ("mode",),
        what=" for a Hugging Face model",
    )
    batch_sizes, max_batch_size = hf.runner_sizes()
    runner_config = RunnerConfig(
        batch_sizes=batch_sizes,
        max_batch_size=max_batch_size,
        pad_values={f"mask{i}": True for i in range(MAX_MASKS)},  # padded rows see every slot: finite
        # Each row of the decode step reads and writes only its own cache row, and the logits are per
        # row (tests cross buckets): no padding check, whose extra eager steps would also move the
        # cache's write positions past a short cache.
        check_padding=False,
        **{k: v for k, v in options.items() if k in RUNNER_OPTIONS},
    )
    prefill = None
    if MODE_TABLE[mode].serves == "breakable":
        prefill = _breakable_prefill_factory(dev, hf, runner_config)
    elif MODE_TABLE[mode].serves == "pieces":
        prefill = _prefill_factory(dev, hf, runner_config, compile_options)
    return GraphedCausalLM(model, dev, hf, runner_config, prefill, frontend)


def _traced_options(config: RunnerConfig) -> dict[str, Any]:
    """``config`` as the options of ``wrap_traced`` (the fields the adapter or its caller set)."""
    default = RunnerConfig()
    return {
        f.name: getattr(config, f.name)
        for f in attrs.fields(RunnerConfig)
        if getattr(config, f.name) != getattr(default, f.name)
    }


def _prefill_factory(dev: Device, hf: HFOptions, runner_config: RunnerConfig, options: dict[str, Any]) -> Any:
    """A function building the prefill's piecewise ``GraphRunner`` for a ``PrefillRow``."""
    from devgraph.runner import piecewise_runner

    options = {
        "splitting_ops": ("aten::scaled_dot_product_attention",),
        "passes": (),  # exactness first: a fused norm rounds differently from the model's own
        "capture_sizes": _prefill_sizes(hf.max_cache_len),
        **options,
    }
    config = attrs.evolve(runner_config, mode="piecewise", batch_sizes=None, max_batch_size=None)

    def build(row: Any) -> Any:
        # Always last, whatever passes the caller chose: without it a mixture-of-experts piece would
        # replay the routing of capture time (see _moe).
        routing = _moe.GroupedMmRouting(_moe.eager_uses_grouped_mm(row.model))
        passes = options["passes"]
        named = {**options, "passes": (*(() if passes is None else passes), routing)}
        if passes is None:  # None: the built-in and contributed passes, then the routing rewrite
            from devgraph.compile.passes import builtin_passes, contributed_passes

            named["passes"] = (*builtin_passes(), *contributed_passes(dev), routing)
        return piecewise_runner(row, dev, config, **named)

    return build


def _breakable_prefill_factory(dev: Device, hf: HFOptions, runner_config: RunnerConfig) -> Any:
    """A function building the prefill's breakable ``GraphRunner`` for a ``PrefillRow``: one breakable
    capture per prompt-length size, attention (``F.scaled_dot_product_attention``) run eagerly between
    the segments; nothing traced, so no routing rewrite is needed for mixture-of-experts models."""
    config = attrs.evolve(
        runner_config,
        mode="breakable",
        breaks=("aten::scaled_dot_product_attention",),
        batch_sizes=_prefill_sizes(hf.max_cache_len),
        max_batch_size=None,
    )
    return lambda row: GraphRunner(row, dev, config)


def _prefill_sizes(max_cache_len: int) -> tuple[int, ...]:
    """Prompt lengths to capture the pieces for: powers of two from 16, and ``max_cache_len``."""
    sizes, size = [], 16
    while size < max_cache_len:
        sizes.append(size)
        size *= 2
    return (*sizes, max_cache_len)


class GraphedCausalLM(GraphedModule):
    """A causal LM whose ``generate()`` is transformers' own, with decode steps replayed from graphs.

    Calling it runs the model eagerly (``graphed(input_ids)`` is ``model(input_ids)``, counted in
    ``stats.fallbacks["forward_not_graphed"]`` with a one-time warning); attributes it
    does not define are the model's own. Graphs are captured on the first graphed decode step (or
    by ``capture()``); ``stats`` counts replays and eager fallbacks by reason.
    """

    #: the decode steps' server: a ``TracedModule`` of the step (``frontend='dynamo'``, the default:
    #: Dynamo traces each step, its graphs are captured per bucket) or a ``GraphRunner`` (``'raw'``)
    runner: Any

    def __init__(
        self,
        model: Any,
        device: Device,
        options: HFOptions,
        runner_config: RunnerConfig,
        prefill_factory: Any = None,
        frontend: str = "dynamo",
    ) -> None:
        layers = _check_model(model, device)
        check_static_cache(model, layers, options.max_cache_len)
        extra = {"logits_to_keep": 1} if model._supports_logits_to_keep() else {}
        # transformers returns the plain forward for some model types (llama4): reach the route by
        # shadowing get_compiled_call on this instance during generate instead.
        self._shadow_hook = not decode_hook_reachable(model)
        probe_decode_step(
            model, layers, options.max_cache_len, extra, device.torch_device.type, shadow=self._shadow_hook
        )
        self.options = options
        #: the batch-size buckets (one decode graph each, all over one shared KV cache)
        self._sizes = tuple(normalise_batch_sizes(runner_config.batch_sizes, runner_config.max_batch_size))
        self.cache = SharedStaticCache(layers, self._sizes[-1], options.max_cache_len)
        step = DecodeStep(model, self.cache, extra)
        # generate() reads every step's logits under self._lock: threads may share the wrapper.
        runner: Any
        if frontend == "dynamo":
            runner = wrap_traced(step, device, _traced_options(runner_config), caller_serialises=True)
            # a mixture-of-experts layer's grouped matmul, as Dynamo traces it, routes on the host:
            # rewritten to the op eager runs (or the graph runs as traced, eagerly; see _moe)
            runner.graphs.graph_passes = (_moe.GroupedMmRouting(_moe.eager_uses_grouped_mm(model)),)
        else:
            runner = GraphRunner(step, device, runner_config, caller_serialises=True)
        super().__init__(model, runner)
        self._step = step
        self.prefill = (
            None if prefill_factory is None else PiecewisePrefill(model, self.cache, prefill_factory)
        )
        self._route = DecodeRoute(
            model, step, self.runner, self.runner.note_fallback, self.prefill, traced=frontend == "dynamo"
        )
        #: why the decode step (the prefill pieces, the verify step) could not be captured; such calls
        #: then run eagerly
        self.refused: str | None = None
        self.prefill_refused: str | None = None
        self.verify_refused: str | None = None
        self._device = device
        self._frontend = frontend
        self._runner_config = runner_config
        #: assisted generation's steps (prompt lookup, an assistant model): the model's forward during
        #: such a generate
        self.verify = Verifier(model, self.cache, self._verify_runner, self.runner.note_fallback)
        self._lock = threading.RLock()
        if self._shadow_hook:
            logger.info(
                "devgraph: %s.get_compiled_call ignores the per-instance compiled call in transformers %s; "
                "devgraph shadows it on this instance during generate() to reach its decode step",
                type(model).__name__,
                _transformers_version(),
            )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``model(*args, **kwargs)``, eagerly: only ``generate()`` is graphed (counted and warned once)."""
        self.runner.note_fallback(
            "forward_not_graphed",
            "calling the wrapper runs the model's forward eagerly; only generate() replays graphs (or "
            "devgraph.wrap a module whose forward takes and returns tensors)",
        )
        return self.module(*args, **kwargs)

    def _verify_runner(self, step: VerifyStep, sizes: tuple[int, ...]) -> Any:
        """The verify graphs' server for ``step``: one graph per token count in ``sizes``."""
        config = attrs.evolve(self._runner_config, batch_sizes=sizes, max_batch_size=None)
        if self._frontend == "raw":
            return GraphRunner(step, self._device, config, caller_serialises=True)
        runner = wrap_traced(step, self._device, _traced_options(config), caller_serialises=True)
        runner.graphs.graph_passes = (_moe.GroupedMmRouting(_moe.eager_uses_grouped_mm(self.module)),)
        return runner

    def _drop_graphs(self) -> None:
        """The model was cast, moved or flipped: drop the graphs and the caches sized for it."""
        with self._lock:
            self.runner.reset()
            self.verify.reset()
            self.cache.release()
            if self.prefill is not None:
                self.prefill.runner.reset()
                self.prefill.scratch.release()

    @property
    def prefill_stats(self) -> Any:
        """The prefill's counters (``PiecewiseStats``; ``BreakableStats`` in the breakable modes), or
        None in ``mode="full"``."""
        return None if self.prefill is None else self.prefill.runner.stats

    @property
    def sizes(self) -> list[int]:
        """The batch-size buckets (one captured decode step each, all over one shared KV cache)."""
        return list(self._sizes)

    def capture(self) -> GraphedCausalLM:  # type: ignore[override]
        """Capture every bucket's decode step (and the prefill pieces) now: a short greedy generation.

        Call it right after ``wrap`` to learn at once whether the model can be captured.

        Raises:
            CaptureError: the model's decode step (or prefill pieces) cannot be captured: the message
                names the model's module and line and what to do.
            DevgraphError: an earlier capture was refused already (the message repeats why).
        """
        if self.refused is not None:
            raise DevgraphError(f"{self.refused}. Fix: {fallback_fix('capture_refused')}")
        with self._lock:
            if not self.runner.captured or (self.prefill is not None and not self.prefill.runner.captured):
                ids = torch.zeros(1, 2, dtype=torch.long, device=self.module.device)
                self.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=2)
        return self

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """``model.generate(*args, **kwargs)``, its decode steps replayed from graphs.

        Takes and returns exactly what ``PreTrainedModel.generate`` does. Calls devgraph cannot
        serve run ``model.generate`` eagerly (see the module docstring), warned about once per
        reason and counted in ``stats.fallbacks``; with ``strict=True`` they raise ``DevgraphError``.
        With ``return_dict_in_generate=True`` the returned ``past_key_values`` is a view of
        devgraph's shared cache: the next ``generate`` overwrites it.
        """
        model = self.module
        call = read_generate_call(args, kwargs)
        _check_inputs(call.named, model)
        why, config = eager_reason(
            model, call, self._sizes[-1], self.options.max_cache_len, graphed=self._serves_assistant
        )
        assisted = speculation(config, call) if why is None else None
        if why is None and self.refused is not None:
            why = ("capture_refused", self.refused)
        if why is None and assisted is not None:
            why = self._assisted_reason(call, config, assisted)
        if why is not None:
            self.runner.note_fallback(*why)  # raises when strict; counts; warns once per reason
            assistant = call.named.get("assistant_model")
            if isinstance(assistant, GraphedCausalLM):  # eager transformers drafts with the model itself
                return model.generate(**{**call.named, "assistant_model": assistant.module})
            return model.generate(*args, **kwargs)
        assert call.input_ids is not None  # eager_reason sends calls without input_ids to eager
        rows = call.input_ids.shape[0] * max(config.num_return_sequences or 1, 1)
        with self._lock, torch.no_grad():
            self.cache.allocate(model, self._step.extra_kwargs)
            self.cache.reset()
            if assisted is not None:
                return self._generate_assisted(call, config, rows, assisted)
            fields: dict[str, Any] = {"compile_config": route_config()}
            if config.cache_implementation is not None:  # "static" from the model's config: ours is static
                fields["cache_implementation"] = None
            self._route.prefill = self.prefill
            if self.prefill is not None and self.prefill_refused is not None:
                self.runner.note_fallback("capture_refused", self.prefill_refused)
                self._route.prefill = None
            elif self.prefill is not None:
                if config.prefill_chunk_size is None:
                    # transformers sends a chunked prefill through the decode hook (a plain one calls
                    # the model directly): one chunk as long as the cache is the whole prompt.
                    fields["prefill_chunk_size"] = self.options.max_cache_len
                else:  # later chunks start mid-cache; the pieces prefill from slot 0
                    self.runner.note_fallback(
                        "prefill_chunk_size",
                        "prefill_chunk_size: chunked prefills run eagerly, decode from graphs",
                    )
                    self._route.prefill = None
            named = _with_fields(call, fields)
            decodes, prefills = self._route.decode_calls, self._route.prefill_calls
            try:
                with decode_route(model, self._route, fields["compile_config"], shadow=self._shadow_hook):
                    out = model.generate(**named, **{cache_kwarg(model): self.cache.view(rows)})
            except CaptureError as err:
                raise self._refuse(err, self._route.stage) from None
            self._check_hook_reached(out, call.input_ids.shape[1], decodes, prefills)
            return out

    def _serves_assistant(self, assistant: Any) -> bool:
        """Whether ``assistant_model=assistant`` drafts from graphs: a wrapper of another model."""
        return isinstance(assistant, GraphedCausalLM) and assistant.module is not self.module

    def _assisted_reason(self, call: Any, config: Any, kind: str) -> tuple[str, str] | None:
        """Why an assisted generate (``kind``: ``"prompt_lookup"`` or ``"assistant"``) runs eagerly, or None."""
        if self.verify_refused is not None:
            return ("capture_refused", self.verify_refused)
        prompt = call.input_ids.shape[1]
        new = new_tokens(config, prompt)
        assistant = call.named.get("assistant_model")
        candidates = config.prompt_lookup_num_tokens if assistant is None else _draft_tokens(assistant.module)
        why = verify_room(
            prompt, new, self.verify.tokens_for(candidates), self.options.max_cache_len, "the model's"
        )
        if why is not None or assistant is None:
            return why
        refused = assistant.refused or assistant.verify_refused
        if refused is not None:
            return ("capture_refused", f"the assistant_model: {refused}")
        return verify_room(
            prompt,
            new,
            assistant.verify.tokens_for(_DRAFT_STEP - 1),
            assistant.options.max_cache_len,
            "the assistant's",
        )

    def _generate_assisted(self, call: Any, config: Any, rows: int, kind: str) -> Any:
        """An assisted ``generate``: the steps of this model (and of a wrapped assistant) from graphs.

        Called under the lock with the cache reset. transformers' assisted loop calls the models
        themselves: for this call each instance's ``forward`` is its wrapper's ``Verifier``
        (``forward_route``), put back afterwards (``_verify``).
        """
        model = self.module
        prompt = call.input_ids.shape[1]
        fields: dict[str, Any] = {}
        if config.cache_implementation is not None:  # "static" from the model's config: ours is static
            fields["cache_implementation"] = None
        assistant = call.named.get("assistant_model") if kind == "assistant" else None
        if assistant is not None:
            # The assistant's generate calls copy this call's generation config: no compiled call for
            # them on any device, so that every forward of the assistant is its model's own call.
            fields["disable_compile"] = True
        named = _with_fields(call, fields)
        with contextlib.ExitStack() as stack:
            if assistant is not None:
                named["assistant_model"] = assistant.module
                stack.enter_context(assistant._lock)
                assistant.cache.allocate(assistant.module, assistant._step.extra_kwargs)
                assistant.cache.reset()
                assistant.verify.prepare(_DRAFT_STEP - 1)
                assistant.verify.begin(prompt, draft=True)
                stack.callback(assistant.verify.end)
                stack.enter_context(forward_route(assistant.module, assistant.verify))
                candidates = _draft_tokens(assistant.module)
            else:
                candidates = config.prompt_lookup_num_tokens
            self.verify.prepare(candidates)
            self.verify.begin(prompt)
            stack.callback(self.verify.end)
            calls = self.verify.calls
            try:
                with forward_route(model, self.verify):
                    out = model.generate(**named, **{cache_kwarg(model): self.cache.view(rows)})
            except CaptureError as err:
                if assistant is not None and assistant.verify.raised:
                    raise assistant._refuse(err, assistant.verify.stage) from None
                raise self._refuse(err, self.verify.stage) from None
        if self.verify.calls == calls:
            from transformers import __version__

            self.runner.note_fallback(
                "decode_hook_not_reached",
                f"transformers {__version__}'s assisted generate() ran without calling {type(model).__name__}'s "
                "forward (devgraph set the instance's forward to its verify route for the call); every step ran "
                "eagerly",
            )
        return out

    @property
    def speculative_stats(self) -> SpeculativeStats:
        """Counters of assisted generation (prompt lookup, an assistant model): steps from graphs and
        eagerly, candidate tokens proposed and accepted (``acceptance``)."""
        return self.verify.stats

    @property
    def verify_stats(self) -> VerifyStats | None:
        """The verify graphs' counters, added up over their runners (``VerifyStats``), or None before
        the first assisted generate."""
        return (
            VerifyStats.of([runner.stats for runner in self.verify.runners]) if self.verify.runners else None
        )

    def served_steps(self, *args: Any, max_steps: int = MAX_STEPS, **kwargs: Any) -> Any:
        """Run ``generate(*args, **kwargs)`` once, recording each step served from graphs (what
        ``devgraph.bisect(graphed, input_ids, **generate_kwargs)`` bisects; a ``devgraph.debug.StepsServed``).

        Greedy (``do_sample=False``) and ``max_new_tokens=4`` unless the call (or its
        ``generation_config``) says otherwise. Each step is the prefill's graphs for one prompt row
        (piecewise and breakable modes) or one decode step; the first ``max_steps`` are recorded, each
        with a copy of the whole KV cache from before it (later steps run unrecorded, said in a note).
        """
        from devgraph.debug import StepsServed

        if "generation_config" not in kwargs:
            kwargs.setdefault("do_sample", False)
            if "max_length" not in kwargs:
                kwargs.setdefault("max_new_tokens", 4)
        caches = [self.cache] + ([self.prefill.scratch] if self.prefill is not None else [])
        log = StepLog(caches, max_steps)
        before, assisted = self._fallbacks(), self.verify.calls
        with self._lock:
            self._route.log = log
            if self.prefill is not None:
                self.prefill.log = log
            try:
                self.generate(*args, **kwargs)
            finally:
                self._route.log = None
                if self.prefill is not None:
                    self.prefill.log = None
        reasons = sorted({k for k, v in self._fallbacks().items() if v != before.get(k, 0)})
        eager = [f"{r} (Fix: {fallback_fix(r)})" for r in reasons]
        if self.refused is not None:
            eager.append(self.refused)
        notes = []
        if log.unrecorded:
            notes.append(
                f"only the first {max_steps} steps were recorded and compared ({log.unrecorded} later steps "
                "were not): served_steps(max_steps=...) through devgraph.bisect is not offered; generate fewer "
                "tokens (max_new_tokens) to reach a step, or bisect from the step you suspect"
            )
        if reasons:
            notes.append(f"steps or calls that ran eagerly during the generate: {reasons}")
        if self.verify.calls != assisted:
            notes.append(
                "assisted generation (prompt_lookup_num_tokens, assistant_model): its steps are not recorded; "
                "bisect the same call without them"
            )
        if self.prefill is None:
            notes.append("mode='full': the prefill runs eagerly, so only the decode steps are compared")
        return StepsServed(f"{type(self.module).__name__} generate()", log.steps, eager, notes)

    def _fallbacks(self) -> dict[str, int]:
        """The decode steps' and the prefill's fallbacks by reason, added up (read anew: a traced
        step's stats are a new object at each read)."""
        total = dict(self.runner.stats.fallbacks)
        if self.prefill is not None:
            for reason, n in self.prefill.runner.stats.fallbacks.items():
                total[reason] = total.get(reason, 0) + n
        return total

    def _refuse(self, err: CaptureError, stage: str) -> CaptureError:
        """Remember that the decode step (the prefill pieces, the verify step) cannot be captured; the
        error to raise.

        Later calls run eagerly, counted as ``capture_refused``, instead of failing the same way again.
        """
        better = refusal(self.module, err, stage)
        first = better.message.split(": ", 1)[0]
        at = f" at {better.source.split(': ', 1)[0]}" if better.source else ""
        op = f"op {better.op}{at}; " if better.op else ""
        summary = f"{first} ({op}the first generate() raised the CaptureError saying why)"
        if stage == "decode":
            self.refused = summary
        elif stage == "verify":
            self.verify_refused = (
                f"{summary}; assisted generates with this model (prompt lookup, or as the assistant) run "
                "eagerly, the others from graphs"
            )
        else:
            self.prefill_refused = f"{summary}; the prefill runs eagerly, decode from graphs: mode='full' does so without this warning"
        return better

    def _check_hook_reached(self, out: Any, prompt: int, decodes: int, prefills: int) -> None:
        """Count (and warn once) a ``generate`` whose forwards never reached devgraph's hook.

        transformers calls the route through ``get_compiled_call``; a release that stops doing so (or
        renames what the route reads) would otherwise run every step eagerly with no sign of it.
        """
        sequences = out if isinstance(out, torch.Tensor) else getattr(out, "sequences", None)
        if not isinstance(sequences, torch.Tensor) or sequences.dim() != 2:
            return
        from transformers import __version__

        new = sequences.shape[1] - prompt
        how = (
            "devgraph shadowed get_compiled_call on this instance (this model type's own returns the plain "
            "forward)"
            if self._shadow_hook
            else "model.get_compiled_call returned devgraph's route"
        )
        if new >= 2 and self._route.decode_calls == decodes:
            self.runner.note_fallback(
                "decode_hook_not_reached",
                f"transformers {__version__}'s generate() ran the decode steps of {type(self.module).__name__} "
                f"without calling the forward that model.get_compiled_call returns ({how}); every step ran "
                "eagerly",
            )
        if new >= 1 and self._route.prefill is not None and self._route.prefill_calls == prefills:
            self.runner.note_fallback(
                "prefill_hook_not_reached",
                f"transformers {__version__}'s generate() ran the prefill of {type(self.module).__name__} "
                f"without the chunked-prefill call through model.get_compiled_call ({how}); the prefill ran "
                "eagerly, not from the pieces",
            )

    def __repr__(self) -> str:
        return (
            f"<GraphedCausalLM {type(self.module).__name__} on {self.runner.device}, "
            f"sizes {list(self._sizes)}, max_cache_len {self.options.max_cache_len}>"
        )


#: The most tokens an assistant's forward takes after its first in transformers' assisted loop: the
#: target's last two accepted tokens, which the assistant has not seen (``_update_past_and_masks``).
_DRAFT_STEP = 2


def _draft_tokens(assistant: Any) -> int:
    """The candidates per step an assistant starts a generate with: its ``num_assistant_tokens``, as
    transformers' ``AssistedCandidateGenerator`` resolves it (20 when unset)."""
    config = assistant.generation_config
    tokens = getattr(config, "num_assistant_tokens", None)
    defaults = getattr(config, "_get_default_generation_params", None)
    if tokens is None and defaults is not None:
        tokens = defaults().get("num_assistant_tokens")
    return int(tokens if tokens is not None else 20)


def _with_fields(call: Any, fields: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments with generation-config ``fields`` set (on a copy of its ``generation_config``,
    when it passes one: a config object and generation kwargs together are deprecated in transformers)."""
    named = dict(call.named)
    if named.get("generation_config") is not None:
        import copy

        named["generation_config"] = copy.deepcopy(named["generation_config"])
        for name, value in fields.items():
            setattr(named["generation_config"], name, value)
    else:
        named.update(fields)
    return named


# -- model checks ----------------------------------------------------------------------------------


def _check_inputs(named: dict[str, Any], model: Any) -> None:
    """Refuse prompt tensors on another device than the model's, naming them and the fix."""
    for key in ("inputs", "input_ids", "attention_mask"):
        value = named.get(key)
        if isinstance(value, torch.Tensor) and value.device != model.device:
            key = "input_ids" if key == "inputs" else key
            raise DevgraphError(
                f"generate() got {key} on {value.device}, the model is on {model.device}; move them first: "
                f"{key}.to(model.device)"
            )


def _check_model(model: Any, device: Device) -> int:
    """The number of cache layers; refuse, with the reason and the fix, models this adapter cannot serve."""
    name = type(model).__name__
    config = model.config
    if not (hasattr(model, "can_generate") and model.can_generate()) or config.is_encoder_decoder:
        raise DevgraphError(
            f"{name} is not a decoder-only model with generate(); the Hugging Face adapter graphs causal LMs "
            "(AutoModelForCausalLM). Wrap other modules with devgraph.wrap(module) after exposing a "
            "tensor-only forward."
        )
    from transformers.cache_utils import StaticLayer, get_layer_types_and_kwargs

    if not hasattr(StaticLayer(max_cache_len=1), "cumulative_length") or not hasattr(
        model, "get_compiled_call"
    ):
        raise DevgraphError(
            "the Hugging Face adapter needs transformers >= 5.0 (StaticLayer.cumulative_length, "
            "get_compiled_call)"
        )
    if not model._supports_default_dynamic_cache():
        raise DevgraphError(
            f"{name} keeps a cache of its own kind (state-space or linear attention), not keys/values; "
            "the graphed decode step needs a static KV cache. Use eager model.generate() for this model."
        )
    text_config = config.get_text_config(decoder=True)
    bias = position_bias_source(model)
    if bias is not None:
        raise DevgraphError(
            f"{name} adds ALiBi position biases ({bias}): its forward computes them on every call from host "
            "values and the 2-D attention mask, which a captured decode step over devgraph's static cache "
            "cannot take (no devgraph mode serves it: mode='piecewise' and 'full_and_piecewise' capture the "
            "decode step the same way). Use eager model.generate() for this model, or a model with rotary "
            "or learned positions"
        )
    layer_types, _ = get_layer_types_and_kwargs(text_config)
    for index, layer_type in enumerate(layer_types):
        if layer_type not in _ATTENTION_LAYER_TYPES:
            raise DevgraphError(
                f"{name} layer {index} has layer type {layer_type!r}; the graphed decode step caches "
                f"{list(_ATTENTION_LAYER_TYPES)} layers only. Use eager model.generate() for this model."
            )
    if model.training:
        import warnings

        warnings.warn(
            f"devgraph: {name} is in train mode (dropout is active, so eager and graphed generate differ from "
            "run to run); call model.eval() before devgraph.wrap",
            stacklevel=user_stacklevel(),
        )
    param = next(model.parameters(), None)
    if param is not None and param.device.type != torch.device(device.torch_device).type:
        raise DevgraphError(
            f"{name} lives on {param.device}, the devgraph device {device} on {device.torch_device}; "
            f"move it first: model.to({str(device.torch_device)!r})"
        )
    return len(layer_types)
