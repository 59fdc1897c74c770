"""What ``GraphRunner`` and ``PiecewiseRunner`` share besides their ``StaticInputs``.

Each runner is composed of these pieces, none of them a base class:

* ``ThreadOwner``: the one live thread a runner serves while its outputs are views of graph memory;
* ``Accounts``: calls run eagerly, counted and warned about once (``note_fallback``), recaptures;
* ``CaptureLoop``: every size captured largest first into one pool on one side stream, with
  garbage collection frozen, all sizes or none (``all_or_nothing``: what warm-ups and capture
  change in the model is put back, and a forward that rebinds state is refused);
* ``SharedCapture``: one pool and one side stream for two runners (``full_and_piecewise``).
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any, Protocol

import torch

from devgraph._console import announce
from devgraph._errors import CaptureError, DevgraphError
from devgraph._fallback_fixes import with_fix
from devgraph._source import user_stacklevel
from devgraph.graph._contract import Device, MemoryPool, Stream
from devgraph.runner._calls import Call
from devgraph.runner._config import RunnerConfig, RunnerStats
from devgraph.runner._inputs import StaticInputs, ambient
from devgraph.runner._ranks import RankCheck, capture_context, check_capture
from devgraph.runner._state import ModuleState, capture_warnings
from devgraph.runner._util import gc_frozen, progress, size_ranges

__all__ = ["Accounts", "CaptureLoop", "Prepare", "SharedCapture", "ThreadOwner"]

logger = logging.getLogger("devgraph")

#: ``prepare(size)`` returns ``(warm_up, capture)``: one eager run of the model at ``size``, and
#: the capture of that size into ``(pool, stream)``.
Prepare = Callable[[int], tuple[Callable[[], Any], Callable[[MemoryPool, Stream], None]]]


class _Captures(Protocol):
    @property
    def captured(self) -> bool: ...


class SharedCapture:
    """One pool and one side stream for runners that capture into both (vLLM captures its full and
    piecewise graphs into one global pool). Without one, a runner makes a fresh pool per capture.

    A pool whose graphs were all reset is never captured into again (CUDA's allocator asserts on
    it): ``get`` makes a fresh pool whenever none of the runners sharing it holds graphs.
    """

    def __init__(self, device: Device) -> None:
        self.device = device
        self.users: list[_Captures] = []
        self._pool: MemoryPool | None = None
        self._stream: Stream | None = None

    def get(self) -> tuple[MemoryPool, Stream]:
        if self._pool is None or not any(runner.captured for runner in self.users):
            self._pool = self.device.pool()
        if self._stream is None:
            self._stream = self.device.stream()
        return self._pool, self._stream


class ThreadOwner:
    """The thread a runner serves (``claim``, under the runner's lock).

    Outputs are views of graph memory that the next replay overwrites. The lock serialises calls,
    but a thread reads its outputs after the lock is released; if another thread's call replayed
    in between, it would read that call's result. So without ``clone_outputs`` one live thread at a
    time uses a runner: a call from a second one is refused while the first is alive. With
    ``clone_outputs=True`` outputs are copied under the lock and any thread may call.
    ``caller_serialises``: the caller consumes every output under a lock of its own before any
    other call (the Hugging Face adapter's ``generate``).
    """

    def __init__(self, config: RunnerConfig, caller_serialises: bool) -> None:
        self.free = config.clone_outputs or caller_serialises
        # The thread whose outputs are views of graph memory; None: nobody's yet.
        self.owner: threading.Thread | None = None

    def claim(self) -> None:
        """Make the calling thread the one served, or refuse it.

        Raises:
            DevgraphError: another live thread holds outputs that are views of graph memory.
        """
        if self.free:
            return
        me, owner = threading.current_thread(), self.owner
        if owner is None or owner is me or not owner.is_alive():
            self.owner = me
            return
        raise DevgraphError(
            f"this graphed model is already used by thread {owner.name!r}, and its outputs are views of "
            "graph memory that the next call overwrites: a call from this thread "
            f"({me.name!r}) would replace the result {owner.name!r} is reading. Wrap with "
            "clone_outputs=True to call it from several threads (each call then returns its own copy), "
            "or wrap the model once per thread"
        )


class Accounts:
    """What a runner counts in its ``stats`` and warns about once: eager calls by reason, recaptures.

    ``warned`` holds the categories already warned about (capture warnings use it too).
    ``serve_what`` says in ``strict=True`` errors what could not be done ("from a graph").
    """

    def __init__(
        self, config: RunnerConfig, stats: RunnerStats, lock: threading.RLock, serve_what: str
    ) -> None:
        self.config = config
        self.stats = stats
        self.lock = lock
        self.serve_what = serve_what
        self.warned: set[str] = set()

    def note_fallback(self, category: str, detail: str) -> None:
        """Account for a call served without graphs: raise when ``strict``, else count it in
        ``stats.fallbacks[category]`` and ``stats.eager_calls`` and warn once per category.

        Raises:
            DevgraphError: ``strict=True``.
        """
        detail = with_fix(category, detail)  # every warning (and strict error) names the fix
        if self.config.strict:
            raise DevgraphError(f"cannot serve this call {self.serve_what} (strict=True): {detail}")
        with self.lock:
            self.stats.fallbacks[category] = self.stats.fallbacks.get(category, 0) + 1
            self.stats.eager_calls += 1
            first = category not in self.warned
            self.warned.add(category)
        if first:
            warnings.warn(
                f"devgraph: running eagerly ({category}): {detail}. "
                "Further calls like this fall back silently; see .stats.fallbacks.",
                stacklevel=user_stacklevel(),
            )

    def note_recapture(self, replaced: str) -> None:
        """A weight was replaced since capture (the caller dropped its graphs): count it, warn once."""
        self.stats.recaptures += 1
        if "recapture" not in self.warned:
            self.warned.add("recapture")
            warnings.warn(
                f"devgraph: {replaced} was replaced since capture; capturing again (stats.recaptures counts "
                "this). To keep the graphs, load new weights in place: param.copy_(new), or "
                "load_state_dict(sd) without assign=True",
                stacklevel=user_stacklevel(),
            )


class CaptureLoop:
    """How a runner captures: ``all_or_nothing`` around the runner's build, ``run`` over the sizes.

    ``size_noun`` and ``size_options`` name the captured sizes and the options that set them when
    ranks disagree. ``rank_check`` is the per-call rank check (``check_ranks="every_call"``), set by
    ``run`` (None: nothing is exchanged per call).
    """

    def __init__(
        self,
        inputs: StaticInputs,
        device: Device,
        config: RunnerConfig,
        stats: RunnerStats,
        accounts: Accounts,
        *,
        shared: SharedCapture | None,
        size_noun: str,
        size_options: str,
    ) -> None:
        self.inputs = inputs
        self.device = device
        self.config = config
        self.stats = stats
        self.accounts = accounts
        self.shared = shared
        self.size_noun = size_noun
        self.size_options = size_options
        self.rank_check: RankCheck | None = None

    def clear(self) -> None:
        """Forget the capture's stats (a runner's reset; the counters stay)."""
        self.stats.captured_sizes = ()
        self.stats.pool_bytes = 0
        self.stats.capture_seconds = 0.0

    def all_or_nothing(self, build: Callable[[], None], drop: Callable[[], None]) -> None:
        """Run ``build`` (the runner's capture of every size); on any failure ``drop`` it all.

        What warm-ups and capture change in the model (buffer values, Python scalars) is put back.

        Raises:
            DevgraphError: the forward rebinds a buffer or changes a Python attribute (a graph
                freezes such state); whatever ``build`` raises.
        """
        fn = self.inputs.fn
        capture_warnings(fn, self.accounts.warned)
        state = ModuleState(fn)  # what warm-ups and capture change, put back after
        try:
            build()
        except BaseException:
            # A half-captured runner would replay some sizes and not others: drop it all.
            drop()
            state.restore()
            raise
        restored, replaced, changed = state.restore()
        if replaced or changed:
            drop()
            what = [f"buffer {n!r} (rebound to a new tensor)" for n in replaced]
            what += [f"attribute {c}" for c in changed]
            raise DevgraphError(
                f"the model's forward changes {', '.join(what)}: a graph freezes such state at capture, so "
                "replays would not change it as eager calls do (put back to its value before capture). Keep "
                "per-call state in tensors updated in place (e.g. self.pos.add_(1) on a buffer), or pass it "
                "as an argument"
            )
        if restored:
            logger.info(
                "devgraph: warm-ups and capture wrote buffers %s; their values before capture are restored",
                ", ".join(restored[:8]),
            )
        self.inputs.ambient = ambient(self.device.torch_device.type)
        self.inputs.watch.remember(fn)

    def run(
        self,
        sizes: list[int],
        prepare: Prepare,
        *,
        remedy: str,
        summary: str,
        tail: str = "",
        desc: str,
        example: Call | None = None,
    ) -> None:
        """Capture ``sizes`` largest first into one pool on one side stream.

        For each size: buffers filled with padding (what warm-up and capture see), the side
        stream made to wait for that fill, ``warmup_iters`` eager runs on it, then the capture; a
        ``CaptureError`` gains the size and ``remedy``. With an ``example``, first the padding check
        (``StaticInputs.check_padding``; after the ranks agreed on ``sizes``, so every rank runs the
        model as often) sets ``inputs.padding_verdict``. Sets the capture stats and logs one line:
        ``summary`` (``{sizes}`` filled in), device, seconds, pool growth, ``tail``. Runs inside
        ``all_or_nothing``, which drops everything when a size fails.
        """
        inputs, device = self.inputs, self.device
        if self.shared is not None:
            pool, stream = self.shared.get()
        else:
            # One side stream for every size: CUDA's allocator reuses a shared pool's freed blocks
            # only on the stream that allocated them.
            pool, stream = device.pool(), device.stream()
        # every rank captures these sizes, or every rank raises
        self.rank_check = check_capture(
            self.config, device.torch_device.type, sizes, self.size_noun, self.size_options
        )
        start = time.perf_counter()
        with gc_frozen(), capture_context(self.config):
            before = device.memory_stats().reserved  # after the collection: dead pools are gone
            if example is not None and self.config.check_padding:
                inputs.padding_verdict = inputs.check_padding(example, sizes)
            for size in progress(sorted(sizes, reverse=True), desc):
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
                    capture(pool, stream)
                except CaptureError as err:
                    better = f"{err.remedy}; {remedy}" if err.remedy else remedy
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
        stats = self.stats
        stats.capture_seconds = time.perf_counter() - start
        stats.pool_bytes = device.memory_stats().reserved - before
        stats.captured_sizes = tuple(sorted(sizes))
        if sizes:
            announce(  # on stderr by default (devgraph._console), quiet with DEVGRAPH_QUIET=1
                logger,
                "devgraph: %s on %s in %.2f s, pool %.1f MiB%s",
                summary.format(sizes=size_ranges(sorted(sizes))),
                device,
                stats.capture_seconds,
                stats.pool_bytes / 2**20,
                tail,
            )
