"""``CaptureLoop``: how every part of a runner captures its sizes.

Every size captured largest first into one shared pool on one side stream (a ``SharedPool``:
parts of one runner share it in ``full_and_*`` modes), with garbage collection frozen
(``gc_frozen``), all sizes or none (``all_or_nothing``: what warm-ups, capture and the padding check
change in the model -- ``StateSnapshot``: tensors, attributes, containers, generators -- is put back,
and a forward that changes state a graph would freeze is refused by name).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from devgraph._console import announce
from devgraph._errors import CaptureError, DevgraphError
from devgraph.graph import Device, SharedPool
from devgraph.runner._accounts import Accounts
from devgraph.runner._calls import Call
from devgraph.runner._config import RunnerConfig, RunnerStats, Words
from devgraph.runner._gc_baseline import application_froze_objects
from devgraph.runner._guard import AttributeGuard
from devgraph.runner._inputs import StaticInputs, ambient
from devgraph.runner._model_state import capture_warnings
from devgraph.runner._padding import PaddingVerdict
from devgraph.runner._progress import progress, size_ranges
from devgraph.runner._ranks import RankCheck, capture_context, check_capture
from devgraph.runner._snapshot import Change, StateSnapshot, traced_state

__all__ = ["CaptureLoop", "Prepare", "gc_frozen"]

logger = logging.getLogger("devgraph")

#: ``prepare(size)`` returns ``(warm_up, capture)``: one eager run of the model at ``size``, and
#: the capture of that size (into the part's graph set, on the shared pool's stream).
Prepare = Callable[[int], tuple[Callable[[], Any], Callable[[], None]]]


class _GcState:
    """What ``gc_frozen`` found on entry, kept while any thread is inside it."""

    lock = threading.RLock()
    depth = 0
    was_enabled = True
    froze = False


@contextlib.contextmanager
def gc_frozen() -> Iterator[None]:
    """Collect once, then freeze and disable collection while capturing; restore exactly what was found.

    A collection during capture would walk every live object (``torch.cuda.graph`` collects on
    entry, SGLang freezes for that reason). The application's own state comes back as it was: gc
    enabled or disabled, and the objects it froze itself (vLLM and SGLang ``gc.freeze()`` after
    start-up) stay frozen. ``gc.unfreeze()`` is all or nothing, so when the application has frozen
    objects already, devgraph freezes nothing more (collection stays disabled while capturing);
    objects the interpreter keeps frozen itself (CPython 3.12's immortal ones) do not count.
    Nested and concurrent uses share one entry: the first in saves the state, the last out restores it.
    """
    with _GcState.lock:
        if _GcState.depth == 0:
            _GcState.was_enabled = gc.isenabled()
            gc.disable()
            gc.collect()
            _GcState.froze = not application_froze_objects()
            if _GcState.froze:
                gc.freeze()
        _GcState.depth += 1
    try:
        yield
    finally:
        with _GcState.lock:
            _GcState.depth -= 1
            if _GcState.depth == 0:
                if _GcState.froze:
                    gc.unfreeze()
                if _GcState.was_enabled:
                    gc.enable()


class CaptureLoop:
    """How a runner captures, one loop for every part: ``all_or_nothing`` around a part's capture,
    ``run`` over its sizes.

    ``rank_check`` is the per-call rank check (``check_ranks="every_call"``), set by ``run`` (None:
    nothing is exchanged per call).
    """

    def __init__(
        self,
        inputs: StaticInputs,
        device: Device,
        config: RunnerConfig,
        accounts: Accounts,
        shared: SharedPool,
    ) -> None:
        self.inputs = inputs
        self.device = device
        self.config = config
        self.accounts = accounts
        self.shared = shared
        self.rank_check: RankCheck | None = None
        #: what the capture's runs changed, by path, kept while the state is put back between sizes
        self._changed: dict[str, Change] = {}
        self._per_size = False
        #: The model's state before this capture began (set while ``all_or_nothing`` runs): the
        #: padding check starts each of its runs from it and compares what they change.
        self.state: StateSnapshot | None = None
        #: The Python values the forward reads, as at capture (set when a capture succeeded): the
        #: runner compares them at every call and captures again when one changed.
        self.guard: AttributeGuard | None = None

    def clear(self) -> None:
        """Forget the capture (a runner's reset)."""
        self.guard = None
        self.rank_check = None

    def all_or_nothing(self, build: Callable[[], None], drop: Callable[[], None]) -> None:
        """Run ``build`` (the runner's capture of every size); on any failure ``drop`` it all.

        Everything reachable from the model (``StateSnapshot``) is put back afterwards as it was
        before the first warm-up: tensors written in place (the graphs replay the write, so they
        advance once per real call as in eager), attributes, containers, and the random-number
        generators (so the first served call draws what eager's first call would).

        Raises:
            DevgraphError: the forward changes state a graph freezes (a Python attribute, a list or
                dict, a tensor it stores or rebinds, a parameter too large to copy written in
                place), named by path; whatever ``build`` raises.
        """
        fn = self.inputs.fn
        capture_warnings(fn, self.accounts.warned)
        state = self.state = StateSnapshot(fn, self.device.torch_device)
        self._changed = {}
        # A graph Dynamo traced declares the few tensors it writes: cheap to put back after every size.
        # An untraced model's snapshot is everything reachable from it, compared and put back once.
        self._per_size = traced_state(fn) is not None
        try:
            build()
        except BaseException:
            # A half-captured runner would replay some sizes and not others: drop it all.
            drop()
            state.restore()
            raise
        finally:
            self.state = None
        changes = list({**self._changed, **{c.path: c for c in state.changes()}}.values())
        state.restore()
        frozen = [c.what for c in changes if not c.replayable]
        if frozen:
            drop()
            more = f" and {len(frozen) - 8} more" if len(frozen) > 8 else ""
            raise DevgraphError(
                f"the model's forward changes {', '.join(frozen[:8])}{more}: a graph freezes such state at "
                "capture, so replays would not change it as eager calls do (put back to its value before "
                "capture where devgraph kept a copy). Keep per-call state in tensors updated in place "
                "(e.g. self.pos.add_(1) on a buffer), pass it as an argument, or create state a first call "
                "builds (a cache) before wrapping"
            )
        restored = [c.path for c in changes if c.replayable]
        if restored:
            logger.info(
                "devgraph: warm-ups and capture wrote %s; their values before capture are restored",
                ", ".join(restored[:8]),
            )
        self.inputs.ambient = ambient(self.device.torch_device.type)
        self.inputs.watch.remember(fn)
        self.guard = None if traced_state(fn) is not None else AttributeGuard(fn)

    def _put_back(self) -> None:
        """Restore the state before capture, keeping what the runs changed for ``all_or_nothing``'s
        verdict (a change a graph freezes is refused even though it was put back)."""
        if self.state is not None:
            self._changed.update((c.path, c) for c in self.state.changes())
            self.state.restore()

    def run(
        self,
        sizes: list[int],
        prepare: Prepare,
        *,
        stats: RunnerStats,
        words: Words,
        summary: str,
        tail: str = "",
        example: Call | None = None,
    ) -> PaddingVerdict | None:
        """Capture ``sizes`` largest first into one pool on one side stream.

        For each size: buffers filled with padding (what warm-up and capture see), the side
        stream made to wait for that fill, ``warmup_iters`` eager runs on it, then the capture; a
        ``CaptureError`` gains the size and the part's remedy (``words``). With an ``example``, first
        the padding check (``StaticInputs.check_padding``; after the ranks agreed on ``sizes``, so every
        rank runs the model as often), whose verdict it returns. Sets the part's capture ``stats`` and
        logs one line: ``summary`` (``{sizes}`` filled in), device, seconds, pool growth, ``tail``; then
        the row-count rounding the padding check found (``Accounts.note_rounding``: once per runner).
        Runs inside ``all_or_nothing``, which drops everything when a size fails.
        """
        inputs, device = self.inputs, self.device
        # One side stream for every size: CUDA's allocator reuses a shared pool's freed blocks only
        # on the stream that allocated them.
        stream = self.shared.stream or device.capture_stream()
        # every rank captures these sizes, or every rank raises
        self.rank_check = check_capture(
            self.config, device.torch_device.type, sizes, words.size_noun, words.size_options
        )
        verdict = None
        start = time.perf_counter()
        with gc_frozen(), capture_context(self.config):
            before = device.memory_stats().reserved  # after the collection: dead pools are gone
            if example is not None and self.config.check_padding:
                verdict = inputs.check_padding(example, sizes, self.state)
                self._put_back()  # warm-ups start from the state before capture
            for size in progress(sorted(sizes, reverse=True), f"devgraph {words.desc} ({device})"):
                inputs.fill_padding()
                before_run = inputs.buffer_versions()
                # Values too: a kernel that writes memory directly (an extension op, ``x.data``)
                # leaves the version counter alone but changes what the buffer holds.
                before_values = {n: b.clone() for n, b in inputs.buffers.items()}
                warm_up, capture = prepare(size)
                stream.wait_stream(device.current_stream())  # the fill above ran on the current stream
                with stream:
                    for _ in range(self.config.warmup_iters):
                        warm_up()
                device.synchronize()
                try:
                    capture()
                except CaptureError as err:
                    better = f"{err.remedy}; {words.remedy}" if err.remedy else words.remedy
                    raise err.with_batch_size(size, better) from err
                device.synchronize()
                # A model that writes its own inputs would leave data in padding rows at replay.
                after_run = inputs.buffer_versions()
                inputs.written_by_model.update(
                    n for n, v in before_run.items() if v is None or after_run.get(n) != v
                )
                inputs.written_by_model.update(
                    n for n, b in inputs.buffers.items() if not torch.equal(b, before_values[n])
                )
                if self._per_size:
                    # every size's warm-ups start from the state before capture: a write position the
                    # runs advance (a static KV cache's) would otherwise walk past its end over the sizes
                    self._put_back()
        stats.capture_seconds = time.perf_counter() - start
        stats.pool_bytes = device.memory_stats().reserved - before
        stats.captured_sizes = tuple(sorted(sizes))
        # A part that traces and compiles before it captures (piecewise: ``compile_seconds``, set before
        # this loop runs) spent that time on the capture too: the summary's seconds include it.
        traced = getattr(stats, "compile_seconds", 0.0)
        split = (
            f" (tracing and compiling {traced:.2f} s, capturing {stats.capture_seconds:.2f} s)"
            if traced
            else ""
        )
        if sizes:
            announce(  # on stderr by default (devgraph._console), quiet with DEVGRAPH_QUIET=1
                logger,
                "devgraph: %s on %s in %.2f s%s, pool %.1f MiB%s",
                summary.format(sizes=size_ranges(sorted(sizes))),
                device,
                traced + stats.capture_seconds,
                split,
                stats.pool_bytes / 2**20,
                tail,
            )
        found = (
            verdict.rounding if verdict is not None else ()
        )  # a refusal carries none: padded calls run eagerly
        self.accounts.note_rounding(found, str(device), words.size_options.split("/")[0], stats)
        return verdict
