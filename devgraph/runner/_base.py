"""BucketedRunner: what the full-graph and the piecewise runner share.

Both read a call the same way (batched tensors, static tensors, host lists, constants), copy it
into static buffers sized for the largest size and pad it up to a captured size, capture every
size largest first into one pool on one side stream with garbage collection frozen, all sizes or
none, and run what they cannot serve eagerly, counted and warned about once. Subclasses say what
"capture" and "serve" mean (``_capture``, ``_serve``, ``_drop``).
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch

from devgraph._errors import CaptureError, DevgraphError
from devgraph._source import user_stacklevel
from devgraph.graph._contract import Device, MemoryPool, Stream
from devgraph.runner._calls import (
    Call,
    CallReader,
    TemplateCheck,
    Unsupported,
    signature_of,
    template_mismatch,
)
from devgraph.runner._config import RunnerConfig, RunnerStats
from devgraph.runner._ranks import RankCheck, capture_context, check_capture
from devgraph.runner._rows import PaddingVerdict, check_padding
from devgraph.runner._state import ModuleState, WeightWatch, capture_warnings
from devgraph.runner._state import registrations as _registrations
from devgraph.runner._util import gc_frozen, progress, size_ranges

__all__ = ["BucketedRunner", "SharedCapture", "WeightAddresses"]

logger = logging.getLogger("devgraph")

_R = TypeVar("_R", bound="BucketedRunner")

#: ``prepare(size)`` returns ``(warm_up, capture)``: one eager run of the model at ``size``, and
#: the capture of that size into ``(pool, stream)``.
Prepare = Callable[[int], tuple[Callable[[], Any], Callable[[MemoryPool, Stream], None]]]


class SharedCapture:
    """One pool and one side stream for runners that capture into both (vLLM captures its full and
    piecewise graphs into one global pool). Without one, a runner makes a fresh pool per capture.

    A pool whose graphs were all reset is never captured into again (CUDA's allocator asserts on
    it): ``get`` makes a fresh pool whenever none of the runners sharing it holds graphs.
    """

    def __init__(self, device: Device) -> None:
        self.device = device
        self.users: list[BucketedRunner] = []
        self._pool: MemoryPool | None = None
        self._stream: Stream | None = None

    def get(self) -> tuple[MemoryPool, Stream]:
        if self._pool is None or not any(runner.captured for runner in self.users):
            self._pool = self.device.pool()
        if self._stream is None:
            self._stream = self.device.stream()
        return self._pool, self._stream


def _named_weights(fn: Any) -> dict[str, torch.Tensor]:
    if not isinstance(fn, torch.nn.Module):
        return {}
    found: dict[str, torch.Tensor] = {f"parameter {n!r}": p for n, p in fn.named_parameters()}
    found.update({f"buffer {n!r}": b for n, b in fn.named_buffers()})
    return found


class WeightAddresses:
    """Where a model's parameters and buffers (and a runner's own inputs) lived at capture.

    Graphs read memory by address: a weight moved or replaced after capture is silently stale.
    ``check`` (``debug=True``) names the first one that moved.
    """

    def __init__(self) -> None:
        self._at: dict[str, tuple[weakref.ref[torch.Tensor], int]] = {}

    def remember(self, fn: Any, tensors: Mapping[str, torch.Tensor] | None = None) -> None:
        """Record the addresses of ``tensors`` (``{description: tensor}``) and of ``fn``'s weights,
        holding the tensors weakly (a replaced weight is freed as it would be without devgraph)."""
        self._at = {what: (weakref.ref(t), t.data_ptr()) for what, t in (tensors or {}).items()}
        self._at.update({what: (weakref.ref(t), t.data_ptr()) for what, t in _named_weights(fn).items()})

    def clear(self) -> None:
        self._at = {}

    def check(self, fn: Any) -> None:
        """Raise ``DevgraphError`` naming a tensor that moved, or a weight replaced, since capture."""
        for what, (ref, ptr) in self._at.items():
            tensor = ref()
            if tensor is None:
                raise DevgraphError(
                    f"{what} was freed since capture; the graphs would read freed memory. Keep it alive, "
                    "or call .capture() again after replacing it."
                )
            if tensor.data_ptr() != ptr:
                raise DevgraphError(
                    f"{what} no longer lives at its capture address ({ptr:#x} -> {tensor.data_ptr():#x}); "
                    "the graphs would read stale memory. Call .capture() again after moving or replacing it."
                )
        for what, tensor in _named_weights(fn).items():
            if what in self._at and self._at[what][1] != tensor.data_ptr():
                raise DevgraphError(
                    f"{what} was replaced since capture ({self._at[what][1]:#x} -> {tensor.data_ptr():#x}); "
                    "call .capture() again after loading weights or moving the model."
                )


class BucketedRunner:
    """The shared half of ``GraphRunner`` and ``PiecewiseRunner`` (see the module docstring).

    Subclasses set ``sizes`` and ``stats`` and implement ``captured``, ``_capture(call)`` (build
    and capture every size, calling ``_capture_each``) and ``_serve(call)``; ``_drop`` extends
    what ``reset`` forgets.
    """

    #: how ``strict=True`` errors say what could not be done.
    _serve_what = "from a graph"

    sizes: list[int]
    stats: RunnerStats
    #: the per-call rank check (``check_ranks="every_call"``), set at capture by ``_ranks``
    _rank_check: RankCheck | None = None
    #: what the captured sizes are and which options set them (named when ranks disagree)
    size_noun = "batch sizes"
    size_options = "batch_sizes/max_batch_size"

    def __init__(
        self,
        fn: Callable[..., Any],
        device: Device,
        config: RunnerConfig,
        *,
        shared: SharedCapture | None = None,
        caller_serialises: bool = False,
    ) -> None:
        self.fn = fn
        self.device = device
        self.config = config
        self._shared = shared
        if shared is not None:
            shared.users.append(self)
        self._signature = signature_of(fn)
        self._reader = CallReader(self._signature, config)
        self._buffers: dict[str, torch.Tensor] = {}
        # Per buffer, how many leading rows may hold a call's data (the rest hold padding): a call
        # pads only rows an earlier call used (``_load``).
        self._used_rows: dict[str, int] = {}
        # Buffers the model writes itself (seen at capture): their padding is refilled every call.
        self._written_by_model: set[str] = set()
        self._views: dict[tuple[str, int, int], torch.Tensor] = {}  # rows of a buffer, see ``_rows``
        self._first_rows: dict[int, dict[str, torch.Tensor]] = {}  # batch -> {name: its first rows}
        self._template: dict[str, Any] | None = None
        self._template_check: TemplateCheck | None = None
        self._weights = WeightAddresses()
        # Whether a weight, buffer or submodule was replaced since capture (checked every call).
        self._watch = WeightWatch()
        # Why calls padded up to a bucket would differ from eager (None: padding is exact).
        self._exact_only: str | None = None
        self._padding_verdict: PaddingVerdict | None = None
        # Autocast and default dtype at capture (``_ambient``): part of every call's template.
        self._ambient: tuple[Any, ...] | None = None
        self._warned: set[str] = set()
        self._lock = threading.RLock()
        # The thread whose outputs are views of graph memory (see ``_claim``); None: nobody's yet.
        self._owner: threading.Thread | None = None
        self._caller_serialises = caller_serialises

    # -- public --------------------------------------------------------------------------------

    @property
    def captured(self) -> bool:
        raise NotImplementedError

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Serve one call (its path, step by step: the docstring of ``devgraph.runner._runner``).

        Raises:
            DevgraphError: a call from a second live thread while outputs are views of graph memory
                (``clone_outputs=False``): the next replay would overwrite the first thread's result.
        """
        with self._lock:
            self._claim()
            if not torch.is_grad_enabled():  # entering no_grad costs as much as reading the call
                return self._call(args, kwargs)
            with torch.no_grad():
                return self._call(args, kwargs)

    def capture(self: _R, *example_args: Any, **example_kwargs: Any) -> _R:
        """Capture every size now, using an example call (any size) for shapes and types."""
        with self._lock, torch.no_grad():
            try:
                call = self._reader.read(example_args, example_kwargs)
            except Unsupported as why:
                raise DevgraphError(f"cannot capture from this example call: {why.detail}") from None
            self.reset()
            self._capture_all_or_nothing(call)
        return self

    def reset(self) -> None:
        """Drop every captured graph (the next call captures again).

        Outputs returned earlier are views of graph memory (unless ``clone_outputs=True``): after a
        reset that memory goes back to the pool and the next capture reuses it, so those views read
        garbage. Clone what you keep across a reset.
        """
        with self._lock:
            self._drop()

    def note_fallback(self, category: str, detail: str) -> None:
        """Account for a call served without graphs: raise when ``strict``, else count it in
        ``stats.fallbacks[category]`` and ``stats.eager_calls`` and warn once per category.

        Raises:
            DevgraphError: ``strict=True``.
        """
        if self.config.strict:
            raise DevgraphError(f"cannot serve this call {self._serve_what} (strict=True): {detail}")
        with self._lock:
            self.stats.fallbacks[category] = self.stats.fallbacks.get(category, 0) + 1
            self.stats.eager_calls += 1
            first = category not in self._warned
            self._warned.add(category)
        if first:
            warnings.warn(
                f"devgraph: running eagerly ({category}): {detail}. "
                "Further calls like this fall back silently; see .stats.fallbacks.",
                stacklevel=user_stacklevel(),
            )

    def padded_host_args(self, host: dict[str, list[Any]], size: int) -> dict[str, list[Any]]:
        """The updatable tasks' host arguments for a call's host lists padded to bucket ``size``
        (``{op argument: values}``, as ``Graph.replay(host_args=...)`` takes them); a host list
        the call lacks is all padding."""
        out = {}
        pad = self._reader.pad_values
        for call_name, op_name in self.config.host_args:
            values = list(host.get(call_name, ()))
            out[op_name] = values + [pad.get(call_name, 0)] * (size - len(values))
        return out

    # -- threads -------------------------------------------------------------------------------

    def _claim(self) -> None:
        """Make the calling thread the one this runner serves, or refuse it (under ``_lock``).

        Outputs are views of graph memory that the next replay overwrites. The lock serialises
        calls, but a thread reads its outputs after the lock is released; if another thread's call
        replayed in between, it would read that call's result. So without ``clone_outputs`` one
        live thread at a time uses a runner: a call from a second one is refused while the first
        is alive. With ``clone_outputs=True`` outputs are copied under the lock and any thread may
        call. ``caller_serialises``: the caller consumes every output under a lock of its own
        before any other call (the Hugging Face adapter's ``generate``).
        """
        if self.config.clone_outputs or self._caller_serialises:
            return
        me, owner = threading.current_thread(), self._owner
        if owner is None or owner is me or not owner.is_alive():
            self._owner = me
            return
        raise DevgraphError(
            f"this graphed model is already used by thread {owner.name!r}, and its outputs are views of "
            "graph memory that the next call overwrites: a call from this thread "
            f"({me.name!r}) would replace the result {owner.name!r} is reading. Wrap with "
            "clone_outputs=True to call it from several threads (each call then returns its own copy), "
            "or wrap the model once per thread"
        )

    # -- template methods ----------------------------------------------------------------------

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            call = self._reader.read(args, kwargs)
        except Unsupported as why:
            return self._fallback(why, args, kwargs)
        return self._call_read(call, args, kwargs)

    def _call_read(self, call: Call, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Serve a call already read (``full_and_piecewise`` reads once and routes the result)."""
        try:
            if call.batch == 0:
                raise Unsupported("empty_batch", "the call has 0 rows; there is nothing to replay")
            if self._watch.seen != _registrations[0]:  # something registered a weight somewhere: look
                replaced = self._watch.replaced()
                if replaced is not None:
                    self._recapture(replaced)
            if not self.captured:
                self._capture_all_or_nothing(call)
            return self._serve(call)
        except Unsupported as why:
            unsupported = why
        # Outside the except block: an error of the model's own eager run is not chained to ours.
        return self._fallback(unsupported, args, kwargs)

    def _capture(self, example: Call) -> None:
        raise NotImplementedError

    def _serve(self, call: Call) -> Any:
        raise NotImplementedError

    def _drop(self) -> None:
        """Forget the capture (subclasses reset their graphs, then call this); counters stay."""
        self._buffers.clear()
        self._used_rows.clear()
        self._written_by_model.clear()
        self._views.clear()
        self._first_rows.clear()
        self._template = None
        self._template_check = None
        self._weights.clear()
        self._watch.clear()
        self._exact_only = None
        self._padding_verdict = None
        self._ambient = None
        self.stats.captured_sizes = ()
        self.stats.pool_bytes = 0
        self.stats.capture_seconds = 0.0

    def _capture_all_or_nothing(self, example: Call) -> None:
        capture_warnings(self.fn, self._warned)
        state = ModuleState(self.fn)  # what warm-ups and capture change, put back after
        try:
            self._capture(example)
        except BaseException:
            # A half-captured runner would replay some sizes and not others: drop it all.
            self._drop()
            state.restore()
            raise
        restored, replaced, changed = state.restore()
        if replaced or changed:
            self._drop()
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
        self._ambient = _ambient(self.device.torch_device.type)
        self._watch.remember(self.fn)

    def _recapture(self, replaced: str) -> None:
        """A weight was replaced since capture: drop the graphs (the caller captures again), warn once."""
        self._drop()
        self.stats.recaptures += 1
        if "recapture" not in self._warned:
            self._warned.add("recapture")
            warnings.warn(
                f"devgraph: {replaced} was replaced since capture; capturing again (stats.recaptures counts "
                "this). To keep the graphs, load new weights in place: param.copy_(new), or "
                "load_state_dict(sd) without assign=True",
                stacklevel=user_stacklevel(),
            )

    def _check_padding(self, example: Call, sizes: list[int]) -> PaddingVerdict | None:
        """Whether calls padded up to the smallest and the largest of ``sizes`` that any call is
        padded to give the real rows what eager gives them (``devgraph.runner._rows``: ``r`` rows,
        the example's batch kept between the next smaller size and ``size - 1``); sets
        ``_exact_only`` when not."""
        ordered = sorted(set(sizes))
        below = dict(zip(ordered, [0, *ordered[:-1]]))
        padded = [s for s in ordered if s - 1 > below[s]]
        padded = sorted({padded[0], padded[-1]}) if padded else []

        def run(batched: dict[str, torch.Tensor], host: dict[str, list[Any]]) -> Any:
            values: dict[str, Any] = {**batched, **example.static, **example.consts, **host}
            args, kwargs = example.bind(self._signature, values)
            return self.fn(*args, **kwargs)

        verdict = None
        for size in reversed(padded):
            r = min(max(example.batch, below[size] + 1), size - 1)
            try:
                found = check_padding(run, example, size, r, self.config)
            except Exception as exc:
                found = PaddingVerdict(
                    None,
                    f"could not check that padding to {size} keeps rows exact: the model raised "
                    f"{type(exc).__name__}: {exc}",
                )
            if found.exact_only is not None:
                self._exact_only = found.exact_only
                return found
            verdict = verdict or found
        return verdict

    def _fallback(self, why: Unsupported, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.note_fallback(why.category, why.detail)
        return self.fn(*args, **kwargs)

    # -- static buffers ------------------------------------------------------------------------

    def _alloc_buffers(self, example: Call, size: int) -> None:
        """Static buffers of ``size`` rows for the example's batched arguments, filled with padding."""
        cfg = self.config
        # Ordinary tensors even under inference_mode: their version counters tell whether the model
        # writes its inputs (``_capture_each``), which decides how padding is kept.
        with torch.inference_mode(False):
            for name, x in example.batched.items():
                shape = list(x.shape)
                shape[cfg.batch_dim(name)] = size
                self._buffers[name] = torch.full(shape, cfg.pad_value(name), dtype=x.dtype, device=x.device)
        self._template = example.template(cfg)
        self._template_check = None

    def _fill_padding(self) -> None:
        for name, buf in self._buffers.items():
            buf.fill_(self.config.pad_value(name))
            self._used_rows[name] = 0

    def _narrowed(self, size: int) -> dict[str, torch.Tensor]:
        return {n: self._rows(n, 0, size) for n in self._buffers}

    def _rows(self, name: str, start: int, length: int) -> torch.Tensor:
        """Rows ``start..start+length`` of buffer ``name`` along its batch dim (views made once)."""
        key = (name, start, length)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = self._buffers[name].narrow(self.config.batch_dim(name), start, length)
        return view

    def _load(self, call: Call, size: int) -> None:
        """Copy the call's batched tensors into the buffers, and make rows ``call.batch..size`` padding.

        Padding rows are filled only where an earlier call left data: capture fills every buffer
        with padding, and ``_used_rows`` tracks per buffer how many leading rows a call has written
        since. A buffer the model writes itself (seen at capture) is padded every call.
        """
        batch, used = call.batch, self._used_rows
        firsts = self._first_rows.get(batch)
        if firsts is None:
            firsts = self._first_rows[batch] = {n: self._rows(n, 0, batch) for n in self._buffers}
        for name, x in call.batched.items():
            firsts[name].copy_(x)
            dirty = size if name in self._written_by_model else used[name]
            if dirty > batch:
                self._rows(name, batch, min(dirty, size) - batch).fill_(self._reader.pad_values.get(name, 0))
            # Rows above this bucket that an earlier call used are still dirty.
            used[name] = dirty if dirty > size else batch

    def _check_template(self, call: Call, what: str) -> None:
        assert self._template is not None
        ambient = self._ambient
        if ambient is not None and not (
            # the common case in two cheap calls: captured and called without autocast on any device
            (not ambient[0] and _any_autocast is not None and not _any_autocast())
            and torch.get_default_dtype() is ambient[2]
        ):
            now = _ambient(self.device.torch_device.type)
            if now == ambient:
                self._check_call_template(call, what)
                return
            raise Unsupported(
                "autocast_or_dtype_mismatch",
                f"the call runs with autocast/default dtype {_ambient_words(now)}, the graphs were captured "
                f"with {_ambient_words(self._ambient)}; call under the same torch.autocast and "
                "torch.set_default_dtype as the capture",
            )
        self._check_call_template(call, what)

    def _check_call_template(self, call: Call, what: str) -> None:
        if self._template_check is None:
            self._template_check = TemplateCheck(self._template, self._reader.batch_dims)
        if self._template_check.matches(call):
            return
        reason = template_mismatch(self._template, call.template(self.config))
        if reason:
            raise Unsupported("signature_mismatch", f"call differs from the {what} one: {reason}")

    def _buffer_versions(self) -> dict[str, int | None]:
        """Each buffer's version counter (bumped by every in-place write; None: not tracked)."""
        versions: dict[str, int | None] = {}
        for name, buf in self._buffers.items():
            try:
                versions[name] = buf._version
            except RuntimeError:  # an inference tensor (made by the caller's code): assume written
                versions[name] = None
        return versions

    def _remember_weights(self, example: Call) -> None:
        tensors = {f"input {n!r}": b for n, b in self._buffers.items()}
        tensors.update({f"static argument {n!r}": t for n, t in example.static.items()})
        self._weights.remember(self.fn, tensors)

    # -- the capture loop ----------------------------------------------------------------------

    def _capture_each(
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
        (``_check_padding``; after the ranks agreed on ``sizes``, so every rank runs the model as
        often) sets ``_padding_verdict``. Sets the capture stats and logs one line:
        ``summary`` (``{sizes}`` filled in), device, seconds, pool growth, ``tail``. The caller's ``_capture`` runs inside
        ``_capture_all_or_nothing``, which drops everything when a size fails.
        """
        if self._shared is not None:
            pool, stream = self._shared.get()
        else:
            # One side stream for every size: CUDA's allocator reuses a shared pool's freed blocks
            # only on the stream that allocated them.
            pool, stream = self.device.pool(), self.device.stream()
        # every rank captures these sizes, or every rank raises
        self._rank_check = check_capture(
            self.config, self.device.torch_device.type, sizes, self.size_noun, self.size_options
        )
        start = time.perf_counter()
        with gc_frozen(), capture_context(self.config):
            before = self.device.memory_stats().reserved  # after the collection: dead pools are gone
            if example is not None and self.config.check_padding:
                self._padding_verdict = self._check_padding(example, sizes)
            for size in progress(sorted(sizes, reverse=True), desc):
                self._fill_padding()
                before_run = self._buffer_versions()
                # Values too: a kernel that writes memory directly (an extension op, ``x.data``)
                # leaves the version counter alone but changes what the buffer holds.
                before_values = {n: b.clone() for n, b in self._buffers.items()}
                warm_up, capture = prepare(size)
                stream.wait_stream(self.device.current_stream())  # the fill above ran on the current stream
                with stream:
                    for _ in range(self.config.warmup_iters):
                        warm_up()
                self.device.synchronize()
                try:
                    capture(pool, stream)
                except CaptureError as err:
                    better = f"{err.remedy}; {remedy}" if err.remedy else remedy
                    raise err.with_batch_size(size, better) from err
                self.device.synchronize()
                # A model that writes its own inputs would leave data in padding rows at replay.
                after_run = self._buffer_versions()
                self._written_by_model.update(
                    n for n, v in before_run.items() if v is None or after_run.get(n) != v
                )
                self._written_by_model.update(
                    n for n, b in self._buffers.items() if not torch.equal(b, before_values[n])
                )
        self.stats.capture_seconds = time.perf_counter() - start
        self.stats.pool_bytes = self.device.memory_stats().reserved - before
        self.stats.captured_sizes = tuple(sorted(sizes))
        if sizes:
            logger.info(
                "devgraph: %s on %s in %.2f s, pool %.1f MiB%s",
                summary.format(sizes=size_ranges(sorted(sizes))),
                self.device,
                self.stats.capture_seconds,
                self.stats.pool_bytes / 2**20,
                tail,
            )


#: whether autocast is on for any device type (one cheap call; None on a torch without it)
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None)


def _ambient(device_type: str) -> tuple[Any, ...]:
    """What a call's results depend on besides its arguments: autocast (on, dtype) for the device
    type, and the default dtype."""
    try:
        on = torch.is_autocast_enabled(device_type)
        dtype = torch.get_autocast_dtype(device_type) if on else None
    except RuntimeError:  # a device type autocast does not know
        on, dtype = False, None
    return on, dtype, torch.get_default_dtype()


def _ambient_words(state: tuple[Any, ...]) -> str:
    on, dtype, default = state
    return f"(autocast {'on, ' + str(dtype) if on else 'off'}, default dtype {default})"
