"""Pass, PassContext, PassManager and the pass registry.

A pass is a small object over an aten-level FX graph (before the split):

* ``name``: how configs and reports refer to it;
* ``is_applicable(ctx)``: whether it should run for this device / compile backend (a fusion whose
  fused op has no kernel for the device's dispatch key is not);
* ``__call__(graph) -> int``: rewrite the graph in place, return how many matches it rewrote;
* ``uuid()``: a stable hash of what it does (class, ``version``, parameters), folded into cache keys.

Backends contribute passes through the ``devgraph_register_passes(register, device)`` hook; they
run after the built-ins unless a config lists passes by name.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
from torch import fx

from devgraph._errors import DevgraphError

if TYPE_CHECKING:
    from devgraph._contract import Device

__all__ = ["Pass", "PassContext", "PassManager", "builtin_passes", "contributed_passes", "resolve_passes"]

logger = logging.getLogger("devgraph.compile")


@attrs.frozen
class PassContext:
    """What a pass may ask about where its graph will run."""

    device: Device | None = None
    compile_backend: str = "eager"
    splitting_ops: tuple[str, ...] = ()

    @property
    def dispatch_key(self) -> str:
        return self.device.dispatch_key if self.device is not None else "CPU"


class Pass:
    """Base class of graph passes (see the module docstring). Subclasses set ``name`` and ``version``."""

    name: str = ""
    #: bump when the rewrite changes, so cached compilations keyed by ``uuid()`` are not reused.
    version: int = 1

    def is_applicable(self, ctx: PassContext) -> bool:
        return True

    def __call__(self, graph: fx.Graph) -> int:
        raise NotImplementedError

    def uuid(self) -> str:
        params = sorted((k, repr(v)) for k, v in vars(self).items() if not k.startswith("_"))
        key = f"{type(self).__module__}.{type(self).__qualname__}:{self.name}:{self.version}:{params}"
        return hashlib.sha256(key.encode()).hexdigest()[:16]

    def __repr__(self) -> str:
        return f"<devgraph pass {self.name}>"


class PassManager:
    """Runs passes in order over a graph and reports how many matches each rewrote.

    Args:
        passes: pass objects, in order.
        context: where the graph will run (passes that are not applicable are skipped).
    """

    def __init__(self, passes: Sequence[Pass], context: PassContext | None = None) -> None:
        self.passes = list(passes)
        self.context = context or PassContext()
        self.report: dict[str, int] = {}

    def __call__(self, graph: fx.Graph) -> dict[str, int]:
        """Run the applicable passes; return ``{pass name: matches rewritten}`` (also ``self.report``)."""
        self.report = {}
        for p in self.passes:
            if not p.is_applicable(self.context):
                logger.debug(
                    "devgraph: pass %s is not applicable on %s, skipped", p.name, self.context.device
                )
                continue
            count = int(p(graph))
            self.report[p.name] = self.report.get(p.name, 0) + count
            logger.debug("devgraph: pass %s rewrote %d match(es)", p.name, count)
        graph.lint()
        return dict(self.report)

    def uuid(self) -> str:
        """A hash of the pass list (each pass's ``uuid()``, in order)."""
        return hashlib.sha256("|".join(p.uuid() for p in self.passes).encode()).hexdigest()[:16]


def builtin_passes() -> list[Pass]:
    """devgraph's own passes, in their default order (more specific fusions first)."""
    from devgraph.compile.passes._norm import (
        AddRmsNormDynamicQuantFusion,
        AddRmsNormFusion,
        AddRmsNormQuantFusion,
    )
    from devgraph.compile.passes._qkv import SplitQkvRmsNormRopeFusion

    return [
        SplitQkvRmsNormRopeFusion(),
        AddRmsNormQuantFusion(),
        AddRmsNormDynamicQuantFusion(),
        AddRmsNormFusion(),
    ]


def contributed_passes(device: Device | None) -> list[Pass]:
    """Passes plugins contribute for ``device`` through ``devgraph_register_passes``."""
    from devgraph._plugins import call_each_hookimpl, plugin_manager

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
