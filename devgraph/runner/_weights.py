"""Did the weights change since capture: the three checks, cheapest first.

Graphs read weights by address. A weight replaced or moved after capture is silently stale, so:

* ``WeightWatch`` (every call, O(1) when nothing registered): torch's public module registration
  hooks (``module.w = nn.Parameter(...)``, ``load_state_dict(..., assign=True)``, ``module.sub = ...``
  all register through them) bump a counter, and only when it moved are the model's slots scanned;
  the runner then captures again.
* ``WeightAddresses`` (``debug=True``): ``param.data = new`` goes through no hook; a scan of every
  weight per call would cost about 0.15 us per tensor, so it runs in debug mode only and names the
  first weight (or runner input) that moved.
* ``captured_state`` (around ``GraphedModule``'s ``.to()``/``.half()``/``.train()`` and the like):
  every weight's address, dtype and device and every submodule's training flag; a change drops
  the graphs.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from devgraph._errors import DevgraphError

__all__ = ["WeightAddresses", "WeightWatch", "captured_state", "registrations"]

# Bumped by every parameter, buffer or submodule registration in the process (any module).
registrations = [0]
_installed = False
_install_lock = threading.Lock()


def _bump(*_: object) -> None:
    # Not while Dynamo traces: a forward that makes modules as it runs (Hugging Face slices
    # ``self.layers[:n]`` into a new ModuleList) registers them inside the trace, and a counter bumped
    # there is a global side effect Dynamo guards on, so every call of any compiled model recompiled,
    # past the limit ran eagerly (the H100 round's torch.compile column). What the trace registers is
    # temporary; a weight the forward replaces is set again by Dynamo's replay after the graph, outside
    # the trace, and counts then.
    if torch.compiler.is_compiling():
        return
    registrations[0] += 1


def _install_hooks() -> None:
    global _installed
    with _install_lock:
        if _installed:
            return
        from torch.nn.modules import module as nn_module

        nn_module.register_module_parameter_registration_hook(_bump)
        nn_module.register_module_buffer_registration_hook(_bump)
        nn_module.register_module_module_registration_hook(_bump)
        _installed = True


def _slots(fn: torch.nn.Module) -> Iterator[tuple[dict[str, Any], str, str, torch.Tensor | torch.nn.Module]]:
    """``(owner dict, key, description, value)`` for every parameter, buffer and submodule of ``fn``."""
    for prefix, module in fn.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for kind, table in (
            ("parameter", module._parameters),
            ("buffer", module._buffers),
            ("submodule", module._modules),
        ):
            for key, value in table.items():
                if value is not None:
                    yield table, key, f"{kind} {dot + key!r}", value


class WeightWatch:
    """Whether any weight, buffer or submodule of a model was replaced since ``remember``.

    Holds the model's own slot dicts and, per slot, the id and address of what it held: never the
    tensors themselves, so a replaced weight's memory is freed as it would be without devgraph.

    ``seen`` (the registration count up to which nothing was replaced) advances only to a count that
    two looks in a row found: torch runs the registration hook before it stores the new value, so a
    look racing with a replacement on another thread is followed by one more.
    """

    def __init__(self) -> None:
        self.seen = -1
        self._pending = -1
        self._slots: list[tuple[dict[str, Any], str, str, int, int | None]] = []

    def remember(self, fn: object) -> None:
        self._slots = []
        self.seen = -1
        if not isinstance(fn, torch.nn.Module):
            return
        _install_hooks()
        # Recording the slots is a look: trusted at once (a capture racing with a replacement on
        # another thread is the caller's race).
        self.seen = self._pending = registrations[0]
        for table, key, what, value in _slots(fn):
            ptr = value.data_ptr() if isinstance(value, torch.Tensor) else None
            self._slots.append((table, key, what, id(value), ptr))

    def clear(self) -> None:
        self._slots = []
        self.seen = -1

    def replaced(self) -> str | None:
        """The first slot whose value was replaced (a description), or None; O(1) when no module
        anywhere registered anything since the last look."""
        now = registrations[0]
        if self.seen == now:
            return None
        if not self._slots:
            self.seen = now
            return None
        for table, key, what, ident, ptr in self._slots:
            value = table.get(key)
            if value is None or id(value) != ident or (ptr is not None and value.data_ptr() != ptr):
                return what
        if now == self._pending:
            self.seen = now
        self._pending = now
        return None


def _named_weights(fn: object) -> dict[str, torch.Tensor]:
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

    def remember(self, fn: object, tensors: Mapping[str, torch.Tensor] | None = None) -> None:
        """Record the addresses of ``tensors`` (``{description: tensor}``) and of ``fn``'s weights,
        holding the tensors weakly (a replaced weight is freed as it would be without devgraph)."""
        self._at = {what: (weakref.ref(t), t.data_ptr()) for what, t in (tensors or {}).items()}
        self._at.update({what: (weakref.ref(t), t.data_ptr()) for what, t in _named_weights(fn).items()})

    def clear(self) -> None:
        self._at = {}

    def check(self, fn: object) -> None:
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


def captured_state(
    module: Any,
) -> tuple[list[tuple[str, int, torch.dtype, torch.device]], list[bool]] | None:
    """What graphs depend on besides the inputs: every weight's address, dtype and device, and
    every submodule's training flag (None for a plain callable)."""
    if not hasattr(module, "named_parameters"):
        return None
    weights = [
        (name, t.data_ptr(), t.dtype, t.device)
        for name, t in [*module.named_parameters(), *module.named_buffers()]
    ]
    return weights, [m.training for m in module.modules()]
