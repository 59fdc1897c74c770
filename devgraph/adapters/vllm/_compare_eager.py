"""``DEVGRAPH_COMPARE_EAGER=n`` for vLLM: every n-th replayed step also runs eagerly and is compared.

The wrapper's one hook line calls ``replayed`` after a replay only when ``CHECK`` is set (off by
default: then a replay pays one attribute test). The eager run is the wrapper's own runnable on the
same persistent buffers; margins come from the model's ``compute_logits`` where it has one (a FULL
graph of the whole model), else the output alone is compared (a piece's hidden states).
"""

from __future__ import annotations

from typing import Any

from devgraph.debug import EagerCheck, eager_check_from_env

__all__ = ["CHECK", "configure", "replayed"]

CHECK: EagerCheck | None = None


def configure(environ: Any = None) -> EagerCheck | None:
    """(Re)read ``DEVGRAPH_COMPARE_EAGER``; returns the check (None: off)."""
    global CHECK
    CHECK = eager_check_from_env("vllm", environ)
    return CHECK


def replayed(runnable: Any, output: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """On a sampled step, run ``runnable`` eagerly on the same arguments and compare with ``output``."""
    check = CHECK
    if check is None or not check.due():
        return
    compute_logits = getattr(runnable, "compute_logits", None)
    check.compare(output, lambda: runnable(*args, **kwargs), compute_logits)


configure()
