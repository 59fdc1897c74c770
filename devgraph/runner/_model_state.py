"""What replay cannot do like eager, warned about at capture: hooks, training-mode layers.

What the forward changes in the model is snapshot and put back by ``StateSnapshot``
(``_snapshot.py``); ``capture_warnings`` names what no snapshot can fix.
"""

from __future__ import annotations

import warnings

import torch

from devgraph._source import user_stacklevel

__all__ = ["capture_warnings"]


def capture_warnings(fn: object, warned: set[str], hooks: bool = True) -> None:
    """Warn once per runner (``warned``) about what replay cannot do like eager: hooks on the model
    (they run while capturing, never at replay: ``hooks=False`` where Dynamo traced them) and dropout
    or batch norm left in training mode."""
    if not isinstance(fn, torch.nn.Module):
        return
    if hooks:
        _warn_hooks(fn, warned)
    _warn_training(fn, warned)


def _warn_hooks(fn: torch.nn.Module, warned: set[str]) -> None:
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


def _warn_training(fn: torch.nn.Module, warned: set[str]) -> None:
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
