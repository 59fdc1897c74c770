"""vLLM speculative decoding with devgraph: the drafter's graphs, their counters, the config check.

vLLM gives the drafter (``draft_model``, ``eagle``) PIECEWISE graphs only (its dispatcher's keys,
``SpecDecodeBaseProposer.initialize_cudagraph_keys``: PIECEWISE when the target's mode has PIECEWISE or
FULL mixed batches, else none), never FULL. devgraph serves them as compiled pieces
(``cudagraph_mode=PIECEWISE``: vLLM's piecewise backend wraps each piece of the drafter in
``DevgraphGraphWrapper``) or as breakable graphs (``VLLM_USE_BREAKABLE_CUDAGRAPH=1``: vLLM's CPU runner
wraps nothing, so ``_runner.wrap_drafter_model`` puts a breakable ``DevgraphGraphWrapper`` around the
drafter's model, as vLLM's GPU runner puts its ``BreakableCUDAGraphWrapper``). The drafter's wrappers count under
``stats()["capture.draft.<mode>"]``, ``replay.draft.<mode>``, ...; one that captured graphs but never
replayed one is counted (``unreplayed.draft.<mode>``) and warned about at shutdown.

The target's verify step (``k + 1`` query tokens per request) in FULL graphs: ``_cpu_verify_attention``.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from devgraph._errors import DevgraphError
from devgraph.adapters.vllm import _stats
from devgraph.adapters.vllm._plugin import DEVGRAPH_VLLM_ENV
from devgraph.adapters.vllm._wrapper import (
    DRAFT_PREFIX,
    DevgraphGraphWrapper,
    is_drafter_runnable,
)

__all__ = [
    "DRAFT_PREFIX",
    "check_speculative_config",
    "is_drafter_runnable",
    "report_unreplayed_drafter_graphs",
]

logger = logging.getLogger("devgraph")

#: the wrappers already reported (each is reported once).
_reported: weakref.WeakSet[Any] = weakref.WeakSet()


def report_unreplayed_drafter_graphs() -> list[str]:
    """Warn once per call about drafter wrappers that captured graphs but never replayed one, and count
    them (``unreplayed.draft.<mode>``): the drafter then ran eagerly while its graphs sat unused."""
    unused: list[str] = []
    for wrapper in list(DevgraphGraphWrapper._all_instances):
        if not wrapper.label.startswith(DRAFT_PREFIX) or wrapper.replays or not wrapper.entries:
            continue
        if wrapper in _reported:
            continue
        _reported.add(wrapper)
        _stats.count("unreplayed", wrapper.label)
        unused.append(f"{wrapper.label} ({len(wrapper.entries)} graphs)")
    if unused:
        logger.warning(
            "devgraph: drafter graphs captured but never replayed: %s. The drafter's steps ran eagerly "
            "(vLLM dispatched none of them to these graphs); counted in "
            "devgraph.adapters.vllm.stats()['unreplayed.draft.*']",
            ", ".join(sorted(unused)),
        )
    return unused


#: True once this process has said that the drafter runs eagerly (FULL_DECODE_ONLY, ...).
_said_drafter_eager = False


def check_speculative_config(
    platform_cls: Any, vllm_config: Any, *, devgraph_attention: bool, cpu_kernel: bool
) -> None:
    """The platform's config check for speculative decoding (after the base platform's).

    Args:
        platform_cls: the devgraph platform class.
        vllm_config: vLLM's config, resolved by the base platform.
        devgraph_attention: FULL graphs run devgraph's task-updated attention (a device that freezes host
            arguments).
        cpu_kernel: that attention is vLLM's CPU kernel (``_cpu_attention``, ``_cpu_verify_attention``).

    Raises:
        DevgraphError: FULL graphs with speculative decoding where devgraph's attention takes one query
            token per request (``devgraph::paged_decode_attention``, NPU): the verify step takes
            ``k + 1``; its graphs would be refused by vLLM (all steps eager) or, worse, replayed with the
            capture's plan.
    """
    global _said_drafter_eager
    spec = getattr(vllm_config, "speculative_config", None)
    cc = vllm_config.compilation_config
    if spec is None or cc.cudagraph_mode is None or cc.cudagraph_mode.name == "NONE":
        return
    k = int(getattr(spec, "num_speculative_tokens", 0) or 0)
    if devgraph_attention and not cpu_kernel and k > 0:
        raise DevgraphError(
            f"devgraph's vLLM platform: speculative decoding ({spec.method}, num_speculative_tokens={k}) with "
            f"cudagraph_mode={cc.cudagraph_mode.name}: on devgraph device {platform_cls.devgraph_device_name!r} "
            "FULL graphs run devgraph's decode attention (devgraph::paged_decode_attention), which takes one "
            f"query token per request, and the target's verify step takes {k + 1}. Pass "
            "compilation_config={'cudagraph_mode': 'PIECEWISE'} (graphs of the pieces between the attention "
            f"calls, the drafter's too), or unset {DEVGRAPH_VLLM_ENV}"
        )
    drafter_model = spec.use_eagle() or spec.uses_draft_model()
    if drafter_model and not spec.enforce_eager and not _drafter_has_graphs(cc) and not _said_drafter_eager:
        _said_drafter_eager = True
        logger.warning(
            "devgraph vLLM platform: speculative decoding (%s) with cudagraph_mode=%s: the drafter's steps "
            "run eagerly (vLLM gives a drafter PIECEWISE graphs only, and with this mode it has none; the "
            "target's steps are served as without a drafter). For the drafter's graphs too set "
            "VLLM_USE_BREAKABLE_CUDAGRAPH=1 (FULL_AND_PIECEWISE: breakable graphs for the drafter and the "
            "target's mixed batches) or compilation_config={'cudagraph_mode': 'PIECEWISE'}",
            spec.method,
            cc.cudagraph_mode.name,
        )


def _drafter_has_graphs(cc: Any) -> bool:
    """Whether vLLM's drafter gets graphs: its dispatcher has PIECEWISE keys when the target's mixed mode
    is PIECEWISE or FULL, served by a breakable wrapper (``_runner.wrap_drafter_model``) or by compiled pieces."""
    from vllm.compilation.breakable_cudagraph import is_breakable_cudagraph_enabled
    from vllm.config import CompilationMode

    if cc.cudagraph_mode.mixed_mode().name not in ("PIECEWISE", "FULL"):
        return False
    return bool(is_breakable_cudagraph_enabled()) or (
        cc.mode == CompilationMode.VLLM_COMPILE and cc.cudagraph_mode.has_piecewise_cudagraphs()
    )
