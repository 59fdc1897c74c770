"""The modes of devgraph's runner: one table, read by ``wrap``, the runner, the configs (the runner's and
the compiler's), the Hugging Face adapter, the Dynamo front end and the bisect."""

from __future__ import annotations

import attrs

__all__ = ["MODES", "MODE_TABLE", "Mode"]


@attrs.frozen
class Mode:
    """One mode of the runner: which part serves its calls (``serves``: ``"whole"`` graphs per
    bucket, ``"pieces"`` of a traced model (devgraph.compile), ``"breakable"`` graphs
    (devgraph.graph)) and whether whole graphs serve uniform decode batches first (``routes``: the
    ``full_and_*`` modes, told by ``is_decode``)."""

    name: str
    serves: str
    routes: bool = False


#: Every mode, by name.
MODE_TABLE = {
    m.name: m
    for m in (
        Mode("full", "whole"),
        Mode("piecewise", "pieces"),
        Mode("full_and_piecewise", "pieces", routes=True),
        Mode("breakable", "breakable"),
        Mode("full_and_breakable", "breakable", routes=True),
    )
}
MODES = tuple(MODE_TABLE)
