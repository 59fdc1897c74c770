"""Host arguments of one vLLM step, for graphs whose attention was captured as updatable tasks.

On devices where attention reads sequence lengths from a host list (NPU, and the CPU reference
backend, which freezes host arguments exactly like the NPU), a replay must first re-issue every
attention task with the step's lengths: vllm-ascend's ``update_attn_params``, done here through
``Graph.replay(host_args=...)``. An attention metadata object opts in by carrying
``devgraph_host_args``: a mapping ``{op argument name: host value}`` for the padded batch
(``devgraph.adapters.vllm.attention`` builds one).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from devgraph._errors import DevgraphError

__all__ = ["add_updatable_op", "metadata_objects", "step_host_args", "updatable_ops"]

#: Ops of the adapter's attention backends captured as updatable tasks, besides the device's own.
_ADAPTER_OPS: list[str] = []


def add_updatable_op(name: str) -> None:
    """Capture every call of the registered op ``name`` (``"ns::op"``) as an updatable task."""
    if name not in _ADAPTER_OPS:
        _ADAPTER_OPS.append(name)


def updatable_ops(device: Any) -> tuple[str, ...]:
    """What a capture on ``device`` takes as updatable tasks: the device's ops, and the adapter's
    attention ops registered so far (an attention module registers its op when it is imported)."""
    return (*getattr(device, "updatable_ops", ()), *_ADAPTER_OPS)


def metadata_objects(attn_metadata: Any) -> list[Any]:
    """The attention metadata objects of one step (vLLM's dict per layer, or a list of them)."""
    # vLLM passes {layer name: metadata}, or a list of such dicts (one per micro-batch).
    if attn_metadata is None:
        return []
    if isinstance(attn_metadata, Mapping):
        return list(attn_metadata.values())
    if isinstance(attn_metadata, (list, tuple)):
        return [m for part in attn_metadata for m in metadata_objects(part)]
    return [attn_metadata]


def step_host_args(context: Any, graph: Any) -> Mapping[str, Any]:
    """The host arguments of this step for ``graph``'s updatable tasks.

    Raises:
        DevgraphError: the graph holds updatable tasks but the step's attention metadata carries no
            ``devgraph_host_args`` (replaying would reuse the capture-time lengths: a wrong result),
            or layers disagree on them.
    """
    found: Mapping[str, Any] | None = None
    for metadata in metadata_objects(getattr(context, "attn_metadata", None)):
        host_args = getattr(metadata, "devgraph_host_args", None)
        if host_args is None:
            continue
        if found is not None and found != host_args:
            raise DevgraphError(
                "attention layers of one vLLM step carry different devgraph_host_args; one graph "
                "can only be updated with one set (one KV-cache group per graph)"
            )
        found = host_args
    if found is None:
        ops = sorted({t.op for t in graph.tasks})
        raise DevgraphError(
            f"this graph captured updatable tasks ({', '.join(ops)}) whose host arguments change every "
            "step, but the step's attention metadata carries no devgraph_host_args: replaying would "
            "reuse the capture-time values. Use the devgraph attention backend, or PIECEWISE graphs."
        )
    return found
