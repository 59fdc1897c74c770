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

    # vLLM builds the wrapper with CUDAGraphWrapper's parameters; anything devgraph adds after them
    # must be keyword-only with a default, so vLLM's own calls still bind.
    theirs = list(inspect.signature(CUDAGraphWrapper.__init__).parameters.values())
    ours = list(inspect.signature(DevgraphGraphWrapper.__init__).parameters.values())
    assert [(p.name, p.kind) for p in ours[: len(theirs)]] == [(p.name, p.kind) for p in theirs]
    for extra in ours[len(theirs) :]:
        assert extra.kind is inspect.Parameter.KEYWORD_ONLY, extra.name
        assert extra.default is not inspect.Parameter.empty, extra.name
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


def test_worker_and_model_runner_methods_the_devgraph_runner_path_builds_on_exist():
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    for worker in (CPUWorker, Worker):
        for name in ("init_device", "compile_or_warm_up_model"):
            assert callable(getattr(worker, name)), (worker, name)
    assert issubclass(CPUModelRunner, GPUModelRunner)  # one runner path serves both
    for name in ("load_model", "get_model", "capture_model", "profile_cudagraph_memory"):
        assert callable(getattr(GPUModelRunner, name)), name
    assert _params(GPUModelRunner.profile_cudagraph_memory) == ["self"]


#: Every private (underscored) vLLM symbol the adapter relies on, where, and why. Keep this list short:
#: a new entry needs a reason no public symbol serves.
PRIVATE_SYMBOLS = {
    # _runner.DevgraphModelRunnerMixin._model_forward: the runner's documented override point around
    # the model call ("can be overridden by subclasses"), where over-size eager decode is counted.
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner._model_forward": [
        "self",
        "input_ids",
        "positions",
        "intermediate_tensors",
        "inputs_embeds",
        "model_kwargs",
    ],
    # _platform: which built-in platform the devgraph platform subclasses (CPU: graphs kept on; CUDA
    # and ROCm: the platform's own attention). Platform.is_cuda_alike() is an instance method.
    "vllm.platforms.cpu.CpuPlatform._enum": None,
    # _wrapper.clear_all_graphs: the platform's cached global graph pool, renewed once all its graphs
    # are reset (vLLM's get_global_graph_pool() caches it there).
    "vllm.platforms.interface.Platform._global_graph_pool": None,
    # _breakable.vllm_break_ops: the ops vLLM's compiled PIECEWISE mode splits at (its default
    # splitting_ops; with breakable graphs on, vLLM leaves splitting_ops empty).
    "vllm.config.CompilationConfig._attention_ops": None,
    # _breakable: which layer a captured attention break served (the op's layer_name may be wrapped).
    "vllm.utils.torch_utils._resolve_layer_name": ["layer_name"],
}


@pytest.mark.parametrize("qualname", sorted(PRIVATE_SYMBOLS))
def test_each_private_symbol_the_adapter_relies_on_is_pinned(qualname):
    from vllm.utils.import_utils import resolve_obj_by_qualname

    owner, _, name = qualname.rpartition(".")
    obj = getattr(resolve_obj_by_qualname(owner), name)
    expected = PRIVATE_SYMBOLS[qualname]
    if expected is not None:
        assert _params(obj) == expected


def test_the_adapter_uses_no_other_private_vllm_symbol():
    import ast
    from pathlib import Path

    import devgraph.adapters.vllm as adapter

    allowed = {q.rpartition(".")[2] for q in PRIVATE_SYMBOLS} | {
        # devgraph's own names and vllm-ascend's (pinned below when vllm-ascend is installed)
        "_update_full_graph_params_if_needed",
        # instance attributes vLLM's CPU attention reads off the layer (pinned below)
        *CPU_ATTENTION_LAYER_ATTRIBUTES,
    }
    used = set()
    for path in Path(adapter.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                used.add(node.attr)
    own = {
        "_all_instances",
        "_users",
        "_stats",
        "_runner",
        "_host_args",
        "_worker",
        "_platform",
        "_plugin",
        "_attention",
        "_wrapper",
        "_built",
        "_adopted",
        "_counters",
        "_lock",
        "_platform_cls",
        "_check_addresses",
        "_capture",
        "_replay",
        "_prefill",
        "_attend",
        "_devgraph_note_decode",
        "_pool",
        "_open_group",
        "_reference",
        "_cpu_attention",
        "_graph_set",
        "_step_host_args",
        "_attention_inside_segments",
    }
    assert used - own <= allowed, sorted(used - own - allowed)


def test_model_runner_v2_lives_where_the_adapter_detects_it():
    import importlib.util

    # adopt_model_runner refuses runners from these packages (vLLM's V2 runner; vllm-ascend's is
    # vllm_ascend.worker.v2): the V2 runner captures its FULL graphs without the wrapper hook.
    assert importlib.util.find_spec("vllm.v1.worker.gpu.model_runner") is not None


def test_vllm_ascend_runner_symbols_when_installed():
    ascend = pytest.importorskip("vllm_ascend.worker.model_runner_v1")
    runner = ascend.NPUModelRunner
    # vllm-ascend's per-step attention update after FULL replays: devgraph's replay does it instead.
    assert callable(runner._update_full_graph_params_if_needed)
    assert callable(runner.load_model) and callable(runner.get_model)


def test_attention_backend_registry_has_the_custom_slot_and_the_layout():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.kv_cache_layout import KVCacheLayout

    assert "CUSTOM" in AttentionBackendEnum.__members__
    assert KVCacheLayout.LBNHC.value == (0, 1, 3, 2, 4)


#: Attributes of vLLM's attention layer that its CPU attention passes to its kernels, and so does
#: devgraph's FULL-graph task (_cpu_attention): instance attributes, checked in vLLM's own source.
CPU_ATTENTION_LAYER_ATTRIBUTES = ("_k_scale_float", "_v_scale_float")


def test_cpu_attention_the_full_graph_task_runs_is_vllms():
    """_cpu_attention subclasses vLLM's CPU_ATTN and calls its kernels with these signatures."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends import cpu_attn

    assert _params(ops.cpu_attn_get_scheduler_metadata) == [
        "num_reqs", "num_heads", "num_kv_heads", "head_dim", "seq_lens", "dtype", "query_start_loc",
        "causal", "sliding_window_size", "isa", "enable_kv_split", "dynamic_causal", "kv_cache_dtype",
    ]  # fmt: skip
    assert _params(ops.cpu_attention_with_kv_cache) == [
        "query", "key_cache", "value_cache", "output", "query_start_loc", "seq_lens", "scale", "causal",
        "alibi_slopes", "sliding_window", "block_table", "softcap", "scheduler_metadata", "s_aux",
        "dynamic_causal", "k_scale", "v_scale", "kv_cache_dtype",
    ]  # fmt: skip
    assert _params(ops.cpu_attn_reshape_and_cache)[:6] == [
        "key", "value", "key_cache", "value_cache", "slot_mapping", "isa",
    ]  # fmt: skip
    # The builder's scheduler parameters the task rebuilds the metadata with, and the metadata
    # fields it reads.
    source = inspect.getsource(cpu_attn.CPUAttentionMetadataBuilder)
    for name in ("self.num_heads", "self.window_size", "self.isa", "VLLM_CPU_ATTN_SPLIT_KV"):
        assert name in source, name
    fields = {f.name for f in dataclasses.fields(cpu_attn.CPUAttentionMetadata)}
    assert {"block_table", "scheduler_metadata", "causal", "dynamic_causal"} <= fields
    forward = inspect.getsource(cpu_attn.CPUAttentionBackendImpl)
    for name in CPU_ATTENTION_LAYER_ATTRIBUTES:
        assert f"layer.{name}" in forward, name


def test_breakable_graph_switch_wrapper_and_split_ops_the_breakable_wrapper_builds_on():
    # VLLM_USE_BREAKABLE_CUDAGRAPH is vLLM's switch; its wrapper (replaced) holds runnable and
    # runtime_mode; the breaks are its compiled PIECEWISE mode's split ops, read from these names.
    import vllm.envs as envs
    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphWrapper, is_breakable_cudagraph_enabled
    from vllm.config import CompilationConfig
    from vllm.model_executor.layers.attention import attention
    from vllm.utils.torch_utils import _resolve_layer_name

    assert "VLLM_USE_BREAKABLE_CUDAGRAPH" in envs.environment_variables
    assert callable(is_breakable_cudagraph_enabled)
    assert _params(BreakableCUDAGraphWrapper.__init__) == ["self", "runnable", "vllm_config", "runtime_mode"]
    assert "vllm::unified_attention_with_output" in CompilationConfig._attention_ops
    # The attention op takes the layer's name (how the wrapper tells which layers ran as breaks).
    assert _params(attention.unified_attention_with_output)[4] == "layer_name"
    assert _params(attention.unified_kv_cache_update) == ["key", "value", "layer_name"]
    assert _resolve_layer_name("model.layers.0.self_attn.attn") == "model.layers.0.self_attn.attn"
