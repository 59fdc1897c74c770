"""A speculative draft of ``k`` steps over the reference ``PagedDecoder``: eager, one merged graph, k replays.

A draft step runs the draft model on the last token of every row and takes the argmax as the next
step's token; positions and sequence lengths grow by one per step. The metadata of every step
(positions, slots, block tables, device and host lengths) is built on the host before the draft runs
(``draft_metadata``), as vllm-ascend builds its EAGLE steps' attention metadata before the replay.

* ``eager_draft``: the reference, ``k`` eager forwards.
* ``MergedDraft``: the ``k`` steps captured as one ``MultiStepGraph``; one replay, one update.
* ``SeparateDraft``: one step captured once and replayed ``k`` times (one update per step): what a
  runner without a merged graph does, the baseline of ``benchmarks/spec_draft.py``.
* ``speculative_decode``: a whole greedy speculative loop (plain decode steps, a ``k``-step draft,
  a ``k + 1``-token verify, greedy acceptance) over callables by family name: graph families
  (``devgraph.runner.GraphFamilies``) or the eager models (``eager_families``).

The draft here takes tokens, not the target's hidden states (EAGLE's draft also takes those): a
simplification of the model, not of the graph's shape. Neither graph synchronises the device: read
the drafted tokens after ``device.synchronize()`` (an engine hands them to its verify step on the same
stream instead).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch

from devgraph.graph import Device, MultiStepGraph
from devgraph.testing.models import KVBlockManager, PagedDecoder

__all__ = [
    "MergedDraft",
    "SeparateDraft",
    "SpeculativeResult",
    "draft_metadata",
    "eager_draft",
    "eager_families",
    "greedy_accept",
    "perturbed_draft",
    "speculative_decode",
]

#: The forward kwargs that are device tensors, one per step.
_TENSORS = ("positions", "block_table", "seq_lens", "slot_mapping")


def draft_metadata(manager: KVBlockManager, seq_ids: Sequence[Any], steps: int) -> list[dict[str, Any]]:
    """The forward kwargs of ``steps`` draft steps of ``seq_ids``, built on the host, step by step.

    Each step appends one token to every sequence in ``manager`` (blocks are allocated as needed);
    ``input_ids`` of the result are placeholders: step 0's token is the caller's, later ones come from
    the previous step's argmax.
    """
    return [manager.decode_batch(list(seq_ids), [0] * len(seq_ids)) for _ in range(steps)]


@torch.no_grad()
def eager_draft(
    model: PagedDecoder, first_tokens: torch.Tensor, steps: Sequence[Mapping[str, Any]]
) -> torch.Tensor:
    """The drafted tokens ``[k, B]`` of ``len(steps)`` eager forwards from ``first_tokens`` ``[B]``."""
    tokens, drafted = first_tokens, []
    for meta in steps:
        logits = model(input_ids=tokens, **{n: meta[n] for n in (*_TENSORS, "seq_lens_host")})
        tokens = logits.argmax(-1)
        drafted.append(tokens)
    return torch.stack(drafted)


class _Buffers:
    """Static inputs of ``steps`` draft steps of ``batch`` rows: ``ids[i]`` is step ``i``'s token,
    ``ids[i + 1]`` the one it drafts; the rest per step."""

    def __init__(self, model: PagedDecoder, batch: int, steps: int, device: torch.device) -> None:
        c = model.config
        self.batch, self.steps = batch, steps
        self.ids = torch.zeros(steps + 1, batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(steps, batch, dtype=torch.int64, device=device)
        # Pad values (PagedDecoder.pad_values): token 0 at position 0 in the scratch block, length 1.
        self.block_table = torch.zeros(steps, batch, c.max_blocks_per_seq, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(steps, batch, dtype=torch.int32, device=device)
        self.slot_mapping = torch.zeros(steps, batch, dtype=torch.int64, device=device)

    def load(self, first_tokens: torch.Tensor, steps: Sequence[Mapping[str, Any]]) -> None:
        """Copy step 0's token and every step's metadata into the buffers."""
        if len(steps) != self.steps:
            raise ValueError(f"got the metadata of {len(steps)} steps for {self.steps}")
        self.ids[0].copy_(first_tokens)
        for name in _TENSORS:
            buf = getattr(self, name)
            buf.copy_(torch.stack([meta[name] for meta in steps]).to(buf.dtype))

    def step(self, model: PagedDecoder, i: int, host_lens: list[int], into: int | None = None) -> None:
        """Step ``i``'s forward over the buffers; its argmax written into ``ids[into]`` (``i + 1``)."""
        logits = model(
            self.ids[i],
            self.positions[i],
            self.block_table[i],
            self.seq_lens[i],
            self.slot_mapping[i],
            host_lens,
        )
        self.ids[i + 1 if into is None else into].copy_(logits.argmax(-1))


class MergedDraft:
    """``steps`` draft steps of ``batch`` rows captured as one ``MultiStepGraph``.

    ``propose`` copies every step's metadata into the graph's inputs, then replays once, giving each
    step its host lengths: one update for all steps. Capture costs one forward per step.
    """

    def __init__(self, model: PagedDecoder, device: Device, batch: int, steps: int) -> None:
        self.model, self.device = model, device
        self.buffers = _Buffers(model, batch, steps, device.torch_device)
        self.graph = MultiStepGraph(device, steps)
        with torch.no_grad(), self.graph.capture():
            for i in range(steps):
                with self.graph.step(i):
                    self.buffers.step(model, i, [1] * batch)

    def propose(self, first_tokens: torch.Tensor, steps: Sequence[Mapping[str, Any]]) -> torch.Tensor:
        """Queue the draft from ``first_tokens`` over ``steps``' metadata; the drafted ``[k, B]``
        tokens (a view of the graph's buffer: valid once the device has run it, until the next call)."""
        self.buffers.load(first_tokens, steps)
        self.graph.replay([{"seq_lens_host": meta["seq_lens_host"]} for meta in steps])
        return self.buffers.ids[1:]


class SeparateDraft:
    """One draft step captured once, replayed ``steps`` times (one update per replay): the baseline.

    The step reads ``ids[0]`` and writes its argmax back into ``ids[0]`` (the next replay's token);
    after each replay the token is copied out (device work queued by the host, as a runner does).
    """

    def __init__(self, model: PagedDecoder, device: Device, batch: int, steps: int) -> None:
        self.model, self.device, self.steps = model, device, steps
        self.buffers = _Buffers(model, batch, 1, device.torch_device)
        self.drafted = torch.zeros(steps, batch, dtype=torch.int64, device=device.torch_device)
        self.graph = device.graph()
        with torch.no_grad(), self.graph.capture(auto_update_ops=device.updatable_ops):
            self.buffers.step(model, 0, [1] * batch, into=0)

    def propose(self, first_tokens: torch.Tensor, steps: Sequence[Mapping[str, Any]]) -> torch.Tensor:
        """Like ``MergedDraft.propose``, in ``len(steps)`` replays."""
        self.buffers.ids[0].copy_(first_tokens)
        for i, meta in enumerate(steps):
            self.buffers.load(self.buffers.ids[0], [meta])  # the token: the last replay's argmax
            self.graph.replay(host_args={"seq_lens_host": meta["seq_lens_host"]})
            self.drafted[i].copy_(self.buffers.ids[0])
        return self.drafted


# -- a whole speculative loop --------------------------------------------------------------------

#: The families a speculative loop calls: the target one token per request (``decode``) and ``k + 1``
#: per request (``verify``), the draft ``k`` steps at once (``draft``, ``DraftSteps``'s arguments) and
#: one step (``draft_decode``: the prompt, and a fully accepted round's last drafted token).
FAMILY_NAMES = ("decode", "verify", "draft", "draft_decode")


def eager_families(target: PagedDecoder, draft: PagedDecoder, k: int) -> dict[str, Callable[..., Any]]:
    """The eager callables of a speculative loop's families (the reference a graphed loop equals)."""
    from devgraph.runner import DraftSteps  # the runner sits above the models; testing may import it

    return {"decode": target, "verify": target, "draft": DraftSteps(draft, k), "draft_decode": draft}


def perturbed_draft(target: PagedDecoder, noise: float = 0.1, seed: int = 7) -> PagedDecoder:
    """A draft for ``target``: a copy of its weights plus Gaussian noise of ``noise`` times each
    weight's mean magnitude, so that it drafts some of the target's tokens and misses others."""
    import copy

    draft = copy.deepcopy(target)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_((torch.randn(p.shape, generator=gen) * noise * p.float().abs().mean()).to(p))
    return draft


def greedy_accept(drafted: torch.Tensor, verified: torch.Tensor) -> list[int]:
    """Per request, how many drafted tokens ``[R, k]`` the target's argmax ``[R, k + 1]`` accepts: the
    longest prefix where ``drafted[:, j] == verified[:, j]``."""
    same = (drafted == verified[:, : drafted.shape[1]]).to(torch.int64)
    return [int(n) for n in same.cumprod(dim=1).sum(dim=1).tolist()]


@attrs.frozen
class SpeculativeResult:
    """What ``speculative_decode`` produced: each request's generated tokens, and per round each
    request's accepted count (and eager's on the same inputs, when checked)."""

    tokens: list[list[int]]
    accepted: list[list[int]]
    eager_accepted: list[list[int]]


def _rows(batch: Mapping[str, Any], index: list[int]) -> dict[str, Any]:
    sel = torch.tensor(index, device=batch["input_ids"].device)
    out: dict[str, Any] = {n: v.index_select(0, sel) for n, v in batch.items() if isinstance(v, torch.Tensor)}
    out["seq_lens_host"] = [batch["seq_lens_host"][i] for i in index]
    return out


@torch.no_grad()
def speculative_decode(
    families: Mapping[str, Callable[..., Any]],
    manager: KVBlockManager,
    prompts: Sequence[Sequence[int]],
    k: int,
    rounds: int,
    *,
    check: Mapping[str, Callable[..., Any]] | None = None,
    note: Callable[..., None] | None = None,
    sync: Callable[[], None] = lambda: None,
) -> SpeculativeResult:
    """Greedy speculative decoding of ``prompts`` (one request each, all of one length) for ``rounds``.

    The prompts go through ``decode`` and ``draft_decode`` one token per call (their last token
    included: the target's first token is a plain decode step's argmax); then each round drafts
    ``k`` tokens per request (``draft``), verifies ``k + 1`` (``verify``: the round's first token and
    the drafted ones, request-major), accepts greedily, gives the rejected tokens' cache slots back
    (``manager.truncate``), and feeds a fully accepted request's last drafted token to the draft
    (``draft_decode``). ``check``: eager callables run on the same inputs every round (their own KV
    caches, in step); their acceptance is passed to ``note(accepted, proposed, eager_accepted=...)``
    (``GraphFamilies.note_acceptance``). ``sync`` runs before tokens are read on the host.
    """
    runs = [families] if check is None else [families, check]
    reqs = list(range(len(prompts)))
    if len({len(p) for p in prompts}) != 1:
        raise ValueError("speculative_decode takes prompts of one length (every plain step a full batch)")
    batch: dict[str, Any] = {}
    for t in range(len(prompts[0])):
        batch = manager.decode_batch(reqs, [p[t] for p in prompts])
        for fns in runs:
            fns["draft_decode"](**batch)
        logits = [fns["decode"](**batch) for fns in runs]
    sync()
    first = logits[0].argmax(-1).clone()
    tokens = [[int(x)] for x in first.tolist()]
    accepted_all: list[list[int]] = []
    eager_all: list[list[int]] = []
    for _ in range(rounds):
        lengths = [manager.seq_len(r) for r in reqs]
        steps = [manager.decode_batch(reqs, [0] * len(reqs)) for _ in range(k + 1)]
        per_step = {n: torch.stack([s[n] for s in steps], dim=1) for n in _TENSORS}  # [R, k + 1, ...]
        draft_args: dict[str, Any] = {n: v[:, :k] for n, v in per_step.items()}
        draft_args.update(input_ids=first, seq_lens_host=steps[0]["seq_lens_host"])
        verify_args: dict[str, Any] = {n: v.flatten(0, 1) for n, v in per_step.items()}  # request-major
        verify_args["seq_lens_host"] = [s["seq_lens_host"][r] for r in reqs for s in steps]
        results = []
        for fns in runs:
            drafted = fns["draft"](**draft_args).clone()  # a view of graph memory: kept past the next call
            ids = torch.cat([first[:, None], drafted], dim=1).flatten()
            verified = fns["verify"](input_ids=ids, **verify_args).argmax(-1).view(len(reqs), k + 1)
            sync()
            results.append((drafted, verified, greedy_accept(drafted, verified)))
        drafted, verified, accepted = results[0]
        accepted_all.append(accepted)
        if check is not None:
            eager_all.append(results[1][2])
        if note is not None:
            note(
                sum(accepted), k * len(reqs), eager_accepted=sum(results[1][2]) if check is not None else None
            )
        full = [r for r in reqs if accepted[r] == k]
        if full:  # the draft has not seen its own last token yet: one plain draft step
            catch_up = _rows(steps[k], full)
            for fns, (d, _, _) in zip(runs, results):
                fns["draft_decode"](**{**catch_up, "input_ids": d[full, k - 1].contiguous()})
        nxt = []
        for r in reqs:
            a = accepted[r]
            tokens[r].extend([*(int(x) for x in drafted[r, :a].tolist()), int(verified[r, a])])
            manager.truncate(r, lengths[r] + a + 1)
            nxt.append(int(verified[r, a]))
        first = torch.tensor(nxt, dtype=first.dtype, device=first.device)
    return SpeculativeResult(tokens, accepted_all, eager_all)
