"""StaticInputs: the static side of a runner, one for every part (``WholeGraphs``, ``Pieces``).

A graph reads its inputs from fixed addresses. A runner holds one ``StaticInputs`` that reads
each call (``CallReader``: batched tensors, static tensors, host lists, constants), matches it to
the captured one (the call template, autocast and default dtype), copies it into static buffers
sized for the largest size and pads it up to a captured size, and keeps what the graphs depend on
besides their inputs: the weights' addresses (``WeightAddresses``, ``WeightWatch``) and whether
padding is exact (``check_padding``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch

from devgraph.graph import Device
from devgraph.runner._calls import (
    Call,
    CallReader,
    TemplateCheck,
    Unsupported,
    signature_of,
    template_mismatch,
)
from devgraph.runner._config import RunnerConfig
from devgraph.runner._padding import PaddingVerdict, check_padding
from devgraph.runner._rounding import RowCountRounding
from devgraph.runner._snapshot import StateSnapshot
from devgraph.runner._tensors import same_values, tensor_version
from devgraph.runner._weights import WeightAddresses, WeightWatch

__all__ = ["StaticInputs", "ambient"]


class StaticInputs:
    """One runner's static buffers and what a call must match to be served from them.

    ``read`` classifies a call; ``match`` refuses (``Unsupported``) one unlike the captured call;
    ``load`` copies it into the buffers' first rows and pads the rest; ``padded_host_args`` pads
    its host lists. ``alloc``, ``fill_padding``, ``buffer_versions``, ``check_padding`` and
    ``remember`` serve the capture; ``clear`` forgets all of it (a runner's reset).

    Attributes a runner reads: ``buffers`` (name -> static tensor, rows along the batch dim),
    ``written_by_model`` (buffers the model writes itself, seen at capture: padded every call, and
    their real rows copied back into the caller's tensors after every replay, ``store_written``),
    ``watch`` (whether a weight, buffer or submodule was replaced since capture) and ``weights`` (their addresses, for ``debug=True``).
    """

    def __init__(self, fn: Callable[..., Any], device: Device, config: RunnerConfig) -> None:
        self.fn = fn
        self.device = device
        self.config = config
        self.signature = signature_of(fn)
        self.reader = CallReader(self.signature, config)
        self.buffers: dict[str, torch.Tensor] = {}
        # Per buffer, how many leading rows may hold a call's data (the rest hold padding): a call
        # pads only rows an earlier call used (``load``).
        self.used_rows: dict[str, int] = {}
        # Buffers the model writes itself (seen at capture): their padding is refilled every call.
        self.written_by_model: set[str] = set()
        self._views: dict[tuple[str, int, int], torch.Tensor] = {}  # rows of a buffer, see ``rows``
        self._first_rows: dict[int, dict[str, torch.Tensor]] = {}  # batch -> {name: its first rows}
        self.template: dict[str, Any] | None = None
        self._template_check: TemplateCheck | None = None
        self.weights = WeightAddresses()
        self.watch = WeightWatch()
        # Autocast and default dtype at capture (``ambient``): part of every call's template.
        self.ambient: Ambient | None = None

    def read(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call:
        """The call ``fn(*args, **kwargs)``, classified (raises ``Unsupported``)."""
        return self.reader.read(args, kwargs)

    def clear(self) -> None:
        """Forget the capture: buffers, template, weight addresses."""
        self.buffers.clear()
        self.used_rows.clear()
        self.written_by_model.clear()
        self._views.clear()
        self._first_rows.clear()
        self.template = None
        self._template_check = None
        self.weights.clear()
        self.watch.clear()
        self.ambient = None

    # -- capture -------------------------------------------------------------------------------

    def alloc(self, example: Call, size: int) -> None:
        """Static buffers of ``size`` rows for the example's batched arguments, filled with padding."""
        cfg = self.config
        # Ordinary tensors even under inference_mode: their version counters tell whether the model
        # writes its inputs (``capture_sizes``), which decides how padding is kept.
        with torch.inference_mode(False):
            for name, x in example.batched.items():
                shape = list(x.shape)
                shape[cfg.batch_dim(name)] = size
                self.buffers[name] = torch.full(shape, cfg.pad_value(name), dtype=x.dtype, device=x.device)
        self.template = example.template(cfg)
        self._template_check = None

    def bound_at(self, example: Call, size: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The example call on the buffers' first ``size`` rows, host lists all padding: what a part's
        warm-ups and capture of ``size`` run."""
        values: dict[str, Any] = dict(self.narrowed(size))
        values.update(example.static)
        values.update(example.consts)
        values.update({name: [self.config.pad_value(name)] * size for name in example.host})
        return example.bind(self.signature, values)

    def fill_padding(self) -> None:
        """Every buffer all padding (what warm-up and capture see)."""
        for name, buf in self.buffers.items():
            buf.fill_(self.config.pad_value(name))
            self.used_rows[name] = 0

    def buffer_versions(self) -> dict[str, int | None]:
        """Each buffer's version counter (bumped by every in-place write; None: not tracked)."""
        return {name: tensor_version(buf) for name, buf in self.buffers.items()}

    def remember(self, example: Call) -> None:
        """Record where the buffers, the example's static tensors and the model's weights live."""
        tensors = {f"input {n!r}": b for n, b in self.buffers.items()}
        tensors.update({f"static argument {n!r}": t for n, t in example.static.items()})
        self.weights.remember(self.fn, tensors)

    def check_padding(
        self, example: Call, sizes: list[int], state: StateSnapshot | None = None
    ) -> PaddingVerdict | None:
        """Whether calls padded up to the smallest and the largest of ``sizes`` that any call is
        padded to give the real rows what eager gives them (``devgraph.runner._padding``: ``r`` rows,
        the example's batch kept between the next smaller size and ``size - 1``), outputs and the
        model's ``state`` alike (the verdict's ``exact_only`` says why not). Where padding is safe, the verdict
        carries the row-count rounding of every size checked."""
        ordered = sorted(set(sizes))
        below = dict(zip(ordered, [0, *ordered[:-1]]))
        padded = [s for s in ordered if s - 1 > below[s]]
        padded = sorted({padded[0], padded[-1]}) if padded else []

        def run(batched: dict[str, torch.Tensor], host: dict[str, list[Any]]) -> Any:
            values: dict[str, Any] = {**batched, **example.static, **example.consts, **host}
            args, kwargs = example.bind(self.signature, values)
            # These runs see the example's real rows, where a write that leaves the version counter
            # alone (``x.data``, an extension kernel) changes values that all-padding buffers may not.
            before = {n: (tensor_version(x), x.clone()) for n, x in batched.items()}
            out = self.fn(*args, **kwargs)
            self.written_by_model.update(
                n
                for n, (version, values) in before.items()
                if version is None
                or tensor_version(batched[n]) != version
                or not same_values(batched[n], values)
            )
            return out

        verdict = None
        rounding: list[RowCountRounding] = []
        for size in reversed(padded):
            r = min(max(example.batch, below[size] + 1), size - 1)
            try:
                found = check_padding(run, example, size, r, self.config, state)
            except Exception as exc:
                found = PaddingVerdict(
                    None,
                    f"could not check that padding to {size} keeps rows exact: the model raised "
                    f"{type(exc).__name__}: {exc}",
                )
            if found.exact_only is not None:
                return found
            verdict = verdict or found
            rounding[:0] = found.rounding  # smallest size first
        return None if verdict is None else attrs.evolve(verdict, rounding=tuple(rounding))

    # -- a call --------------------------------------------------------------------------------

    def narrowed(self, size: int) -> dict[str, torch.Tensor]:
        """Every buffer's first ``size`` rows."""
        return {n: self.rows(n, 0, size) for n in self.buffers}

    def rows(self, name: str, start: int, length: int) -> torch.Tensor:
        """Rows ``start..start+length`` of buffer ``name`` along its batch dim (views made once)."""
        key = (name, start, length)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = self.buffers[name].narrow(self.config.batch_dim(name), start, length)
        return view

    def match(self, call: Call, what: str) -> None:
        """Refuse (``Unsupported``) a call unlike the captured one: shapes but the batch dim, dtypes,
        devices, static tensors' addresses, constants, autocast and the default dtype (``what``
        names the captured call in the message: "captured", "traced")."""
        assert self.template is not None
        captured = self.ambient
        if captured is not None and not (
            # the common case in two cheap calls: captured and called without autocast on any device
            (not captured[0] and _any_autocast is not None and not _any_autocast())
            and torch.get_default_dtype() is captured[2]
        ):
            now = ambient(self.device.torch_device.type)
            if now != captured:
                raise Unsupported(
                    "autocast_or_dtype_mismatch",
                    f"the call runs with autocast/default dtype {_ambient_words(now)}, the graphs were "
                    f"captured with {_ambient_words(captured)}; call under the same torch.autocast and "
                    "torch.set_default_dtype as the capture",
                )
        if self._template_check is None:
            self._template_check = TemplateCheck(self.template, self.reader.batch_dims)
        if self._template_check.matches(call):
            return
        reason = template_mismatch(self.template, call.template(self.config))
        if reason:
            raise Unsupported("signature_mismatch", f"call differs from the {what} one: {reason}")

    def load(self, call: Call, size: int) -> None:
        """Copy the call's batched tensors into the buffers, and make rows ``call.batch..size`` padding.

        Padding rows are filled only where an earlier call left data: capture fills every buffer
        with padding, and ``used_rows`` tracks per buffer how many leading rows a call has written
        since. A buffer the model writes itself (seen at capture) is padded every call.
        """
        batch, used = call.batch, self.used_rows
        firsts = self._first_rows.get(batch)
        if firsts is None:
            firsts = self._first_rows[batch] = {n: self.rows(n, 0, batch) for n in self.buffers}
        for name, x in call.batched.items():
            firsts[name].copy_(x)
            dirty = size if name in self.written_by_model else used[name]
            if dirty > batch:
                self.rows(name, batch, min(dirty, size) - batch).fill_(self.reader.pad_values.get(name, 0))
            # Rows above this bucket that an earlier call used are still dirty.
            used[name] = dirty if dirty > size else batch

    def store_written(self, call: Call) -> None:
        """Copy the real rows of every buffer the model writes (``written_by_model``) back into the
        caller's tensor, after a replay: eager writes the caller's tensor in place (``x.add_(1)``, a
        recurrent state ``s.mul_(0.5).add_(x)``), a replay only the static buffer, so without this
        the caller's next call would start from stale state."""
        firsts = self._first_rows[call.batch]  # made by ``load`` for this batch
        batched = call.batched
        for name in self.written_by_model:
            x = batched.get(name)
            if x is not None:
                x.copy_(firsts[name])

    def padded_host_args(self, host: dict[str, list[Any]], size: int) -> dict[str, list[Any]]:
        """The updatable tasks' host arguments for a call's host lists padded to bucket ``size``
        (``{op argument: values}``, as ``Graph.replay(host_args=...)`` takes them); a host list
        the call lacks is all padding."""
        out = {}
        pad = self.reader.pad_values
        for call_name, op_name in self.config.host_args:
            values = list(host.get(call_name, ()))
            out[op_name] = values + [pad.get(call_name, 0)] * (size - len(values))
        return out


#: What a call's results depend on besides its arguments (``ambient``): autocast on, its dtype, the
#: default dtype.
Ambient = tuple[bool, torch.dtype | None, torch.dtype]

#: whether autocast is on for any device type (one cheap call; None on a torch without it)
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None)


def ambient(device_type: str) -> Ambient:
    """What a call's results depend on besides its arguments: autocast (on, dtype) for the device
    type, and the default dtype."""
    try:
        on = torch.is_autocast_enabled(device_type)
        dtype = torch.get_autocast_dtype(device_type) if on else None
    except RuntimeError:  # a device type autocast does not know
        on, dtype = False, None
    return on, dtype, torch.get_default_dtype()


def _ambient_words(state: Ambient) -> str:
    on, dtype, default = state
    return f"(autocast {'on, ' + str(dtype) if on else 'off'}, default dtype {default})"
