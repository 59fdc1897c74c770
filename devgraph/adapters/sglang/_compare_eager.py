"""``DEVGRAPH_COMPARE_EAGER=n`` for SGLang: every n-th replayed step also runs eagerly and is compared.

The backend's hook lines call ``remember`` at capture (the step's forward function for that shape)
and ``replayed`` after a replay, only when ``CHECK`` is set (off by default: a replay then pays one
attribute test). The eager run is SGLang's own forward function of the shape, on the same static
batch the replay read; its ``LogitsProcessorOutput.next_token_logits`` give each row's margins. A flip
that is not a near-tie bisects the step (``devgraph.bisect`` of that forward function). Each comparison
is counted in the backend's stats (``eager_checks``, mirrored to ``DEVGRAPH_SGLANG_STATS``).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any

from devgraph.adapters.sglang import _stats
from devgraph.debug import BisectOptions, EagerCheck, eager_check_from_env
from devgraph.debug import bisect as devgraph_bisect

__all__ = ["CHECK", "configure", "remember", "replayed"]

CHECK: EagerCheck | None = None
_FORWARDS: weakref.WeakKeyDictionary[Any, dict[Any, Callable[[], Any]]] = weakref.WeakKeyDictionary()


def configure(environ: Any = None) -> EagerCheck | None:
    """(Re)read ``DEVGRAPH_COMPARE_EAGER``; returns the check (None: off)."""
    global CHECK
    CHECK = eager_check_from_env("sglang", environ)
    return CHECK


def remember(backend: Any, shape_key: Any, forward_fn: Callable[[], Any]) -> None:
    """Keep the forward function ``backend`` captured for ``shape_key`` (the eager side of a check)."""
    _FORWARDS.setdefault(backend, {})[shape_key] = forward_fn


def _logits(output: Any) -> Any:
    return getattr(output, "next_token_logits", output)


def replayed(backend: Any, shape_key: Any, output: Any) -> None:
    """On a sampled step, run the shape's forward function eagerly and compare with ``output``."""
    check = CHECK
    if check is None:
        return
    forward = _FORWARDS.get(backend, {}).get(shape_key)
    if forward is None or not check.due():
        return

    def bisect() -> Any:
        # With DEVGRAPH_SGLANG_COMPILE=1 the forward is SGLang's torch.compile'd one: the bisect
        # descends into it compiled as SGLang compiles it.
        mode = os.environ.get("SGLANG_TORCH_COMPILE_MODE", "max-autotune-no-cudagraphs")
        return devgraph_bisect(
            forward, bisect_options=BisectOptions(device=backend.device, compile_mode=mode)
        )

    # Every row: devgraph's SGLang decode graphs replay exact batch sizes only (no padding rows;
    # tests/adapters/sglang/test_engine_compare_eager.py compares them: 0 difference).
    result = check.compare(output, forward, _logits, bisect, real_rows=None)
    entry = {
        "step": result.step,
        "max_abs": result.max_abs,
        "rows": result.rows,
        "flips": len(result.flips),
        "margins": [[c.graphed_margin, c.eager_margin, c.near_tie] for _, c in result.flips],
    }
    report = result.bisect
    if report is not None:
        entry["bisect"] = report.first.summary() if report.first is not None else "no op differs"
        entry["bisect_inside"] = report.first.inside if report.first is not None else ""
    _stats.record(lambda s: s.eager_checks.append(entry))


configure()
