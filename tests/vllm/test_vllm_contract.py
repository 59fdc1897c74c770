"""Pins the vLLM 0.32 classes and signatures the adapter relies on, so a vLLM upgrade fails here first."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

vllm = pytest.importorskip("vllm")


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_vllm_is_the_pinned_version():
    assert vllm.__version__.startswith("0.32.0")


def test_platform_plugin_group_is_the_entry_point_group_devgraph_registers_in():
    from vllm.plugins import PLATFORM_PLUGINS_GROUP

    assert PLATFORM_PLUGINS_GROUP == "vllm.platform_plugins"


def test_static_graph_wrapper_protocol_is_what_the_wrapper_implements():
    from vllm.compilation.cuda_graph import CUDAGraphOptions, CUDAGraphWrapper

    from devgraph.adapters.vllm._wrapper import DevgraphGraphWrapper

    assert _params(CUDAGraphWrapper.__init__) == _params(DevgraphGraphWrapper.__init__)
    assert {f.name for f in dataclasses.fields(CUDAGraphOptions)} == {
        "debug_log_enable",
        "gc_disable",
        "weak_ref_output",
    }


def test_forward_context_carries_the_dispatch_decision_and_attention_metadata():
    from vllm.forward_context import ForwardContext

    fields = {f.name for f in dataclasses.fields(ForwardContext)}
    assert {"cudagraph_runtime_mode", "batch_descriptor", "attn_metadata"} <= fields


def test_platform_hooks_the_devgraph_platform_overrides_exist_on_vllms_platform():
    from vllm.platforms.interface import Platform

    for name in (
        "check_and_update_config",
        "support_static_graph_mode",
        "get_static_graph_wrapper_cls",
        "get_global_graph_pool",
        "get_attn_backend_cls",
        "opaque_attention_op",
    ):
        assert callable(getattr(Platform, name)), name
    assert _params(Platform.get_attn_backend_cls)[:3] == [
        "selected_backend",
        "attn_selector_config",
        "num_heads",
    ]


def test_worker_and_model_runner_methods_the_cpu_worker_builds_on_exist():
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.cpu_worker import CPUWorker

    for name in ("init_device", "compile_or_warm_up_model"):
        assert callable(getattr(CPUWorker, name)), name
    for name in ("load_model", "get_model", "capture_model"):
        assert callable(getattr(CPUModelRunner, name)), name


def test_attention_backend_registry_has_the_custom_slot_and_the_layout():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.kv_cache_layout import KVCacheLayout

    assert "CUSTOM" in AttentionBackendEnum.__members__
    assert KVCacheLayout.LBNHC.value == (0, 1, 3, 2, 4)
