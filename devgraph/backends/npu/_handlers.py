"""torch_npu's task-update handler registry, as devgraph's NPU backend uses it.

torch_npu 2.13 ships ``torch_npu.npu._npugraph_handlers``: per op overload (``func.__name__``, e.g.
``"_npu_paged_attention.default"``) a handler class whose declarative ``UPDATE_SPECS`` names the host
arguments a task update replaces (fused infer attention v1 ``actual_seq_lengths(_kv)``, v2
``actual_seq_qlen`` / ``actual_seq_kvlen``, ``_npu_paged_attention`` and MLA ``context_lens``), whose
``prepare_capture`` swaps a ``.default`` call for its ``.out`` overload with pre-allocated workspace and
outputs, and whose ``postprocess_result`` gives the caller its result. devgraph keeps no op table of
its own for these ops: every op the registry handles (and the loaded torch_npu provides) is updatable
on the NPU device, captured and re-issued the way torch_npu's own ``auto_dispatch_capture`` does.

The registry keys its specs by torch_npu's names for the host arguments; devgraph's backend-neutral
update API (``Graph.update({name: value})``) names arguments by the op's schema. The two agree for
every handler of the 2.13.0 wheel (``tests/backends/npu/test_npu_signatures.py`` checks each spec against the
schema); ``spec_names`` refuses a handler whose spec disagrees instead of updating the wrong slot.

An older torch_npu without the registry leaves devgraph's own updatable op only.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from devgraph._errors import DevgraphError

__all__ = ["REGISTRY_MODULE", "handler_registry", "registry_ops", "spec_names"]

logger = logging.getLogger("devgraph.npu")

#: Where torch_npu keeps ``_NPU_GRAPH_OP_HANDLERS`` (2.13+).
REGISTRY_MODULE = "torch_npu.npu._npugraph_handlers.npugraph_handler"

#: Op namespaces searched for a registry op the torch_npu module does not expose as an attribute.
_NAMESPACES = ("npu", "atb")


def handler_registry() -> Mapping[str, Any] | None:
    """torch_npu's ``_NPU_GRAPH_OP_HANDLERS`` (``{op overload name: handler class}``), None before 2.13."""
    try:
        module = importlib.import_module(REGISTRY_MODULE)
    except ImportError as exc:
        logger.info("torch_npu has no task-update handler registry (%s); devgraph's own ops only", exc)
        return None
    registry = getattr(module, "_NPU_GRAPH_OP_HANDLERS", None)
    return registry if isinstance(registry, Mapping) else None


def _packet(torch_npu: ModuleType, base: str) -> Any:
    import torch

    packet = getattr(torch_npu, base, None)
    if packet is not None and hasattr(packet, "_qualified_op_name"):
        return packet
    for ns in _NAMESPACES:
        try:
            return getattr(getattr(torch.ops, ns), base)
        except (AttributeError, RuntimeError):
            continue
    return None


def registry_ops(torch_npu: ModuleType, registry: Mapping[str, Any] | None) -> tuple[str, ...]:
    """Qualified names (``"npu::npu_fused_infer_attention_score"``) of the registry's ops that this
    torch_npu registers: the ops an NPU graph captures as updatable tasks besides devgraph's own."""
    if not registry:
        return ()
    names = []
    for op_name in registry:
        packet = _packet(torch_npu, op_name.split(".")[0])
        if packet is not None:
            names.append(str(packet._qualified_op_name))
    return tuple(dict.fromkeys(names))


def spec_names(func: Any, handler: Any) -> tuple[str, ...]:
    """The host-argument names ``handler``'s ``UPDATE_SPECS`` gives ``func`` (an op overload).

    Raises:
        DevgraphError: a positional spec whose name is not the schema's name at that position (the
            update would replace another argument than the one named).
    """
    schema = [a.name for a in func._schema.arguments]
    names = []
    for loc, where, key in handler.get_update_specs(func.__name__):
        if loc == "arg" and isinstance(where, int) and where < len(schema) and schema[where] != key:
            raise DevgraphError(
                f"torch_npu's handler {handler.__name__} updates {func.__name__} argument {where} as "
                f"{key!r}, but the op's schema names it {schema[where]!r}; devgraph cannot name this "
                "update safely. Report it, and use NPUGraph.update(cpu_update_input=...) meanwhile"
            )
        names.append(key)
    return tuple(names)
