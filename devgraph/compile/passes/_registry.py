"""The pass registry: which passes a config's ``passes`` means on a device.

The built-in fusions (``_norm``, ``_qkv``) run first, in a fixed order; backends contribute passes
through the ``devgraph_register_passes(register, device)`` hook, run after the built-ins unless a
config lists passes by name. This module sits above the passes it lists, so a pass module never
needs it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from devgraph._errors import DevgraphError
from devgraph._plugins import call_each_hookimpl, plugin_manager
from devgraph.compile.passes._base import Pass
from devgraph.compile.passes._norm import (
    AddRmsNormDynamicQuantFusion,
    AddRmsNormFusion,
    AddRmsNormQuantFusion,
)
from devgraph.compile.passes._qkv import SplitQkvRmsNormRopeFusion

if TYPE_CHECKING:
    from devgraph.graph import Device

__all__ = ["builtin_passes", "contributed_passes", "resolve_passes"]


def builtin_passes() -> list[Pass]:
    """devgraph's own passes, in their default order (more specific fusions first)."""
    return [
        SplitQkvRmsNormRopeFusion(),
        AddRmsNormQuantFusion(),
        AddRmsNormDynamicQuantFusion(),
        AddRmsNormFusion(),
    ]


def contributed_passes(device: Device | None) -> list[Pass]:
    """Passes plugins contribute for ``device`` through ``devgraph_register_passes``."""
    found: list[Pass] = []

    def register(p: Any) -> None:
        if not callable(p) or not hasattr(p, "uuid") or not hasattr(p, "is_applicable"):
            raise DevgraphError(
                f"devgraph_register_passes registered {p!r}, which is not a pass (an object with name, "
                "is_applicable(ctx), __call__(graph) and uuid()); subclass devgraph.compile.Pass"
            )
        found.append(p)

    call_each_hookimpl(
        plugin_manager().hook.devgraph_register_passes,
        "registering passes",
        lambda origin: {"register": register, "device": device},
    )
    return found


def resolve_passes(passes: Sequence[Any] | None, device: Device | None) -> list[Pass]:
    """The pass objects a config's ``passes`` means on ``device``.

    None: the built-ins then the contributed passes. Otherwise each entry is a pass object or the
    name of a built-in or contributed pass.

    Raises:
        DevgraphError: an unknown pass name (the message lists the known ones).
    """
    contributed = contributed_passes(device)
    if passes is None:
        return builtin_passes() + contributed
    known = {p.name: p for p in builtin_passes() + contributed}
    resolved = []
    for entry in passes:
        if isinstance(entry, str):
            if entry not in known:
                raise DevgraphError(f"unknown pass {entry!r}; known passes: {', '.join(sorted(known))}")
            resolved.append(known[entry])
        elif callable(entry) and hasattr(entry, "uuid"):
            resolved.append(entry)
        else:
            raise DevgraphError(f"passes must hold pass names or pass objects, got {entry!r}")
    return resolved
