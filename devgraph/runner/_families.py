"""Graph families under one roof: a speculative decoder's decode, verify and draft graphs.

A speculative decoder replays three kinds of graphs: the target's decode graphs (one token per
request), the target's verify graphs (``k + 1`` tokens per request: the last token and the ``k``
drafted ones) and the draft's graphs (``k`` steps captured as one ``MultiStepGraph`` per bucket).
``GraphFamilies`` holds one ``GraphRunner`` per family, by name, all capturing into one
``SharedPool`` (one pool, one side stream), under one capture budget (a number of graphs), and
reports each family's own counts: graphs, capture seconds, pool growth during its capture, replays,
eager calls by reason.

Never silent:

* a verify call whose token count is not ``requests x (k + 1)`` is never replayed (a bucket would pad
  it to a count the graph was not captured for as a verify batch): it runs eagerly, counted as
  ``verify_token_count`` (raised with ``strict=True``);
* a family captured but never replayed is warned once (``report()``, ``close()``, or when the
  families are collected) and counted (``FamilyStats.never_replayed``);
* the acceptance rate is a counter (``note_acceptance``), and an acceptance that differs from
  eager's on the same inputs (``eager_accepted=``) is warned and counted.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch

from devgraph._errors import DevgraphError
from devgraph.graph import Device, MultiStepGraph, SharedPool, step_lengths
from devgraph.runner._calls import Call, Unsupported
from devgraph.runner._config import RunnerConfig, RunnerStats
from devgraph.runner._part import Kit, Words
from devgraph.runner._runner import GraphRunner

__all__ = [
    "AcceptanceStats",
    "DraftSteps",
    "Family",
    "FamilyStats",
    "GraphFamilies",
    "MultiStepGraphs",
    "VERIFY_TOKEN_COUNT",
]

#: The eager-call reason of a verify call whose token count is not requests x (k + 1).
VERIFY_TOKEN_COUNT = "verify_token_count"


class DraftSteps(torch.nn.Module):
    """``steps`` greedy draft steps of a one-step paged decoder as one call (what a draft family serves).

    ``model`` is called as ``model(input_ids, positions, block_table, seq_lens, slot_mapping,
    seq_lens_host)`` (``PagedDecoder``'s signature) once per step, each step's argmax its next
    token. ``forward`` takes step 0's tokens ``[B]``, every step's metadata with the step as dim 1
    (``positions``, ``slot_mapping``, ``seq_lens`` ``[B, steps]``; ``block_table``
    ``[B, steps, blocks]``) and step 0's host lengths; step ``i``'s host lengths are step 0's plus
    ``i`` (``step_lengths``). Returns the drafted tokens ``[B, steps]``.
    """

    def __init__(self, model: Callable[..., torch.Tensor], steps: int) -> None:
        super().__init__()
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise DevgraphError(f"DraftSteps needs steps >= 1, got {steps!r}")
        self.model = model
        self.steps = steps
        self._mark: Callable[[int], contextlib.AbstractContextManager[Any]] | None = None

    @contextlib.contextmanager
    def marking(self, mark: Callable[[int], contextlib.AbstractContextManager[Any]]) -> Iterator[None]:
        """Run each step inside ``mark(i)`` (``MultiStepGraph.step``) while the block is open."""
        self._mark = mark
        try:
            yield
        finally:
            self._mark = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        slot_mapping: torch.Tensor,
        seq_lens_host: Sequence[int],
    ) -> torch.Tensor:
        tokens, drafted = input_ids, []
        for i in range(self.steps):
            with self._mark(i) if self._mark is not None else contextlib.nullcontext():
                logits = self.model(
                    tokens,
                    positions[:, i],
                    block_table[:, i],
                    seq_lens[:, i],
                    slot_mapping[:, i],
                    [int(n) + i for n in seq_lens_host],
                )
                tokens = logits.argmax(-1)
            drafted.append(tokens)
        return torch.stack(drafted, dim=1)


class MultiStepGraphs:
    """A runner part: one ``MultiStepGraph`` of a ``DraftSteps`` per batch-size bucket.

    Built through ``GraphRunner(draft_steps, device, config, part=MultiStepGraphs)``: the runner reads,
    matches, buckets, pads and loads the call; a replay gives every step its host lengths (step 0's
    plus the step, the padded rows' too, as eager on the padded batch computes them) in one update.
    """

    words = Words(
        kind="multistep",
        match="captured",
        sizes="batch sizes",
        graphs="multi-step graphs",
        desc="multi-step capture",
        serve_what="from a multi-step graph",
        size_options="batch_sizes",
        remedy="or capture fewer batch sizes",
    )

    def __init__(self, kit: Kit) -> None:
        if not isinstance(kit.fn, DraftSteps):
            raise DevgraphError(
                f"MultiStepGraphs serves a DraftSteps (k draft steps as one call), got {type(kit.fn).__name__}"
            )
        if not kit.config.batch_sizes:
            raise DevgraphError("MultiStepGraphs needs RunnerConfig(batch_sizes=...): the request buckets")
        self.kit = kit
        self.fn: DraftSteps = kit.fn
        self.sizes = sorted(kit.config.batch_sizes)
        self.buckets: list[int] | None = None
        self.exact_only: str | None = None
        self.stats = RunnerStats()
        self.graphs: dict[int, tuple[MultiStepGraph, torch.Tensor]] = {}

    def capture(self, example: Call) -> None:
        inputs, kit = self.kit.inputs, self.kit

        def prepare(size: int) -> tuple[Callable[[], Any], Callable[[], None]]:
            args, kwargs = inputs.bound_at(example, size)

            def capture() -> None:
                graph = MultiStepGraph(kit.device, self.fn.steps)
                with graph.capture(kit.shared.stream, kit.shared.pool), self.fn.marking(graph.step):
                    out = self.fn(*args, **kwargs)
                self.graphs[size] = (graph, out)

            return (lambda: self.fn(*args, **kwargs)), capture

        verdict = kit.loop.run(
            self.sizes,
            prepare,
            stats=self.stats,
            words=self.words,
            example=example,  # the runner's padding check: padded rows must leave real rows as eager
            summary=f"captured {len(self.sizes)} {self.words.graphs} of {self.fn.steps} steps (batch sizes {{sizes}})",
        )
        self.exact_only = verdict.exact_only if verdict is not None else None
        if self.exact_only is None and verdict is not None and verdict.out_dims not in (None, [0]):
            self.exact_only = f"the drafted tokens' rows are not dim 0 of the output ({verdict.out_dims})"
        self.buckets = self.sizes

    def replay(self, call: Call, size: int, host_args: Mapping[str, Any] | None) -> Any:
        graph, out = self.graphs[size]
        if host_args:
            per_op = {op: step_lengths(values, graph.steps) for op, values in host_args.items()}
            graph.replay([{op: lengths[i] for op, lengths in per_op.items()} for i in range(graph.steps)])
        else:
            graph.replay(None)
        return out

    def cut(self, outputs: Any, size: int, batch: int) -> Any:
        return outputs[:batch]

    def beyond(self, call: Call, why: Unsupported) -> Any:
        raise why

    def drop(self) -> None:
        for graph, _ in self.graphs.values():
            graph.reset()
        self.graphs = {}
        self.buckets = None


@attrs.frozen
class FamilyStats:
    """One family's counts (``GraphFamilies.stats()``): ``graphs`` captured, ``capture_seconds``,
    ``pool_bytes`` (the device's reserved memory grown during this family's capture, in the shared
    pool), ``replays``, ``eager_calls`` and ``fallbacks`` (eager calls by reason), ``never_replayed``
    (captured, not one replay when last reported)."""

    name: str
    graphs: int
    capture_seconds: float
    pool_bytes: int
    replays: int
    eager_calls: int
    fallbacks: Mapping[str, int]
    never_replayed: bool


@attrs.define
class AcceptanceStats:
    """The acceptance canary: tokens proposed (drafted) and accepted so far (``proposed``, as
    ``devgraph.adapters.hf``'s ``SpeculativeStats`` names it), and how often the acceptance differed
    from eager's on the same inputs (``eager_mismatches``, each warned)."""

    accepted: int = 0
    proposed: int = 0
    rounds: int = 0
    eager_checks: int = 0
    eager_mismatches: int = 0

    @property
    def rate(self) -> float | None:
        """Accepted / proposed (None before any draft)."""
        return self.accepted / self.proposed if self.proposed else None


class Family:
    """One family: a ``GraphRunner`` called like its model; a verify family checks the token count.

    ``tokens_per_request``: None for a decode or draft family; ``k + 1`` for a verify family, whose
    calls must carry ``requests x (k + 1)`` tokens (the first tensor argument's rows).
    """

    def __init__(self, name: str, runner: GraphRunner, graphs: int, tokens_per_request: int | None) -> None:
        self.name = name
        self.runner = runner
        self.graphs = graphs  # the graphs it captures: one per bucket
        self.tokens_per_request = tokens_per_request

    @property
    def stats(self) -> RunnerStats:
        return self.runner.stats

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        per = self.tokens_per_request
        if per is not None:
            tokens = _tokens(args, kwargs)
            if tokens % per != 0:
                # Never replayed: a bucket would pad it to a verify size it is not (counted, warned).
                with self.runner._lock:
                    self.runner.note_fallback(
                        VERIFY_TOKEN_COUNT,
                        f"verify family {self.name!r} got {tokens} tokens, not requests x (k + 1) = "
                        f"requests x {per} ({VERIFY_TOKEN_COUNT}): a verify graph is never replayed at "
                        "another token count",
                    )
                return self.runner.fn(*args, **kwargs)
        return self.runner(*args, **kwargs)

    def snapshot(self, never_replayed: bool) -> FamilyStats:
        s = self.runner.stats
        return FamilyStats(
            name=self.name,
            graphs=len(s.captured_sizes),
            capture_seconds=s.capture_seconds,
            pool_bytes=s.pool_bytes,
            replays=s.replays,
            eager_calls=s.eager_calls,
            fallbacks=dict(s.fallbacks),
            never_replayed=never_replayed,
        )

    def __repr__(self) -> str:
        return f"<Family {self.name!r}: {self.graphs} graphs, sizes {self.runner.sizes}>"


def _tokens(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    raise DevgraphError("a verify family call needs a tensor argument whose rows are the tokens")


def _warn_unreplayed(families: Mapping[str, Family], warned: set[str]) -> list[str]:
    """Warn once per family captured but never replayed; the names of all such families."""
    names = [n for n, f in families.items() if f.runner.captured and f.stats.replays == 0]
    for name in names:
        if name not in warned:
            warned.add(name)
            warnings.warn(
                f"devgraph: graph family {name!r} captured {families[name].graphs} graph(s) that were never "
                "replayed: its capture time and pool memory bought nothing (a draft that is never called, or "
                "calls that all ran eagerly: see its fallbacks)",
                UserWarning,
                stacklevel=3,
            )
    return names


class GraphFamilies:
    """Several graph families (decode, verify, draft, ...) over one pool, one side stream, one budget.

    Args:
        device: the device every family captures on.
        capture_budget: the most graphs all families may capture together (a backend's per-stack
            limit; None: no limit).

    Add families with ``add`` (a plain runner), ``add_verify`` (``k + 1`` tokens per request) and
    ``add_draft`` (``k`` steps as one ``MultiStepGraph`` per bucket); call one as ``families[name](...)``
    with its model's arguments.
    """

    def __init__(self, device: Device, *, capture_budget: int | None = None) -> None:
        if capture_budget is not None and (
            isinstance(capture_budget, bool) or not isinstance(capture_budget, int) or capture_budget < 1
        ):
            raise DevgraphError(f"capture_budget must be a positive int or None, got {capture_budget!r}")
        self.device = device
        self.capture_budget = capture_budget
        #: the one pool and side stream every family captures into
        self.shared = SharedPool(device, stream=device.stream())
        self.families: dict[str, Family] = {}
        self.acceptance = AcceptanceStats()
        self._warned: set[str] = set()
        self._finalizer = weakref.finalize(self, _warn_unreplayed, self.families, self._warned)

    # -- building --------------------------------------------------------------------------------

    def add(
        self,
        name: str,
        fn: Callable[..., Any],
        config: RunnerConfig,
        *,
        part: Callable[[Kit], Any] | None = None,
        tokens_per_request: int | None = None,
    ) -> Family:
        """A family ``name`` of ``fn`` served by a ``GraphRunner`` (one graph per batch size).

        Raises:
            DevgraphError: the name is taken, ``config`` has no ``batch_sizes``, or the families' graphs
                would exceed ``capture_budget`` (each family's count named).
        """
        if name in self.families:
            raise DevgraphError(f"a graph family named {name!r} exists already")
        if not config.batch_sizes:
            raise DevgraphError(
                f"graph family {name!r} needs RunnerConfig(batch_sizes=...): its graphs count against the "
                "shared capture budget"
            )
        graphs = len(config.batch_sizes)
        self._check_budget(name, graphs)
        runner = GraphRunner(fn, self.device, config, part=part, shared=self.shared)
        family = Family(name, runner, graphs, tokens_per_request)
        self.families[name] = family
        return family

    def add_verify(
        self, name: str, fn: Callable[..., Any], config: RunnerConfig, *, k: int, requests: Sequence[int]
    ) -> Family:
        """A verify family: calls of ``k + 1`` tokens per request; one graph per request count in
        ``requests``, each at ``requests x (k + 1)`` tokens (``config.batch_sizes`` is set from them)."""
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise DevgraphError(f"add_verify needs k >= 1 drafted tokens, got {k!r}")
        sizes = tuple(int(r) * (k + 1) for r in requests)
        return self.add(name, fn, attrs.evolve(config, batch_sizes=sizes), tokens_per_request=k + 1)

    def add_draft(
        self, name: str, model: Callable[..., torch.Tensor], config: RunnerConfig, *, k: int
    ) -> Family:
        """A draft family: ``k`` steps of ``model`` (``DraftSteps``) captured as one ``MultiStepGraph``
        per request count in ``config.batch_sizes``; called as ``DraftSteps.forward``."""
        return self.add(name, DraftSteps(model, k), config, part=MultiStepGraphs)

    def _check_budget(self, name: str, graphs: int) -> None:
        if self.capture_budget is None:
            return
        counts = {n: f.graphs for n, f in self.families.items()} | {name: graphs}
        total = sum(counts.values())
        if total > self.capture_budget:
            each = ", ".join(f"{n}: {c}" for n, c in counts.items())
            raise DevgraphError(
                f"graph families would capture {total} graphs ({each}), over capture_budget="
                f"{self.capture_budget}: give the families fewer batch sizes (requests), or set "
                f"GraphFamilies(capture_budget={total}) if this device's stack captures that many"
            )

    # -- calling ---------------------------------------------------------------------------------

    def __getitem__(self, name: str) -> Family:
        try:
            return self.families[name]
        except KeyError:
            raise DevgraphError(
                f"no graph family {name!r}; the families are {sorted(self.families)}"
            ) from None

    def note_acceptance(self, accepted: int, proposed: int, *, eager_accepted: int | None = None) -> None:
        """Count one round's accepted and proposed (drafted) tokens (the acceptance canary in
        ``stats()``); with ``eager_accepted`` (eager's acceptance on the same inputs), warn and count
        when they differ."""
        acc = self.acceptance
        acc.accepted += int(accepted)
        acc.proposed += int(proposed)
        acc.rounds += 1
        if eager_accepted is not None:
            acc.eager_checks += 1
            if int(eager_accepted) != int(accepted):
                acc.eager_mismatches += 1
                warnings.warn(
                    f"devgraph: speculative acceptance from graphs ({int(accepted)} of {int(proposed)}) differs "
                    f"from eager's on the same inputs ({int(eager_accepted)}); {acc.eager_mismatches} "
                    "round(s) so far. The graphs are not serving what eager computes: check the families' "
                    "fallbacks and host arguments (devgraph.debug)",
                    UserWarning,
                    stacklevel=2,
                )

    # -- reporting -------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Each family's ``FamilyStats`` by name, and ``"acceptance"``: the ``AcceptanceStats``."""
        out: dict[str, Any] = {
            n: f.snapshot(f.runner.captured and f.stats.replays == 0) for n, f in self.families.items()
        }
        out["acceptance"] = self.acceptance
        return out

    def report(self) -> dict[str, Any]:
        """``stats()``, after warning once for each family captured but never replayed."""
        _warn_unreplayed(self.families, self._warned)
        return self.stats()

    def close(self) -> dict[str, Any]:
        """The last ``report()``; nothing more is warned when the families are collected."""
        out = self.report()
        self._finalizer.detach()
        return out

    @property
    def pool_bytes(self) -> int:
        """Pool growth of every family's capture together."""
        return sum(f.stats.pool_bytes for f in self.families.values())

    def __repr__(self) -> str:
        return f"<GraphFamilies on {self.device}: {list(self.families.values())}>"
