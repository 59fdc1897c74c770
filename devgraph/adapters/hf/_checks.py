"""Wrap-time checks of a Hugging Face model: position biases, and whether devgraph's decode hook is reached.

Both look at the model as transformers built it, without running it:

* ``position_bias_source``: ALiBi (attention biases computed from positions in the forward, per
  call, from host values and the 2-D mask) found generically: any config field, in the config or
  its sub-configs (MPT's ``attn_config``), whose name says ``alibi`` and is on, or
  ``position_embedding_type="alibi"``; and, where no config field names it at all, a model whose
  modeling module defines an ``*alibi*`` function it always uses (Bloom). Falcon's module defines one
  too, but its ``config.alibi`` is False: the field decides when there is one.
* ``decode_hook_reachable``: transformers' ``generate`` reaches a compiled decode step through
  ``model.get_compiled_call(compile_config)``; for some model types (``llama4`` in transformers
  5.23-5.24) that method returns the plain forward whatever is set, so the per-instance switch
  devgraph uses is never read.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

from devgraph.adapters.hf._route import decode_route, route_config

__all__ = ["decode_hook_reachable", "position_bias_source"]


def _config_fields(config: Any, prefix: str = "config", depth: int = 0) -> list[tuple[str, Any]]:
    """``(dotted name, value)`` of a config's fields, sub-configs (objects with ``to_dict``) included."""
    fields: list[tuple[str, Any]] = []
    if depth > 3:
        return fields
    for name, value in sorted(vars(config).items()):
        if name.startswith("_"):
            continue
        dotted = f"{prefix}.{name}"
        if hasattr(value, "to_dict") and not isinstance(value, type):
            fields.extend(_config_fields(value, dotted, depth + 1))
        elif isinstance(value, dict):
            fields.extend(
                (f"{dotted}[{k!r}]", v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))
            )
        else:
            fields.append((dotted, value))
    return fields


def position_bias_source(model: Any) -> str | None:
    """Where ``model``'s ALiBi position biases come from (``"config.attn_config.alibi=True"``), or None."""
    named = [(n, v) for n, v in _config_fields(model.config) if "alibi" in n.rsplit(".", 1)[-1].lower()]
    for name, value in named:
        if value is True or (isinstance(value, (int, float)) and not isinstance(value, bool) and value):
            return f"{name}={value!r}"
    for name, value in _config_fields(model.config):
        if "position_embedding" in name.lower() and isinstance(value, str) and "alibi" in value.lower():
            return f"{name}={value!r}"
    if named:  # the config says whether: it says no
        return None
    module = sys.modules.get(type(model).__module__)
    functions = (
        [n for n, f in vars(module).items() if "alibi" in n.lower() and inspect.isfunction(f)]
        if module
        else []
    )
    if functions:
        return f"{type(model).__module__}.{sorted(functions)[0]}, which its forward always applies"
    return None


def decode_hook_reachable(model: Any) -> bool:
    """Whether ``model.get_compiled_call`` returns the per-instance compiled call devgraph sets.

    False means transformers' ``generate`` would call the plain forward for every decode step of this
    model type (``llama4`` in transformers 5.23-5.24); the adapter then reaches its decode step by
    shadowing ``get_compiled_call`` on the instance for the duration of one ``generate``.
    """
    sentinel = object()
    config = route_config()
    with decode_route(model, sentinel, config):
        try:
            return model.get_compiled_call(config) is sentinel
        except Exception:  # a release whose get_compiled_call compiles or fails: not reachable
            return False
