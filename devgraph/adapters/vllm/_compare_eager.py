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
    if _runs_vllm_cpu_attention():
        _refuse_once()
        return
    runnable = wrapper.runnable
    compute_logits = getattr(runnable, "compute_logits", None)

    def bisect() -> Any:
        options = BisectOptions(device=wrapper.device)
        return devgraph_bisect(runnable, *args, bisect_options=options, **kwargs)

    check.compare(output, lambda: runnable(*args, **kwargs), compute_logits, bisect, _real_rows())


def _real_rows() -> int | None:
    """The step's real tokens (a FULL step is padded to a captured size): from the attention metadata."""
    context = _forward_context()
    if context is None:
        return None
    from devgraph.adapters.vllm._host_args import metadata_objects

    for m in metadata_objects(getattr(context, "attn_metadata", None)):
        n = getattr(m, "num_actual_tokens", None)
        if isinstance(n, int):
            return n
    return None


configure()


_REFUSED: list[bool] = []


def _runs_vllm_cpu_attention() -> bool:
    """Whether this step's attention is vLLM's own CPU kernel run as a devgraph task (the CPU platform's
    FULL decode graphs, ``_cpu_attention``)."""
    context = _forward_context()
    if context is None:
        return False
    from devgraph.adapters.vllm._host_args import metadata_objects

    return any(
        type(m).__name__ == "DevgraphCpuAttentionMetadata"
        for m in metadata_objects(getattr(context, "attn_metadata", None))
    )


def _forward_context() -> Any:
    """vLLM's forward context of the step (None outside a step, or where vLLM is absent: a unit test)."""
    try:
        from vllm.forward_context import get_forward_context, is_forward_context_available
    except ImportError:
        return None
    return get_forward_context() if is_forward_context_available() else None


def _refuse_once() -> None:
    # An eager re-run of a FULL step inside that step does not reproduce it with vLLM's CPU attention
    # (measured: differences of order 1 in the real rows while the served tokens and logprobs equal vLLM
    # without devgraph), so a comparison would report a difference that is not there. Say so instead.
    if _REFUSED:
        return
    _REFUSED.append(True)
    import logging

    logging.getLogger("devgraph.debug").warning(
        "devgraph: DEVGRAPH_COMPARE_EAGER does not compare FULL decode graphs on vLLM's CPU platform: they "
        "run vLLM's own attention kernel as a task, and an eager re-run inside the step does not reproduce "
        "the step, so it would report differences that are not there. Compare whole runs instead "
        "(devgraph.compare_tokens on the engine's outputs with and without DEVGRAPH_VLLM), or use "
        "cudagraph_mode=PIECEWISE"
    )
