"""Pass, PassContext and PassManager: what a pass is and how a list of them runs.

A pass is a small object over an aten-level FX graph (before the split):

* ``name``: how configs and reports refer to it;
* ``is_applicable(ctx)``: whether it should run for this device / compiler (a fusion whose
  fused op has no kernel for the device's dispatch key is not);
* ``__call__(graph) -> int``: rewrite the graph in place, return how many matches it rewrote;
* ``uuid()``: a stable hash of what it does (class, ``version``, parameters), folded into cache keys.

Which passes run (the built-ins, then the ones backends contribute) is ``_registry``'s business.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
from torch import fx

if TYPE_CHECKING:
    from devgraph.graph import Device

__all__ = ["Pass", "PassContext", "PassManager"]

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
