"""What a model's graphs depend on besides its inputs: its weights, buffers and Python attributes.

Graphs read weights by address, and a capture freezes whatever the model's Python code computed.
``WeightWatch`` notices a weight, buffer or submodule replaced after capture, cheaply per call:
torch's public module registration hooks (``module.w = nn.Parameter(...)``,
``load_state_dict(..., assign=True)``, ``module.sub = ...`` all register through them) bump a
counter, and only when it moved are the model's slots scanned. ``param.data = new`` goes through
no hook; a scan of every weight per call would cost about 0.15 us per tensor, so it is seen with
``debug=True`` only (``WeightAddresses.check``). ``ModuleState`` snapshots what warm-ups and
capture may change (buffer values, Python scalars in module ``__dict__``s) and restores it.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from devgraph._source import user_stacklevel

__all__ = ["ModuleState", "WeightWatch", "capture_warnings"]

# Bumped by every parameter, buffer or submodule registration in the process (any module).
registrations = [0]
_installed = False
_install_lock = threading.Lock()


def _bump(*_: object) -> None:
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


_SCALARS = (int, float, bool, str, type(None))


class ModuleState:
    """What a model's forward may change outside its outputs: buffer values, and Python scalars
    (``int``, ``float``, ``bool``, ``str``, ``None``) in every submodule's ``__dict__``."""

    def __init__(self, fn: object) -> None:
        self.fn = fn
        self.buffers: list[tuple[str, dict[str, Any], str, torch.Tensor, torch.Tensor]] = []
        self.attrs: list[tuple[str, Any, str, Any]] = []
        if not isinstance(fn, torch.nn.Module):
            return
        for prefix, module in fn.named_modules():
            dot = f"{prefix}." if prefix else ""
            for key, buf in module._buffers.items():
                if buf is not None:
                    self.buffers.append((dot + key, module._buffers, key, buf, buf.detach().clone()))
            for key, value in vars(module).items():
                if type(value) in _SCALARS:
                    self.attrs.append((dot + key, module, key, value))

    def restore(self) -> tuple[list[str], list[str], list[str]]:
        """Put back what changed; return ``(buffers restored, buffers replaced, attributes changed)``.

        A buffer written in place gets its values back (the graphs write the same memory, once per
        replay, as eager does per call). A buffer rebound to another tensor, or a Python attribute
        changed, is put back too, but the graphs froze it: the caller refuses the capture.
        """
        restored, replaced, changed = [], [], []
        with torch.no_grad():
            for name, table, key, buf, saved in self.buffers:
                now = table.get(key)
                if now is not buf:
                    table[key] = buf
                    replaced.append(name)
                if buf.shape == saved.shape and not torch.equal(buf, saved):
                    buf.copy_(saved)
                    restored.append(name)
        for name, module, key, value in self.attrs:
            now = vars(module).get(key, _MISSING)
            if type(now) is not type(value) or now != value:
                module.__dict__[key] = value
                changed.append(f"{name} ({value!r} -> {now!r})")
        return restored, replaced, changed


_MISSING = object()


def capture_warnings(fn: object, warned: set[str]) -> None:
    """Warn once per runner (``warned``) about what replay cannot do like eager: hooks on the model
    (they run while capturing, never at replay) and dropout or batch norm left in training mode."""
    if not isinstance(fn, torch.nn.Module):
        return
    from torch.nn.modules import module as nn_module

    hooked = [
        prefix or type(m).__name__
        for prefix, m in fn.named_modules()
        if m._forward_hooks or m._forward_pre_hooks
    ]
    if getattr(nn_module, "_global_forward_hooks", None) or getattr(
        nn_module, "_global_forward_pre_hooks", None
    ):
        hooked.append("(global module hooks)")
    if hooked and "hooks" not in warned:
        warned.add("hooks")
        warnings.warn(
            f"devgraph: forward hooks or pre-hooks on {', '.join(hooked[:5])} run while capturing, not at "
            "replay: what they compute or record is frozen at capture. Remove them before wrapping, or run "
            "their work outside the model",
            stacklevel=user_stacklevel(),
        )
    training = [
        prefix or type(m).__name__
        for prefix, m in fn.named_modules()
        if m.training
        and isinstance(m, (torch.nn.modules.dropout._DropoutNd, torch.nn.modules.batchnorm._NormBase))
    ]
    if training and "train_mode" not in warned:
        warned.add("train_mode")
        warnings.warn(
            f"devgraph: the model is in training mode ({', '.join(training[:5])}): dropout masks are frozen "
            "at capture and batch norm uses batch statistics over padded rows. Call model.eval() before "
            "wrapping (or graphed.eval())",
            stacklevel=user_stacklevel(),
        )
