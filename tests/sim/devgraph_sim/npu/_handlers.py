"""The simulator's ``torch_npu.npu._npugraph_handlers``: torch_npu 2.13.0's task-update handler registry.

torch_npu 2.13.0 keeps, per op (``func.__name__``: ``"_npu_paged_attention.default"``), a handler class
in ``_NPU_GRAPH_OP_HANDLERS`` (filled by the ``register_npu_graph_handler`` decorator). A handler's
declarative ``UPDATE_SPECS`` names the host arguments a task update may replace (``("arg", 7,
"context_lens")``), ``prepare_capture`` may swap the call for its ``.out`` overload with pre-allocated
outputs, and ``postprocess_result`` returns what the caller gets. ``_GraphDispatchMode`` (auto dispatch
capture) and devgraph's NPU backend both read this registry.

The registry, the base class and the built-in handlers mirror the wheel's sources
(``torch_npu/npu/_npugraph_handlers/{npugraph_handler,ifa_handler,simple_handler,_fa3_graph_handler}.py``);
``tests/backends/npu/test_npu_signatures.py`` checks the registered names and every ``UPDATE_SPECS`` against the
wheel. Handlers whose ops the simulator does not implement (IFA v2, FA v3, MLA) are registered with
their specs; their ``prepare_capture`` raises ``NotImplementedError`` naming the op.
"""

from __future__ import annotations

import logging
from copy import deepcopy
from typing import Any

import torch

__all__ = ["NpuGraphOpHandler", "_NPU_GRAPH_OP_HANDLERS", "register_npu_graph_handler"]

logger = logging.getLogger("devgraph_sim.npu")


class NpuGraphOpHandler:
    """Base class of the op handlers (stateless: every hook is a classmethod)."""

    UPDATE_SPECS: dict[str, list[tuple[str, Any, str]]] = {}

    @classmethod
    def prepare_capture(cls, func, args, kwargs):
        return func, args, kwargs

    @classmethod
    def postprocess_result(cls, result, kwargs):
        return result

    @classmethod
    def get_update_specs(cls, op_name):
        return cls.UPDATE_SPECS.get(op_name, [])

    @classmethod
    def update_args(cls, dispatch_record, update_input):
        specs = cls.get_update_specs(dispatch_record.op_cache_entry.__name__)
        for loc, idx_or_name, key in specs:
            if key not in update_input:
                continue
            if loc == "arg":
                if len(dispatch_record.args) > idx_or_name:
                    dispatch_record.args[idx_or_name] = update_input[key]
            elif loc == "kwarg":
                dispatch_record.kwargs[idx_or_name] = update_input[key]

    @classmethod
    def record_wrap_kwarg(cls, key, value, tensor_param_names):
        if value is None:
            return None
        if isinstance(value, (list, tuple)):
            return type(value)(v if isinstance(v, torch.Tensor) else deepcopy(v) for v in value)
        if isinstance(value, torch.Tensor):
            return value
        return deepcopy(value)


_NPU_GRAPH_OP_HANDLERS: dict[str, type[NpuGraphOpHandler]] = {}


def register_npu_graph_handler(op_names):
    """Class decorator: store the handler class under each of ``op_names`` (a later one overrides)."""

    def decorator(cls):
        names = op_names if isinstance(op_names, (list, tuple)) else [op_names]
        for name in names:
            if name in _NPU_GRAPH_OP_HANDLERS:
                logger.warning(
                    "NpuGraphOpHandler for '%s' is being overridden: %s -> %s",
                    name,
                    _NPU_GRAPH_OP_HANDLERS[name].__name__,
                    cls.__name__,
                )
            _NPU_GRAPH_OP_HANDLERS[name] = cls
        return cls

    return decorator


def _sim_op(name: str) -> Any:
    from devgraph_sim.npu import _ops

    if name.split(".")[0] not in {n.split(".")[0] for n in _ops.SCHEMAS}:
        raise NotImplementedError(f"the torch_npu simulator does not implement {name}")
    return _ops.op(name)


class _TensorListOutHandler(NpuGraphOpHandler):
    @classmethod
    def postprocess_result(cls, result, kwargs):
        return kwargs["out"]


def _specs(
    names: tuple[str, ...], specs: list[tuple[str, Any, str]]
) -> dict[str, list[tuple[str, Any, str]]]:
    return {name: list(specs) for name in names}


_IFA_V1 = (
    "npu_fused_infer_attention_score",
    "npu_fused_infer_attention_score.default",
    "npu_fused_infer_attention_score.out",
)
_IFA_V2 = (
    "npu_fused_infer_attention_score_v2",
    "npu_fused_infer_attention_score_v2.default",
    "npu_fused_infer_attention_score_v2.out",
)
_FA3_FWD = ("npu_fusion_attention_v3", "npu_fusion_attention_v3.default", "npu_fusion_attention_v3.out")
_FA3_BWD = (
    "npu_fusion_attention_grad_v3",
    "npu_fusion_attention_grad_v3.default",
    "npu_fusion_attention_grad_v3.out",
)


@register_npu_graph_handler(list(_IFA_V1))
class _IFAv1DefaultHandler(_TensorListOutHandler):
    """IFA v1: ``.default`` pre-allocates workspace and outputs and swaps to ``.out``."""

    UPDATE_SPECS = _specs(_IFA_V1, [("arg", 5, "actual_seq_lengths"), ("arg", 6, "actual_seq_lengths_kv")])

    @classmethod
    def prepare_capture(cls, func, args, kwargs):
        ifa = _sim_op("npu_fused_infer_attention_score")
        if func is ifa.out:
            return func, args, kwargs
        workspace = _sim_op("_npu_fused_infer_attention_score_get_max_workspace")(*args, **kwargs)
        keys = ("input_layout", "quant_scale2", "block_table", "num_heads", "num_key_value_heads",
                "softmax_lse_flag", "query_rope")  # fmt: skip
        output, softmax_lse = _sim_op("_npu_fused_infer_attention_score_infer_output")(
            args[0], args[2], **{k: kwargs[k] for k in keys if k in kwargs}
        )
        kwargs["workspace"] = workspace
        kwargs["out"] = [output, softmax_lse]
        return ifa.out, args, kwargs


@register_npu_graph_handler(list(_IFA_V2))
class _IFAv2DefaultHandler(_TensorListOutHandler):
    """IFA v2 (not simulated: capture raises ``NotImplementedError``)."""

    UPDATE_SPECS = _specs(_IFA_V2, [("arg", 7, "actual_seq_qlen"), ("arg", 8, "actual_seq_kvlen")])

    @classmethod
    def prepare_capture(cls, func, args, kwargs):
        _sim_op("npu_fused_infer_attention_score_v2")
        return func, args, kwargs


@register_npu_graph_handler(["_npu_paged_attention.default", "npu_multi_head_latent_attention.out"])
class _SimpleGraphHandler(NpuGraphOpHandler):
    """Paged attention and MLA: the update replaces ``context_lens`` in place."""

    UPDATE_SPECS = {
        "_npu_paged_attention.default": [("arg", 7, "context_lens")],
        "npu_multi_head_latent_attention.out": [("arg", 5, "context_lens")],
    }


@register_npu_graph_handler(list(_FA3_FWD))
class FA3ForwardHandler(_TensorListOutHandler):
    """FA v3 forward (not simulated)."""

    UPDATE_SPECS = _specs(_FA3_FWD, [("arg", 14, "actual_seq_qlen"), ("arg", 15, "actual_seq_kvlen")])

    @classmethod
    def prepare_capture(cls, func, args, kwargs):
        _sim_op("npu_fusion_attention_v3")
        return func, args, kwargs


@register_npu_graph_handler(list(_FA3_BWD))
class FA3BackwardHandler(_TensorListOutHandler):
    """FA v3 backward (not simulated)."""

    UPDATE_SPECS = _specs(_FA3_BWD, [("arg", 21, "actual_seq_qlen"), ("arg", 22, "actual_seq_kvlen")])

    @classmethod
    def prepare_capture(cls, func, args, kwargs):
        _sim_op("npu_fusion_attention_grad_v3")
        return func, args, kwargs
