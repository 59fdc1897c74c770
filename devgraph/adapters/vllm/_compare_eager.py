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

    check.compare(output, lambda: runnable(*args, **kwargs), compute_logits, bisect, real_rows=_real_rows())


def _real_rows() -> int | None:
    """The step's real tokens: a FULL step is padded to a captured size, and its padding rows hold
    whatever the kernels leave there (vLLM's eager attention does not write zero-length rows, so two
    eager runs of one step differ there). ``num_actual_tokens`` counts the padding in a FULL step;
    the last entry of ``query_start_loc`` does not (padding rows are empty queries)."""
    context = _forward_context()
    if context is None:
        return None
    from devgraph.adapters.vllm._host_args import metadata_objects

    for m in metadata_objects(getattr(context, "attn_metadata", None)):
        starts = getattr(m, "query_start_loc_cpu", None)
        if starts is None:
            starts = getattr(m, "query_start_loc", None)  # a device tensor on CUDA: one read per checked step
        if starts is not None and starts.numel() > 0:
            return int(starts[-1])
        n = getattr(m, "num_actual_tokens", None)
        if isinstance(n, int):
            return n
    return None


configure()


def _forward_context() -> Any:
    """vLLM's forward context of the step (None outside a step, or where vLLM is absent: a unit test)."""
    try:
        from vllm.forward_context import get_forward_context, is_forward_context_available
    except ImportError:
        return None
    return get_forward_context() if is_forward_context_available() else None
