"""GraphRunner: one call path in front of the model, whichever graphs serve it.

*Which graphs* is a part (``_part.py``): ``WholeGraphs`` (``_whole.py``: one graph of the whole forward
per batch-size bucket, ``mode='full'``; with ``breaks``, one breakable graph per bucket,
``mode='breakable'``) or ``Pieces`` (``_pieces.py``: the model traced, split at its splitting ops and
each piece captured per size, ``mode='piecewise'``). ``MODE_TABLE`` (``_config.py``) says which part a
mode serves from and whether whole graphs serve uniform decode batches first (the ``full_and_*``
modes: both parts capture into one ``SharedPool``); ``PARTS`` below builds it. The runner holds what
every part shares: the lock, the thread owner, one ``StaticInputs`` (reading, matching, static buffers
and padding, the weight watch), one ``CaptureLoop`` and one ``Accounts``, and the call path.

One call, top to bottom (``graphed(**batch)``; ``__call__`` and ``serve`` below, in this order):

1. lock, thread, autograd: take the lock, claim the calling thread (outputs are views of graph
   memory), turn autograd off (a caller in grad mode gets outputs that require grad as eager's do,
   whose backward raises by name: ``for_grad``; an eager fallback runs in the caller's grad mode).
2. read: ``StaticInputs.read`` -> ``CallReader.read`` (``_calls.py``): bind the arguments to the
   forward's signature -- in full for the first call of each shape, then by the binding
   remembered for that shape -- and classify them into a ``Call``: batched tensors, static
   tensors, host lists, constants, and the batch size; ``route`` picks the part.
3. an empty batch falls back; a weight replaced since capture (``WeightWatch``), or a Python value
   the forward reads changed since capture (``AttributeGuard``: a flag, a training flag, a closure
   cell), drops every part's graphs; the first call a part serves captures every size of it.
4. match: ``StaticInputs.match``: the call is like the captured one (shapes but the batch dim,
   dtypes, devices, static tensors' addresses, constants, autocast, default dtype).
5. bucket: the smallest captured size holding the batch (``choose_bucket``); with
   ``check_ranks="every_call"``, ``RankCheck.agree_on_call`` (``_ranks.py``): one all-gather, so
   every rank replays the same size or every rank raises. No size, or padding that changes the
   result (the part's ``exact_only``): the part's ``beyond`` (whole graphs: eager; pieces: the
   compiled pieces uncaptured).
6. load: ``StaticInputs.load`` copies each batched tensor into the first rows of its static
   buffer and fills padding only in rows an earlier call left data in; ``padded_host_args`` pads
   the host lists to the bucket.
7. replay: the part's ``replay``: ``Graph.replay(host_args)`` per graph (on a backend whose tasks
   need a re-issue -- the CPU reference, NPU -- each task is re-issued with the new host values; on
   CUDA the values are only noted), the splitting ops or breaks run eagerly in between.
8. cut: the part's ``cut`` cuts the outputs to the real batch along the dim that grows with the
   bucket; inputs the forward writes in place (seen at capture) get their real rows back from the
   static buffers (``StaticInputs.store_written``), as eager would have written them.

Any ``Unsupported`` on the way runs the model eagerly (``_eager``), counted by reason.
"""

from __future__ import annotations

import bisect
import itertools
import threading
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch

from devgraph._errors import DevgraphError
from devgraph.compile import CompileConfig
from devgraph.graph import Device, Graph, SharedPool
from devgraph.runner._accounts import Accounts
from devgraph.runner._buckets import choose_bucket
from devgraph.runner._calls import Call, Unsupported
from devgraph.runner._capture_loop import CaptureLoop
from devgraph.runner._config import MODE_TABLE, RunnerConfig, RunnerStats, positive_int, positive_ints
from devgraph.runner._grad import for_grad
from devgraph.runner._inputs import StaticInputs
from devgraph.runner._padding import CATEGORY as PADDING_CATEGORY
from devgraph.runner._part import Kit, Part
from devgraph.runner._pieces import Pieces
from devgraph.runner._threads import ThreadOwner
from devgraph.runner._weights import registrations
from devgraph.runner._whole import BreakableStats, WholeGraphs

__all__ = ["PARTS", "GraphRunner", "piecewise_runner"]

#: How the runner builds the part a mode serves from (``MODE_TABLE[mode].serves``): ``kit``, the
#: ``CompileConfig`` it was given (None: the mode's defaults) and, in the ``full_and_*`` modes, the
#: whole graphs beside it (None else).
PartFactory = Callable[[Kit, CompileConfig | None, WholeGraphs | None], Part]
PARTS: dict[str, PartFactory] = {
    "whole": lambda kit, cc, full: WholeGraphs(kit),
    "pieces": lambda kit, cc, full: Pieces(
        kit,
        cc or CompileConfig(mode=kit.config.mode),
        full_sizes=full.sizes if full else None,
        full_stats=full.stats if full else None,
    ),
    "breakable": lambda kit, cc, full: WholeGraphs(
        kit, BreakableStats(full=full.stats if full else None), breaks=kit.config.breaks
    ),
}


class GraphRunner:
    """Serve calls of ``fn`` from captured graphs (the call path: this module's docstring).

    Args:
        fn: the model (an ``nn.Module`` or any callable taking tensors).
        device: the devgraph device to capture on.
        config: a ``RunnerConfig``; its ``mode`` picks the parts (``MODE_TABLE``).
        compile_config: a ``CompileConfig`` for the pieces (splitting ops, compiler, passes, sizes);
            its ``mode`` wins over ``config.mode`` when given.
        caller_serialises: the caller consumes every output under its own lock before any other
            call is made, so calls from several threads are safe without ``clone_outputs``.
        is_decode: in the ``full_and_*`` modes, tells a uniform decode batch (called with the call's
            arguments by name; default the model's ``devgraph_is_decode``).
        part: build the part that serves every call from the runner's ``Kit`` instead of the mode's
            (a part of your own: ``devgraph.runner.Part``).
        shared: the pool and side stream to capture into (None: a pool and stream of this runner's
            own); several runners given one capture into one pool (``GraphFamilies``).
    Raises:
        DevgraphError: a ``full_and_*`` mode without a way to tell decode batches (``is_decode``);
            a compiler this device cannot run; an unknown pass.

    Threads: calls are serialised by a lock. Outputs are views of graph memory overwritten by the
    next call, so unless ``clone_outputs=True`` one live thread at a time may call; a second one
    gets a ``DevgraphError`` naming ``clone_outputs=True`` (a call's output is never another's).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        device: Device,
        config: RunnerConfig | None = None,
        compile_config: CompileConfig | None = None,
        *,
        caller_serialises: bool = False,
        is_decode: Callable[..., bool] | None = None,
        part: Callable[[Kit], Part] | None = None,
        shared: SharedPool | None = None,
    ) -> None:
        config = config or RunnerConfig()
        mode = compile_config.mode if compile_config is not None else config.mode
        config = attrs.evolve(config, mode=mode) if config.mode != mode else config
        self.fn = fn
        self.device = device
        self.config = config
        # What ``fresh`` builds a like runner from (a copy of a wrapper gets one, nothing captured).
        self._built_with = (compile_config, caller_serialises, is_decode, part)
        self._lock = threading.RLock()
        self._grad = False  # the call in progress was made in grad mode
        self._params: tuple[int, tuple[torch.Tensor, ...]] = (-1, ())  # (registrations seen, parameters)
        self.threads = ThreadOwner(config, caller_serialises)
        # One set of static inputs, one capture loop and one set of accounts for every part; one side
        # stream for every capture and one pool the parts share (``shared``: with other runners too).
        shared = shared if shared is not None else SharedPool(device, stream=device.stream())
        self.shared = shared
        self.inputs = StaticInputs(fn, device, config)
        self.accounts = Accounts(config, RunnerStats(), self._lock, "from a graph")
        self.capture_loop = CaptureLoop(self.inputs, device, config, self.accounts, shared)
        kit = Kit(fn, device, config, shared, self._lock, self.inputs, self.accounts, self.capture_loop)
        table = MODE_TABLE[mode]
        self.is_decode: Callable[..., bool] | None = None
        #: the whole graphs that serve uniform decode batches first in the ``full_and_*`` modes (and
        #: every call in ``full``)
        self.full: WholeGraphs | None = None
        if table.routes and part is None:
            self.is_decode = (
                is_decode
                or (compile_config.is_decode if compile_config is not None else None)
                or getattr(fn, "devgraph_is_decode", None)
            )
            if self.is_decode is None:
                other = "piecewise" if table.serves == "pieces" else "breakable graphs"
                raise DevgraphError(
                    f"mode={mode!r} needs to tell uniform decode batches (whole graphs) from prefill and "
                    f"mixed batches ({other}): pass is_decode=fn, called with the call's arguments by name "
                    "and returning True for a decode batch (or give the model a devgraph_is_decode method)"
                )
            self.full = WholeGraphs(attrs.evolve(kit, config=attrs.evolve(config, mode="full", breaks=())))
        if part is not None:
            self.part: Part = part(kit)
        else:
            self.part = PARTS[table.serves](kit, compile_config, self.full)
        if self.full is None and isinstance(self.part, WholeGraphs) and not self.part.breakable:
            self.full = self.part
        self.accounts.stats = self.part.stats  # calls are counted in the primary part's stats
        self.accounts.serve_what = self.part.words.serve_what
        self.parts: list[Part] = [self.part] + ([self.full] if self.full not in (None, self.part) else [])
        # What ``devgraph.bisect``, ``debug`` and tests reach for by name.
        self.pieces: Pieces | None = self.part if isinstance(self.part, Pieces) else None
        self.breakable: WholeGraphs | None = (
            self.part if isinstance(self.part, WholeGraphs) and self.part.breakable else None
        )
        # Static buffers of enough rows for every part (pieces trace at 2 rows at least).
        self._rows = max(2, *(max(p.sizes, default=1) for p in self.parts))

    # -- what the primary part holds -------------------------------------------------------------

    @property
    def stats(self) -> Any:
        """The runner's counters (the primary part's: ``RunnerStats``; ``PiecewiseStats`` with pieces,
        ``BreakableStats`` with breakable graphs; the whole graphs' own in ``stats.full``)."""
        return self.part.stats

    @property
    def sizes(self) -> list[int]:
        """The sizes asked for (batch sizes; capture sizes in tokens with pieces)."""
        return self.part.sizes

    @property
    def captured(self) -> bool:
        return self.part.buckets is not None

    def graph(self, batch_size: int) -> Graph:
        """The captured whole graph of bucket ``batch_size``.

        Raises:
            DevgraphError: no such graph, or this runner captures pieces or breakable graphs only.
        """
        if self.full is None:
            where = (
                "runner.breakable.breakable_graph(size).graphs"
                if self.breakable is not None
                else "runner.pieces.graphs(size)"
            )
            raise DevgraphError(
                f"this runner captures {self.part.words.graphs}, not whole graphs; its graphs are {where}"
            )
        return self.full.graph(batch_size)

    # -- a call, top to bottom -----------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Serve one call (its path, step by step: this module's docstring).

        Raises:
            DevgraphError: a call from a second live thread while outputs are views of graph memory
                (``clone_outputs=False``): the next replay would overwrite the first thread's result.
        """
        with self._lock:
            self.threads.claim()
            if not torch.is_grad_enabled():  # entering no_grad costs as much as reading the call
                return self._call(args, kwargs)
            outer, self._grad = self._grad, True
            try:
                with torch.no_grad():
                    return self._call(args, kwargs)
            finally:
                self._grad = outer

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        inputs = self.inputs
        try:
            call = inputs.read(args, kwargs)  # read
        except Unsupported as why:
            return self._eager(why, args, kwargs)
        return self.serve(call, args, kwargs, self.route(call))

    def route(self, call: Call) -> Part:
        """The part that serves a call: in ``full_and_*`` modes a uniform decode batch that fits a
        full-graph bucket goes to the whole graphs (larger decode batches, prefill and mixed
        batches to the other part)."""
        full = self.full
        if full is None or self.part is full or self.is_decode is None:
            return self.part
        if choose_bucket(call.batch, full.sizes) is None:
            return self.part
        return full if self.is_decode(**self.inputs.reader.arguments(call)) else self.part

    def serve(
        self, call: Call, args: tuple[Any, ...], kwargs: dict[str, Any], part: Part | None = None
    ) -> Any:
        """Serve a call read by the runner's inputs from ``part`` (default: the primary one);
        ``args``/``kwargs`` run eagerly when it cannot be served from its graphs. In order: stale
        graphs dropped, the part captured on its first call, match, bucket, load, replay, cut, the
        inputs the forward writes stored back."""
        part = part or self.part
        inputs, loop = self.inputs, self.capture_loop
        try:
            if call.batch == 0:
                raise Unsupported("empty_batch", "the call has 0 rows; there is nothing to replay")
            if inputs.watch.seen != registrations[0]:  # something registered a weight somewhere: look
                replaced = inputs.watch.replaced()
                if replaced is not None:
                    self._drop()  # captured again just below
                    self.accounts.note_recapture(replaced)
            if loop.guard is not None:  # a Python value the forward reads set since capture: capture again
                changed = loop.guard.changed()
                if changed is not None:
                    self._drop()
                    self.accounts.note_changed(changed)
            buckets = part.buckets
            if buckets is None:
                loop.all_or_nothing(lambda: self._capture_part(part, call), self._drop)
                buckets = part.buckets or []
            # match
            inputs.match(call, part.words.match)
            # bucket
            i = bisect.bisect_left(buckets, call.batch)  # choose_bucket, inline: the smallest that holds it
            size = buckets[i] if i < len(buckets) else None
            if loop.rank_check is not None:
                loop.rank_check.agree_on_call(size)
            if size is None:
                top = f"1..{buckets[-1]}" if buckets else "none"
                why = Unsupported(
                    "batch_too_large",
                    f"batch {call.batch} is outside the captured {part.words.sizes} ({top})",
                )
                return self._served(call, part.beyond(call, why))
            if part.exact_only is not None and size != call.batch:
                why = Unsupported(
                    PADDING_CATEGORY, f"{part.exact_only}; {part.words.sizes} {buckets} still replay"
                )
                return self._served(call, part.beyond(call, why))
            # load
            inputs.load(call, size)
            host_args = inputs.padded_host_args(call.host, size) if self.config.host_args else None
            if self.config.debug:
                inputs.weights.check(self.fn)
            # replay, cut, store what the forward writes (as eager writes the caller's tensors)
            out = part.cut(part.replay(call, size, host_args), size, call.batch)
            if inputs.written_by_model:
                inputs.store_written(call)
            part.stats.replays += 1
            return self._served(call, out) if self._grad else out
        except Unsupported as why:
            unsupported = why
        # Outside the except block: an error of the model's own eager run is not chained to ours.
        return self._eager(unsupported, args, kwargs)

    def _capture_part(self, part: Part, example: Call) -> None:
        """Capture every size of ``part`` from ``example`` (inside ``all_or_nothing``): the static
        buffers first, once for every part, then the part's graphs."""
        if not self.inputs.buffers:
            self.inputs.alloc(example, self._rows)
        part.capture(example)
        self.inputs.remember(example)

    def _eager(self, why: Unsupported, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.accounts.note_fallback(why.category, why.detail)
        if self._grad:  # as the caller asked: its autograd graph and all
            with torch.enable_grad():
                return self.fn(*args, **kwargs)
        return self.fn(*args, **kwargs)

    def _served(self, call: Call, out: Any) -> Any:
        """A served call's outputs as a caller in grad mode gets them: requiring grad where an input
        or a parameter does (as eager's), a backward through them refused by name (``for_grad``)."""
        if not self._grad:
            return out
        tensors = itertools.chain(call.batched.values(), call.static.values(), self._parameters())
        anchor = next((t for t in tensors if t.requires_grad), None)
        if anchor is None:
            return out
        with torch.enable_grad():
            return for_grad(out, anchor)

    def _parameters(self) -> tuple[torch.Tensor, ...]:
        """The model's parameters, listed again only after a registration anywhere (a replaced one)."""
        seen, params = self._params
        if seen != registrations[0]:
            if isinstance(self.fn, torch.nn.Module):
                params = tuple(self.fn.parameters())
            else:  # a callable may name the parameters it reads (a Dynamo graph: its lifted weights)
                params = tuple(getattr(self.fn, "devgraph_parameters", tuple)())
            self._params = (registrations[0], params)
        return params

    # -- public --------------------------------------------------------------------------------

    def capture(self, *example_args: Any, **example_kwargs: Any) -> GraphRunner:
        """Capture every size of every part now, from an example call (any size) for shapes and types.

        Raises:
            DevgraphError: the example cannot be captured (the message says why).
        """
        with self._lock, torch.no_grad():
            self._drop()
            try:
                call = self.inputs.read(example_args, example_kwargs)
            except Unsupported as why:
                raise DevgraphError(f"cannot capture from this example call: {why.detail}") from None
            for part in self.parts:
                self.capture_loop.all_or_nothing(lambda: self._capture_part(part, call), self._drop)  # noqa: B023
        return self

    def reset(self) -> None:
        """Drop every captured graph of every part (the next call captures again).

        Outputs returned earlier are views of graph memory (unless ``clone_outputs=True``): after a
        reset that memory goes back to the pool and the next capture reuses it, so those views read
        garbage. Clone what you keep across a reset.
        """
        with self._lock:
            self._drop()

    def fresh(self, fn: Callable[..., Any], device: Device | None = None) -> GraphRunner:
        """A runner with this one's options over ``fn`` (on ``device``, default this one's), nothing
        captured: its first call captures. What a copy of a wrapper gets (graphs are never copied)."""
        compile_config, caller_serialises, is_decode, part = self._built_with
        return GraphRunner(
            fn,
            device or self.device,
            self.config,
            compile_config,
            caller_serialises=caller_serialises,
            is_decode=is_decode,
            part=part,
        )

    def note_fallback(self, category: str, detail: str) -> None:
        """Account for a call served without graphs: raise when ``strict``, else count it in
        ``stats.fallbacks[category]`` and ``stats.eager_calls`` and warn once per category.

        Raises:
            DevgraphError: ``strict=True``.
        """
        self.accounts.note_fallback(category, detail)

    def _drop(self) -> None:
        """Every part's graphs, the static inputs and the capture loop's record: all or nothing."""
        for part in self.parts:
            part.drop()
        self.inputs.clear()
        self.capture_loop.clear()

    def __repr__(self) -> str:
        return f"<GraphRunner {type(self.fn).__name__} on {self.device}, mode {self.config.mode}, sizes {self.sizes}>"


def piecewise_runner(
    fn: Callable[..., Any],
    device: Device,
    config: RunnerConfig,
    *,
    caller_serialises: bool = False,
    **options: Any,
) -> GraphRunner:
    """The runner ``devgraph.wrap`` builds for ``mode='piecewise'`` / ``'full_and_piecewise'``.

    ``options`` are ``CompileConfig`` fields (``splitting_ops``, ``compile_backend``, ``passes``,
    ``capture_sizes``, ``capture_budget``, ``traffic``, ``is_decode``); the mode is ``config.mode``.

    Raises:
        DevgraphError: what ``piecewise_config`` and ``GraphRunner`` raise.
    """
    return GraphRunner(
        fn, device, config, piecewise_config(config.mode, options), caller_serialises=caller_serialises
    )


def piecewise_config(mode: str, options: Mapping[str, Any]) -> CompileConfig:
    """The ``CompileConfig`` of ``wrap``'s compile ``options`` in ``mode``.

    Raises:
        DevgraphError: ``capture_sizes`` or ``capture_budget`` not positive integers (``2.5``, ``"4"``
            and ``True`` included), or an option ``CompileConfig`` refuses.
    """
    options = dict(options)
    if options.get("capture_sizes") is not None:
        options["capture_sizes"] = positive_ints("capture_sizes", options["capture_sizes"])
    if options.get("capture_budget") is not None:
        options["capture_budget"] = positive_int("capture_budget", options["capture_budget"])
    return CompileConfig(mode=mode, **options)
