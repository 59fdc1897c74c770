"""What a model's forward may change besides its outputs, put back after warm-ups and capture.

A capture freezes whatever the model's Python code computed. ``ModuleState`` snapshots what
warm-ups and capture may change (buffer values, Python scalars in module ``__dict__``s) and restores
it; ``capture_warnings`` names what replay cannot do like eager (hooks, training-mode layers).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from devgraph._source import user_stacklevel

__all__ = ["ModuleState", "capture_warnings"]

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
