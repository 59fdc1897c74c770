"""GraphRunner: one call path in front of the model, whichever graphs serve it.

*Which graphs* is a part: ``WholeGraphs`` (``_whole.py``: one graph of the whole forward per
batch-size bucket, ``mode='full'``) or ``Pieces`` (``_pieces.py``: the model traced, split at its
splitting ops and each piece captured per size, ``mode='piecewise'``). ``full_and_piecewise`` is a
router over the two: uniform decode batches that fit a full-graph bucket to the whole graphs,
everything else to the pieces, both capturing into one ``SharedPool``. A part holds its own
``StaticInputs`` (the call's reading and matching, static buffers and padding, the weight watch),
``Accounts`` and ``CaptureLoop``; the runner holds the lock, the thread owner and the call path.

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
   cell), drops the part's graphs; the first call captures every size of the part.
4. match: ``StaticInputs.match``: the call is like the captured one (shapes but the batch dim,
   dtypes, devices, static tensors' addresses, constants, autocast, default dtype).
5. bucket: ``choose_bucket``, the smallest captured size holding the batch; with
   ``check_ranks="every_call"``, ``RankCheck.agree_on_call`` (``_ranks.py``): one all-gather, so
   every rank replays the same size or every rank raises. No size, or padding that changes the
   result (``StaticInputs.exact_only``): the part's ``beyond`` (whole graphs: eager; pieces: the
   compiled pieces uncaptured).
6. load: ``StaticInputs.load`` copies each batched tensor into the first rows of its static
   buffer and fills padding only in rows an earlier call left data in; ``padded_host_args`` pads
   the host lists to the bucket.
7. replay: the part's ``replay``: ``Graph.replay(host_args)`` per graph (on a backend whose tasks
   need a re-issue -- the CPU reference, NPU -- each task is re-issued with the new host values; on
   CUDA the values are only noted), the splitting ops run eagerly in between for pieces.
8. slice: the part cuts the outputs to the real batch along the dim that grows with the bucket;
   inputs the forward writes in place (seen at capture) get their real rows back from the static
   buffers (``StaticInputs.store_written``), as eager would have written them.

Any ``Unsupported`` on the way runs the model eagerly (``_eager``), counted by reason.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import attrs
import torch

from devgraph._errors import DevgraphError
from devgraph.compile import CompileConfig
from devgraph.graph import Device, Graph, SharedPool
from devgraph.runner._accounts import Accounts
from devgraph.runner._breakable import BreakableGraphs
from devgraph.runner._buckets import choose_bucket
from devgraph.runner._calls import Call, Unsupported
from devgraph.runner._capture_loop import CaptureLoop
from devgraph.runner._config import MODE_TABLE, RunnerConfig, RunnerStats, positive_int, positive_ints
from devgraph.runner._grad import for_grad
from devgraph.runner._inputs import StaticInputs
from devgraph.runner._padding import CATEGORY as PADDING_CATEGORY
from devgraph.runner._pieces import Pieces
from devgraph.runner._threads import ThreadOwner
from devgraph.runner._weights import registrations
from devgraph.runner._whole import WholeGraphs

__all__ = ["GraphRunner", "Part", "piecewise_runner"]


class Part(Protocol):
    """Which graphs serve a runner's calls: what the one call path needs of them.

    ``WholeGraphs`` and ``Pieces`` are the two today. A part captures every size it serves from one
    example call (``capture``, run inside ``capture_loop.all_or_nothing``), replays a call the runner
    loaded into ``inputs`` at a bucket (``replay``, outputs cut to the call's rows), and serves a call
    no bucket can (``beyond``: raise the ``Unsupported`` for an eager run, or serve it another way).
    """

    kind: str  # the mode's word: "full", "piecewise"
    match_word: str  # what the call is matched against: "captured", "traced"
    size_word: str  # how its sizes are named in messages
    sizes: list[int]  # the sizes asked for
    buckets: list[int]  # the sizes a call is bucketed into (the captured ones)
    inputs: StaticInputs
    accounts: Accounts
    capture_loop: CaptureLoop

    @property
    def stats(self) -> RunnerStats: ...

    @property
    def captured(self) -> bool: ...

    def capture(self, example: Call) -> None: ...

    def drop(self) -> None: ...

    def replay(self, call: Call, size: int, host_args: Mapping[str, Any] | None) -> Any: ...

    def beyond(self, call: Call, why: Unsupported) -> Any: ...


class GraphRunner:
    """Serve calls of ``fn`` from captured graphs (the call path: this module's docstring).

    Args:
        fn: the model (an ``nn.Module`` or any callable taking tensors).
        device: the devgraph device to capture on.
        config: a ``RunnerConfig``; its ``mode`` picks the parts ('full', 'piecewise',
            'full_and_piecewise').
        compile_config: a ``CompileConfig`` for the pieces (splitting ops, compiler, passes, sizes);
            its ``mode`` wins over ``config.mode`` when given.
        caller_serialises: the caller consumes every output under its own lock before any other
            call is made, so calls from several threads are safe without ``clone_outputs``.
    Raises:
        DevgraphError: ``full_and_piecewise`` without a way to tell decode batches (``is_decode``);
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
    ) -> None:
        config = config or RunnerConfig()
        mode = compile_config.mode if compile_config is not None else config.mode
        config = attrs.evolve(config, mode=mode) if config.mode != mode else config
        self.fn = fn
        self.device = device
        self.config = config
        # What ``fresh`` builds a like runner from (a copy of a wrapper gets one, nothing captured).
        self._built_with = (compile_config, caller_serialises, is_decode)
        self._lock = threading.RLock()
        self._grad = False  # the call in progress was made in grad mode
        self._params: tuple[int, tuple[torch.Tensor, ...]] = (-1, ())  # (registrations seen, parameters)
        self.threads = ThreadOwner(config, caller_serialises)
        # One side stream for every capture of the runner, and one pool shared by its parts.
        shared = SharedPool(device, stream=device.stream())
        self.full: WholeGraphs | None = None
        self.pieces: Pieces | None = None
        self.breakable: BreakableGraphs | None = None
        self.is_decode: Callable[..., bool] | None = None
        if mode == "full":
            self.full = WholeGraphs(fn, device, config, shared, self._lock)
            self.part: Part = self.full
            return
        if MODE_TABLE[mode].serves == "breakable":
            self._breakable_parts(fn, device, config, shared, is_decode)
            return
        compile_config = compile_config or CompileConfig(mode=mode)
        if MODE_TABLE[mode].routes:
            self.is_decode = compile_config.is_decode or getattr(fn, "devgraph_is_decode", None)
            if self.is_decode is None:
                raise DevgraphError(
                    "mode='full_and_piecewise' needs to tell uniform decode batches (full graph) from prefill "
                    "and mixed batches (piecewise): pass is_decode=fn, called with the call's arguments by "
                    "name and returning True for a decode batch (or give the model a devgraph_is_decode method)"
                )
            self.full = WholeGraphs(fn, device, attrs.evolve(config, mode="full"), shared, self._lock)
        self.pieces = Pieces(
            fn,
            device,
            config,
            compile_config,
            shared,
            self._lock,
            full_sizes=self.full.sizes if self.full else None,
            full_stats=self.full.stats if self.full else None,
        )
        self.part = self.pieces

    def _breakable_parts(
        self,
        fn: Callable[..., Any],
        device: Device,
        config: RunnerConfig,
        shared: SharedPool,
        is_decode: Callable[..., bool] | None,
    ) -> None:
        """``breakable``: breakable graphs serve every call; ``full_and_breakable``: whole graphs
        serve uniform decode batches (``is_decode``), breakable graphs the rest."""
        if MODE_TABLE[config.mode].routes:
            self.is_decode = is_decode or getattr(fn, "devgraph_is_decode", None)
            if self.is_decode is None:
                raise DevgraphError(
                    "mode='full_and_breakable' needs to tell uniform decode batches (whole graphs) from "
                    "prefill and mixed batches (breakable graphs): pass is_decode=fn, called with the call's "
                    "arguments by name and returning True for a decode batch (or give the model a "
                    "devgraph_is_decode method)"
                )
            self.full = WholeGraphs(
                fn, device, attrs.evolve(config, mode="full", breaks=()), shared, self._lock
            )
        self.breakable = BreakableGraphs(
            fn, device, config, shared, self._lock, full_stats=self.full.stats if self.full else None
        )
        self.part = self.breakable

    # -- what the primary part holds -------------------------------------------------------------

    @property
    def stats(self) -> Any:
        """The primary part's counters (``RunnerStats``; ``PiecewiseStats`` with pieces)."""
        return self.part.stats

    @property
    def sizes(self) -> list[int]:
        """The sizes asked for (batch sizes; capture sizes in tokens with pieces)."""
        return self.part.sizes

    @property
    def inputs(self) -> StaticInputs:
        return self.part.inputs

    @property
    def accounts(self) -> Accounts:
        return self.part.accounts

    @property
    def capture_loop(self) -> CaptureLoop:
        return self.part.capture_loop

    @property
    def captured(self) -> bool:
        return self.part.captured

    def graph(self, batch_size: int) -> Graph:
        """The captured whole graph of bucket ``batch_size``.

        Raises:
            DevgraphError: no such graph, or this runner captures pieces only (``mode='piecewise'``).
        """
        if self.breakable is not None and self.full is None:
            raise DevgraphError(
                "this runner captures breakable graphs, not whole graphs; the segments of a size are "
                "runner.breakable.breakable_graph(size).graphs"
            )
        if self.full is None:
            raise DevgraphError(
                "this runner captures pieces, not whole graphs; the pieces' graphs are "
                "runner.pieces.graphs(size)"
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
        part = self.part
        try:
            call = part.inputs.read(args, kwargs)  # read
        except Unsupported as why:
            if self.full is not None and part is not self.full and self._is_decode_unread(args, kwargs):
                part = self.full  # a decode call: the full graphs' reader says why it cannot be served
                try:
                    call = part.inputs.read(args, kwargs)
                except Unsupported as again:
                    return self._eager(part, again, args, kwargs)
                return self.serve(call, args, kwargs, part)
            return self._eager(part, why, args, kwargs)
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
        return full if self.is_decode(**self.part.inputs.reader.arguments(call)) else self.part

    def serve(
        self, call: Call, args: tuple[Any, ...], kwargs: dict[str, Any], part: Part | None = None
    ) -> Any:
        """Serve a call already read by ``part`` (default: the primary one); ``args``/``kwargs`` run
        eagerly when it cannot be served from its graphs."""
        part = part or self.part
        inputs = part.inputs
        try:
            if call.batch == 0:
                raise Unsupported("empty_batch", "the call has 0 rows; there is nothing to replay")
            if inputs.watch.seen != registrations[0]:  # something registered a weight somewhere: look
                replaced = inputs.watch.replaced()
                if replaced is not None:
                    part.drop()  # captured again just below
                    part.accounts.note_recapture(replaced)
            guard = part.capture_loop.guard
            if guard is not None:  # a Python value the forward reads set since capture: capture again
                changed = guard.changed()
                if changed is not None:
                    part.drop()
                    part.accounts.note_changed(changed)
            if not part.captured:
                part.capture_loop.all_or_nothing(lambda: part.capture(call), part.drop)
            # match
            inputs.match(call, part.match_word)
            # bucket
            buckets = part.buckets
            size = choose_bucket(call.batch, buckets) if buckets else None
            if part.capture_loop.rank_check is not None:
                part.capture_loop.rank_check.agree_on_call(size)
            if size is None:
                top = f"1..{buckets[-1]}" if buckets else "none"
                return self._served(
                    call,
                    part.beyond(
                        call,
                        Unsupported(
                            "batch_too_large",
                            f"batch {call.batch} is outside the captured {part.size_word} ({top})",
                        ),
                    ),
                )
            if inputs.exact_only is not None and size != call.batch:
                return self._served(
                    call,
                    part.beyond(
                        call,
                        Unsupported(
                            PADDING_CATEGORY, f"{inputs.exact_only}; {part.size_word} {buckets} still replay"
                        ),
                    ),
                )
            # load
            inputs.load(call, size)
            host_args = inputs.padded_host_args(call.host, size) if self.config.host_args else None
            if self.config.debug:
                inputs.weights.check(self.fn)
            # replay, slice
            out = part.replay(call, size, host_args)
            if inputs.written_by_model:  # the forward writes its inputs: so must the call, as eager
                inputs.store_written(call)
            part.stats.replays += 1
            return self._served(call, out) if self._grad else out
        except Unsupported as why:
            unsupported = why
        # Outside the except block: an error of the model's own eager run is not chained to ours.
        return self._eager(part, unsupported, args, kwargs)

    def _eager(self, part: Part, why: Unsupported, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        part.accounts.note_fallback(why.category, why.detail)
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

    def _is_decode_unread(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """``is_decode`` for a call the reader refused (it binds, but holds something no graph can
        take): such a decode call goes to the full graphs, whose reader reports why."""
        assert self.is_decode is not None
        try:
            bound = self.part.inputs.signature.bind(*args, **kwargs)
        except TypeError:
            return False
        bound.apply_defaults()
        return bool(self.is_decode(**bound.arguments))

    # -- public --------------------------------------------------------------------------------

    def capture(self, *example_args: Any, **example_kwargs: Any) -> GraphRunner:
        """Capture every size of every part now, from an example call (any size) for shapes and types.

        Raises:
            DevgraphError: the example cannot be captured (the message says why).
        """
        with self._lock, torch.no_grad():
            self._drop()
            try:
                for part in self._parts():
                    try:
                        call = part.inputs.read(example_args, example_kwargs)
                    except Unsupported as why:
                        raise DevgraphError(f"cannot capture from this example call: {why.detail}") from None
                    part.capture_loop.all_or_nothing(lambda: part.capture(call), part.drop)  # noqa: B023
            except BaseException:
                self._drop()  # every part's graphs or none
                raise
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
        compile_config, caller_serialises, is_decode = self._built_with
        return GraphRunner(
            fn,
            device or self.device,
            self.config,
            compile_config,
            caller_serialises=caller_serialises,
            is_decode=is_decode,
        )

    def note_fallback(self, category: str, detail: str) -> None:
        """Account for a call served without graphs: raise when ``strict``, else count it in
        ``stats.fallbacks[category]`` and ``stats.eager_calls`` and warn once per category.

        Raises:
            DevgraphError: ``strict=True``.
        """
        self.part.accounts.note_fallback(category, detail)

    def padded_host_args(self, host: dict[str, list[Any]], size: int) -> dict[str, list[Any]]:
        """The updatable tasks' host arguments for a call's host lists padded to bucket ``size``
        (``{op argument: values}``, as ``Graph.replay(host_args=...)`` takes them)."""
        return self.part.inputs.padded_host_args(host, size)

    def _parts(self) -> list[Part]:
        return [self.part] + ([self.full] if self.full is not None and self.full is not self.part else [])

    def _drop(self) -> None:
        for part in self._parts():
            part.drop()

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
