"""Assisted generation's steps (prompt lookup, an assistant model) from graphs, one per token count.

transformers' assisted loop (``_assisted_decoding``, one row only) proposes candidate tokens (prompt
lookup: a continuation of an n-gram found earlier in the sequence; an assistant model: its own
``generate``), runs the target model once over the last accepted token and the ``c`` candidates (a
*verify step* of ``T = c + 1`` tokens), keeps the candidates up to the first the target disagrees with
plus the target's own next token, and rolls the cache back over the rejected ones
(``cache.crop(-rejected)``; devgraph's ``CacheRows.crop``). ``c`` changes from step to step (0 when no
n-gram matches, fewer when the assistant stops early), so ``T`` does.

The loop calls the models themselves (``self(**model_inputs)``; the assistant's ``generate`` too, as
it calls a model over a dynamic cache), not the compiled-call hook the decode steps use;
``forward_route`` sends those calls to each model's ``Verifier`` for one ``generate``:

* the first call (the prompt, and the target's first candidates, from slot 0) runs the model eagerly,
  as every mode's prefill of an assisted ``generate`` does; the assistant's runs over devgraph's cache
  instead of the ``DynamicCache`` transformers made for it and returns it, so transformers keeps
  devgraph's cache for the assistant's later steps and ``generate`` calls;
* every later call, ``T`` tokens with ``1 <= T <= largest``, replays the graph of exactly ``T`` tokens
  (``VerifyStep``: the tokens are its rows; no padding, so no padded token ever writes the cache). Two
  runners serve them: one for ``T = 1`` and one for ``2 <= T <= largest``, each by default traced by
  Dynamo once (it specialises a size of 1; in one runner a step of one token after one of several,
  or the reverse, would trace again) and captured per ``T``. ``largest`` is the target's candidates
  per step + 1 when the generate starts (``prompt_lookup_num_tokens``, the assistant's
  ``num_assistant_tokens``) and 2 for an assistant (its steps: one token, or the two it has not seen
  after a verify step); a later generate with more candidates builds the graphs again up to its own. Longer calls run eagerly, counted as
  ``"verify_too_long"`` (an assistant's ``"heuristic"`` schedule raises its count during a generate).
  A step of one token is not sent to the decode graphs: transformers' assisted loop passes no
  ``position_ids`` where its sampling loop does, so the decode graphs captured by one would not take
  the other's calls (``frontend='raw'``) or would trace again.

A capture runs the step ``warmup_iters + 1`` times per size, largest first, and the runner puts the
cache's write positions back only after the last size; the step therefore moves them to the call's
position itself (``VerifyStep.start``, inside the graph), so that every run writes the ``T`` slots
from there and the capture writes ``largest`` slots from the position of the call that captures
(up to ``prompt + new - 2``, the last step's) instead of drifting one run after another. The adapter
keeps assisted generates whose sequence leaves no room for that eager (``"sequence_too_long"``).
``SpeculativeStats`` counts the steps and the candidates proposed and accepted (read from the
rollbacks transformers asks for, which change nothing in its loop).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch import Tensor

from devgraph._errors import CaptureError
from devgraph.adapters.hf._cache import SharedStaticCache
from devgraph.adapters.hf._compat import CACHE_KEYS, cache_of, causal_lm_output
from devgraph.adapters.hf._step import MaskedStep, MaskKeys, attention_mask_of, mask_structure

__all__ = ["SpeculativeStats", "Verifier", "VerifyStats", "VerifyStep"]

#: Verify-call arguments the step reproduces itself; any other argument makes the call eager.
_VERIFY_KEYS = {"input_ids", "position_ids", "attention_mask", *CACHE_KEYS, "use_cache", "return_dict"}


@attrs.define
class SpeculativeStats:
    """Counters of assisted generation (``graphed.speculative_stats``).

    Attributes:
        generates: assisted ``generate`` calls of this wrapper whose steps devgraph served (as the
            target: it verifies the candidates).
        drafts: assisted ``generate`` calls of another wrapper this one drafted for (passed as its
            ``assistant_model``).
        steps: this model's forwards after the first of each such generate (the first prefills the
            prompt, eagerly): the target's verify steps, the assistant's drafting steps.
        graph_steps: of those, served from the verify graphs.
        eager_steps: of those, run eagerly (counted by reason in ``graphed.stats.fallbacks``).
        proposed: candidate tokens proposed to this model as the target, the first forward's included.
        accepted: of those, accepted (the others are rolled back).
    """

    generates: int = 0
    drafts: int = 0
    steps: int = 0
    graph_steps: int = 0
    eager_steps: int = 0
    proposed: int = 0
    accepted: int = 0

    @property
    def acceptance(self) -> float | None:
        """``accepted / proposed`` (None before any candidate was proposed)."""
        return self.accepted / self.proposed if self.proposed else None


@attrs.frozen
class VerifyStats:
    """The verify graphs' counters (``graphed.verify_stats``), added up over their two runners (one
    token; 2 to ``largest`` tokens).

    Attributes:
        replays: steps replayed from the graphs.
        eager_calls: steps the runners ran eagerly themselves (counted in ``fallbacks``).
        fallbacks: the runners' eager steps by reason.
        captured_sizes: the token counts captured.
        capture_seconds: seconds the captures took.
        pool_bytes: the graphs' memory pools.
        recompiles: traces again after a guard failed (``frontend='dynamo'``; 0 with ``'raw'``).
        frontend: ``"dynamo"`` or ``"raw"``.
    """

    replays: int
    eager_calls: int
    fallbacks: dict[str, int]
    captured_sizes: tuple[int, ...]
    capture_seconds: float
    pool_bytes: int
    recompiles: int
    frontend: str

    @classmethod
    def of(cls, stats: list[Any]) -> VerifyStats:
        fallbacks: dict[str, int] = {}
        for one in stats:
            for reason, n in one.fallbacks.items():
                fallbacks[reason] = fallbacks.get(reason, 0) + n
        return cls(
            replays=sum(one.replays for one in stats),
            eager_calls=sum(one.eager_calls for one in stats),
            fallbacks=fallbacks,
            captured_sizes=tuple(sorted({size for one in stats for size in one.captured_sizes})),
            capture_seconds=sum(one.capture_seconds for one in stats),
            pool_bytes=sum(one.pool_bytes for one in stats),
            recompiles=sum(getattr(one, "recompiles", 0) for one in stats),
            frontend=stats[0].frontend,
        )


class VerifyStep(MaskedStep):
    """One verify step of a one-row assisted generate, its tokens as rows: what the graphs capture.

    ``forward(input_ids[T], position_ids[T] | None, mask0[T, L], mask1, mask2)`` runs the model over
    the shared cache's first row (writing ``T`` slots from its position) and returns the logits
    ``[T, vocab]`` of every token. ``mask_keys`` as ``MaskedStep``'s.
    """

    start: torch.Tensor

    def __init__(self, model: Any, cache: SharedStaticCache) -> None:
        super().__init__(model, cache)
        #: the cache's write position before the step, set by the caller: the step moves every layer's
        #: position there first (inside the graph), so each warm-up and capture run of every size writes
        #: the same slots, from the call's position, instead of one run's tokens after another's
        self.register_buffer("start", torch.zeros((), dtype=torch.long), persistent=False)

    def _step(self, input_ids: Tensor, position_ids: Tensor | None, keys: MaskKeys, masks: Any) -> Tensor:
        masks = [m[None, None] for m in masks]  # [T, L] -> [1, 1, T, L]
        attention_mask = attention_mask_of(keys, masks)
        cache = self.cache.view(1)
        for layer in cache.layers:
            layer.cumulative_length.copy_(self.start)
        positions = None if position_ids is None else position_ids[None]
        return self._model(input_ids[None], positions, attention_mask, cache).logits[0]


class Verifier:
    """A model's forward during one assisted ``generate``, as the target or the assistant (see the
    module docstring).

    ``make_runner(step, sizes)`` builds the verify graphs' server (a ``TracedModule`` or a
    ``GraphRunner``) for the token counts ``sizes``; ``on_eager(reason, detail)`` counts and warns.
    """

    def __init__(
        self,
        model: Any,
        cache: SharedStaticCache,
        make_runner: Callable[[VerifyStep, tuple[int, ...]], Any],
        on_eager: Callable[[str, str], None],
    ) -> None:
        self.model = model
        self.cache = cache
        self.step = VerifyStep(model, cache)
        self.make_runner = make_runner
        self.on_eager = on_eager
        #: the graphs of one token, and of 2..``largest`` tokens (two runners: one trace each, Dynamo
        #: specialising a size of 1), built by the first generate that needs them (``prepare``)
        self.one: Any = None
        self.runner: Any = None
        self.largest = 0  # the largest token count the verify graphs serve (0: none yet)
        self.stats = SpeculativeStats()
        self.calls = 0  # forwards that reached this route (the adapter checks it was reached)
        self.stage = "verify"  # "prefill" (eager) or "verify": where a CaptureError came from
        self._prompt = 0
        self._first = True
        self._draft = False
        self._proposed = 0  # candidates of the last forward, for the rollback that follows it
        self.raised = False  # whether a CaptureError came from this route during the generate

    def tokens_for(self, candidates: int) -> int:
        """The largest verify step a generate with up to ``candidates`` per step captures graphs for."""
        return max(self.largest, candidates + 1)

    def prepare(self, candidates: int) -> None:
        """Serve verify steps of up to ``candidates + 1`` tokens from graphs (built anew if larger)."""
        tokens = candidates + 1
        position = self.cache.base.layers[0].cumulative_length
        if self.step.start.device != position.device:  # the model moved: the graphs go too
            self.step.start = torch.zeros((), dtype=position.dtype, device=position.device)
            self.largest = 0
        if self.one is None or self.largest == 0:
            self.one = self.make_runner(self.step, (1,))
        if tokens > self.largest:
            if self.runner is not None:
                self.runner.reset()
            self.runner = self.make_runner(self.step, tuple(range(2, max(tokens, 2) + 1)))
            self.largest = tokens

    def reset(self) -> None:
        """Drop the verify graphs (the model was cast or moved); the next generate builds them again."""
        for runner in self.runners:
            runner.reset()

    @property
    def runners(self) -> list[Any]:
        """The runners built so far (one token, several)."""
        return [r for r in (self.one, self.runner) if r is not None]

    def begin(self, prompt: int, draft: bool = False) -> None:
        """Before an assisted generate over a prompt of ``prompt`` tokens (the cache is empty).

        ``draft``: this model is the assistant. transformers makes its cache (a ``DynamicCache``) in
        the assistant's first ``generate``; the first forward runs over devgraph's cache instead and
        returns it, and transformers keeps the cache a forward returns (for the later steps and the
        assistant's later ``generate`` calls, which it passes the same cache).
        """
        self._prompt = prompt
        self._first = True
        self._proposed = 0
        self._draft = draft
        self.raised = False
        if draft:
            self.stats.drafts += 1
        else:
            self.stats.generates += 1
            self.cache.on_crop = self._rolled_back

    def end(self) -> None:
        self.cache.on_crop = None

    def _rolled_back(self, tokens: int) -> None:
        self.stats.accepted += max(self._proposed - tokens, 0)
        self._proposed = 0

    def __call__(self, **kwargs: Any) -> Any:
        self.calls += 1
        try:
            return self._serve(kwargs)
        except CaptureError:
            self.raised = True  # the adapter tells the target's refusal from the assistant's
            raise

    def _serve(self, kwargs: dict[str, Any]) -> Any:
        ids = kwargs.get("input_ids")
        tokens = ids.shape[1] if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None
        if self._first:
            # The prompt (and, for the target, the first candidates), from slot 0: the prefill, eager in
            # every mode.
            self._first = False
            self.stage = "prefill"
            if self._draft:
                for key in CACHE_KEYS:
                    if kwargs.get(key) is not None:
                        kwargs[key] = self.cache.view(1)
                return self.model(**kwargs)
            self._count(None if tokens is None else tokens - self._prompt)
            return self.model(**kwargs)
        if not self._draft:
            self._count(None if tokens is None else tokens - 1)
        self.stats.steps += 1
        self.stage = "verify"
        why = self._not_servable(kwargs, tokens)
        if why is not None:
            self.on_eager(*why)
            self.stats.eager_steps += 1
            return self.model(**kwargs)
        keys, masks = mask_structure(kwargs["attention_mask"], tokens)  # type: ignore[misc,arg-type]
        if self.step.mask_keys is None:
            self.step.mask_keys = keys
        named = {f"mask{i}": m[0, 0] for i, m in enumerate(masks)}
        positions = kwargs.get("position_ids")
        call = {
            "input_ids": ids[0],  # type: ignore[index]
            "position_ids": None if positions is None else positions[0],
            **named,
        }
        # Before any capture too: its runs write the slots from ``start`` (the prompt's, were it stale).
        self.step.start.copy_(self.cache.base.layers[0].cumulative_length)  # on the device: no sync
        runner = self.one if tokens == 1 else self.runner
        if not runner.captured and not hasattr(runner, "graphs"):  # frontend='raw': capture explicitly
            self._capture(runner, call)  # (a TracedModule captures when it is called)
        before = runner.stats.replays
        logits = runner(**call)
        if runner.stats.replays != before:
            self.stats.graph_steps += 1
        else:  # the runner ran it eagerly itself (counted in its own stats)
            self.stats.eager_steps += 1
        # The logits are graph memory, overwritten by the next replay; the loop keeps them (scores).
        return causal_lm_output(logits[None].clone(), cache_of(kwargs))

    def _count(self, candidates: int | None) -> None:
        self._proposed = max(candidates or 0, 0)
        self.stats.proposed += self._proposed

    def _not_servable(self, kwargs: dict[str, Any], tokens: int | None) -> tuple[str, str] | None:
        """Why a verify call of several tokens runs eagerly, or None."""
        if tokens is None or tokens < 1 or tokens > self.largest or self.runner is None:
            return (
                "verify_too_long",
                f"a verify step of {tokens} tokens is above the {self.largest} the verify graphs of this generate "
                "serve (the candidates it started with + 1: prompt_lookup_num_tokens, or the assistant's "
                "num_assistant_tokens, which its 'heuristic' schedule raises during a generate)",
            )
        if not self.cache.owns(cache_of(kwargs)):
            return ("decode_arguments", "the verify step was called with a cache that is not devgraph's")
        extra = sorted(
            k
            for k, v in kwargs.items()
            if k not in _VERIFY_KEYS and not (k == "logits_to_keep" and v in (None, 0, tokens))
        )
        positions = kwargs.get("position_ids")
        if positions is not None and (not isinstance(positions, torch.Tensor) or positions.dim() != 2):
            extra.append("position_ids (not [1, tokens])")
        if extra:
            return (
                "decode_arguments",
                f"the verify step was called with {extra}, which the graph does not take",
            )
        structure = mask_structure(kwargs.get("attention_mask"), tokens)
        if structure is None:
            return (
                "mask_structure",
                "the verify mask is not a 4-D tensor (or a dict of them) for a static cache",
            )
        if self.step.mask_keys is not None and structure[0] != self.step.mask_keys:
            return (
                "mask_structure",
                f"the verify mask has layer types {structure[0]}, the captured one {self.step.mask_keys}",
            )
        return None

    def _capture(self, runner: Any, call: dict[str, Any]) -> None:
        # frontend='raw': the capture's warm-ups and captures advance the write positions (and write
        # the slots from the call's position, which the masks hide until a real step writes them
        # again): put them back.
        saved = self.cache.positions()
        try:
            runner.capture(**call)
        finally:
            self.cache.restore_positions(saved)
