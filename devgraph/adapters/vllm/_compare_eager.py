"""``DEVGRAPH_COMPARE_EAGER=n`` for vLLM: every n-th replayed step also runs eagerly and is compared.

The wrapper's one hook line calls ``replayed`` after a replay only when ``CHECK`` is set (off by
default: then a replay pays one attribute test). The eager run is the wrapper's own runnable on the
same persistent buffers; margins come from the model's ``compute_logits`` where it has one (a FULL
graph of the whole model), else the output alone is compared (a piece's hidden states). A flip that is
not a near-tie bisects the step (``devgraph.bisect`` of the runnable on the step's arguments).
"""

from __future__ import annotations

from typing import Any

from devgraph.debug import BisectOptions, EagerCheck, eager_check_from_env
from devgraph.debug import bisect as devgraph_bisect

__all__ = ["CHECK", "configure", "replayed"]

CHECK: EagerCheck | None = None


def configure(environ: Any = None) -> EagerCheck | None:
    """(Re)read ``DEVGRAPH_COMPARE_EAGER``; returns the check (None: off)."""
    global CHECK
    CHECK = eager_check_from_env("vllm", environ)
    return CHECK


def replayed(wrapper: Any, output: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """On a sampled step, run the wrapper's runnable eagerly on the same arguments and compare with
    ``output``; a flip that is not a near-tie bisects the step (captured for the purpose)."""
    check = CHECK
    if check is None or not check.due():
        return
    runnable = wrapper.runnable
    compute_logits = getattr(runnable, "compute_logits", None)

    def bisect() -> Any:
        options = BisectOptions(device=wrapper.device)
        return devgraph_bisect(runnable, *args, bisect_options=options, **kwargs)

    check.compare(output, lambda: runnable(*args, **kwargs), compute_logits, bisect)


configure()
