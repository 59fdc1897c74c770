"""Level 1: the SGLang 0.5.23 surface the adapter relies on, checked against the installed SGLang.

An SGLang upgrade that moves or renames any of it fails here, by name, before an engine run does.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from importlib.metadata import entry_points, version

import pytest

# "sglang.srt", not "sglang": this directory is itself importable as a namespace package "sglang".
pytest.importorskip("sglang.srt")

from sglang.srt.layers.attention import attention_registry
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.model_executor.runner.base_cuda_graph_runner import BaseCudaGraphRunner
from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
from sglang.srt.model_executor.runner_backend import utils as backend_utils
from sglang.srt.model_executor.runner_backend.base_cuda_graph_backend import (
    BaseCudaGraphBackend,
)
from sglang.srt.platforms.device_mixin import PlatformEnum
from sglang.srt.platforms.interface import PlatformCapabilities, SRTPlatform
from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, PLATFORM_PLUGINS_GROUP

from devgraph.adapters.sglang import SGLANG_VERSION
from devgraph.adapters.sglang._backend import DevgraphGraphBackend
from devgraph.adapters.sglang._plugin import activate, register


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_installed_sglang_is_the_pinned_release():
    assert version("sglang") == SGLANG_VERSION


def test_entry_point_groups_are_the_ones_sglang_reads():
    assert (PLATFORM_PLUGINS_GROUP, GENERAL_PLUGINS_GROUP) == ("sglang.srt.platforms", "sglang.srt.plugins")


def test_devgraph_registers_its_platform_and_general_plugin():
    platforms = {ep.name: ep.value for ep in entry_points(group=PLATFORM_PLUGINS_GROUP)}
    plugins = {ep.name: ep.value for ep in entry_points(group=GENERAL_PLUGINS_GROUP)}
    assert platforms["devgraph"] == "devgraph.adapters.sglang._plugin:activate"
    assert plugins["devgraph"] == "devgraph.adapters.sglang._plugin:register"


def test_platform_capabilities_have_the_fields_devgraph_declares():
    assert {"graph_capture", "piecewise_graph"} <= set(PlatformCapabilities.__struct_fields__)
    assert PlatformCapabilities().graph_capture is False  # conservative default: devgraph must opt in


def test_platform_hooks_keep_their_signatures():
    assert _params(SRTPlatform.get_graph_runner_cls) == ["self"]
    assert _params(SRTPlatform.get_full_graph_backend_cls) == ["self"]
    assert _params(SRTPlatform.get_default_attention_backend) == ["self"]
    assert _params(SRTPlatform.apply_server_args_defaults) == ["self", "server_args"]
    assert _params(SRTPlatform.init_backend) == ["self"]
    assert PlatformEnum.OOT in PlatformEnum


def test_graph_backend_abc_has_exactly_the_methods_devgraph_implements():
    assert BaseCudaGraphBackend.__abstractmethods__ == {
        "capture_session",
        "capture_one",
        "can_run",
        "replay_session",
        "replay",
        "cleanup",
    }
    assert _params(BaseCudaGraphBackend.capture_one) == [
        "self",
        "shape_key",
        "forward_fn",
        "capture_inputs",
        "post_warmup_hook",
    ]
    assert _params(BaseCudaGraphBackend.replay) == ["self", "shape_key", "static_forward_batch", "kwargs"]
    assert not DevgraphGraphBackend.__abstractmethods__


def test_npu_backend_replay_with_input_update_matches_devgraphs():
    from sglang.srt.hardware_backend.npu.graph_runner.npu_cudagraph_backend import NPUCudaGraphBackend

    assert _params(NPUCudaGraphBackend.replay_with_input_update) == _params(
        DevgraphGraphBackend.replay_with_input_update
    )


def test_decode_runner_hooks_devgraph_overrides_still_exist():
    assert BaseCudaGraphRunner.__abstractmethods__ >= {"capture", "capture_one_shape", "capture_prepare"}
    assert _params(DecodeCudaGraphRunner.capture) == ["self"]
    assert _params(DecodeCudaGraphRunner._record_in_graph_metadata_prep_done) == ["self"]
    # The runner builds its backend through resolve_decode_backend, which asks an out-of-tree platform
    # for its full backend class except on npu/xpu (where devgraph's runner swaps the backend).
    source = inspect.getsource(backend_utils.resolve_decode_backend)
    assert "get_full_graph_backend_cls" in source and 'model_runner.device == "npu"' in source
    assert "self.backend = resolve_decode_backend(self)" in inspect.getsource(DecodeCudaGraphRunner.__init__)


def test_attention_backend_hooks_devgraph_overrides_still_exist():
    for name in (
        "init_forward_metadata",
        "init_forward_metadata_out_graph",
        "init_cuda_graph_state",
        "get_cuda_graph_seq_len_fill_value",
        "forward_decode",
    ):
        assert callable(getattr(TorchNativeAttnBackend, name)), name
    assert _params(TorchNativeAttnBackend.init_forward_metadata_out_graph) == [
        "self",
        "forward_batch",
        "in_capture",
    ]
    assert callable(attention_registry.register_attention_backend)


def test_prefill_backend_is_resolved_by_the_function_devgraph_hooks():
    # SGLang has no platform hook for prefill graphs: devgraph wraps resolve_prefill_backend (_prefill.py).
    from sglang.srt.model_executor.runner import prefill_cuda_graph_runner as prefill_runner
    from sglang.srt.model_executor.runner_backend.breakable_cuda_graph_backend import (
        BreakableCudaGraphBackend,
    )

    from devgraph.adapters.sglang._prefill import RESOLVE_PREFILL_BACKEND, DevgraphBreakableBackend

    module, _, name = RESOLVE_PREFILL_BACKEND.rpartition(".")
    assert module == backend_utils.__name__ and name == "resolve_prefill_backend"
    assert _params(backend_utils.resolve_prefill_backend) == ["cuda_graph_runner"]
    assert "return BreakableCudaGraphBackend(" in inspect.getsource(backend_utils.resolve_prefill_backend)
    runner = prefill_runner.PrefillCudaGraphRunner
    assert "self.backend = resolve_prefill_backend(self)" in inspect.getsource(runner.__init__)
    # The runner captures the transformer body and runs the LM head eagerly for this class (and Full's).
    assert "isinstance(self.backend, (BreakableCudaGraphBackend, FullCudaGraphBackend))" in inspect.getsource(
        runner.__init__
    )
    assert issubclass(DevgraphBreakableBackend, BreakableCudaGraphBackend)
    assert not DevgraphBreakableBackend.__abstractmethods__
    body = inspect.getsource(runner._execute_body_capture)
    assert "self.backend.replay(shape_key, static_forward_batch, **kwargs)" in body


def test_radix_attention_reaches_the_attention_backend_unless_sglangs_breakable_flag_is_set():
    # devgraph leaves SGLang's flag off, so prefill attention reaches the devgraph backend's break op
    # (with the flag on, RadixAttention cuts SGLang's own CUDA segments instead).
    from sglang.srt.layers.radix_attention import RadixAttention

    forward = inspect.getsource(RadixAttention.forward)
    assert "breakable_cg = is_in_breakable_cuda_graph()" in forward
    assert "get_attn_backend().forward(" in forward
    assert _params(TorchNativeAttnBackend.forward_extend)[:7] == [
        "self",
        "q",
        "k",
        "v",
        "layer",
        "forward_batch",
        "save_kv_cache",
    ]


def test_plugin_hook_registry_has_what_devgraph_uses():
    from sglang.srt.plugins import hook_registry

    assert _params(hook_registry.HookRegistry.register)[:3] == ["target", "hook", "hook_type"]
    assert hook_registry.HookType.AROUND.value == "around"
    assert hook_registry._current_plugin_source.get() is None  # set only inside load_plugins


def _printed_json(code: str, env: dict[str, str]) -> dict:
    """What ``python -c code`` prints as JSON on its last line, run in a fresh process under ``env``."""
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, check=True
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _hooked(env: dict[str, str]) -> dict:
    code = (
        "import json\n"
        "from devgraph.adapters.sglang._plugin import register\n"
        "register()\n"
        "from sglang.srt.model_executor.runner_backend import utils\n"
        "from sglang.srt.model_executor.runner import prefill_cuda_graph_runner as r\n"
        "w = getattr(utils.resolve_prefill_backend, '__wrapped__', None)\n"
        "print(json.dumps({'wrapped': w is not None, 'runner_sees_it': r.resolve_prefill_backend is utils.resolve_prefill_backend}))"
    )
    return _printed_json(code, env)


def test_general_plugin_hooks_prefill_resolution_only_under_sglang_platform_devgraph():
    plain = {k: v for k, v in os.environ.items() if k != "SGLANG_PLATFORM"}
    assert _hooked(plain) == {"wrapped": False, "runner_sees_it": True}
    assert _hooked(dict(plain, SGLANG_PLATFORM="devgraph")) == {"wrapped": True, "runner_sees_it": True}


def test_general_plugin_adds_only_the_devgraph_attention_backend(monkeypatch):
    monkeypatch.delenv("SGLANG_PLATFORM", raising=False)
    before = dict(attention_registry.ATTENTION_BACKENDS)
    register()
    after = attention_registry.ATTENTION_BACKENDS
    assert set(after) - set(before) <= {"devgraph"} and "devgraph" in after
    assert {k: v for k, v in after.items() if k != "devgraph"} == {
        k: v for k, v in before.items() if k != "devgraph"
    }


def test_activate_is_inert_unless_sglang_platform_selects_devgraph(monkeypatch):
    monkeypatch.delenv("SGLANG_PLATFORM", raising=False)
    assert activate() is None
    monkeypatch.setenv("SGLANG_PLATFORM", "other")
    assert activate() is None


def test_selected_platform_is_out_of_tree_with_devgraph_runner_and_backend(monkeypatch):
    from sglang.srt.platforms import _load_platform_class

    from devgraph.adapters.sglang._decode_runner import DevgraphDecodeGraphRunner

    monkeypatch.setenv("SGLANG_PLATFORM", "devgraph")
    monkeypatch.setenv("DEVGRAPH_BACKEND", "cpu")
    platform = _load_platform_class(activate())()
    assert platform.is_out_of_tree() and platform.capabilities.graph_capture
    assert not platform.capabilities.piecewise_graph  # SGLang's torch.compile piecewise backend: not used
    assert platform.get_graph_runner_cls() is DevgraphDecodeGraphRunner
    assert issubclass(DevgraphDecodeGraphRunner, DecodeCudaGraphRunner)
    assert platform.get_full_graph_backend_cls() is DevgraphGraphBackend
    assert platform.get_default_attention_backend() == "devgraph"


def test_npu_backend_on_cpu_tensors_gets_the_cpu_platform_with_npu_graphs_and_sglangs_npu_runner(monkeypatch):
    # devgraph's torch_npu simulator (tests/sim): devgraph's NPU backend, tensors on torch's cpu. SGLang
    # must run on "cpu" (there is no torch.npu), capturing NpuGraphs with SGLang's NPU runner.
    from sglang.srt.platforms import _load_platform_class

    from devgraph.adapters.sglang._backend import devgraph_device_for
    from devgraph.adapters.sglang._decode_runner import DevgraphDecodeGraphRunner, npu_graph_runner_cls
    from devgraph.adapters.sglang._platform import DevgraphCpuPlatform
    from devgraph_sim.npu import simulated_torch_npu

    monkeypatch.setenv("SGLANG_PLATFORM", "devgraph")
    monkeypatch.delenv("DEVGRAPH_BACKEND", raising=False)
    with simulated_torch_npu():
        platform = _load_platform_class(activate())()
        assert type(platform) is DevgraphCpuPlatform
        assert devgraph_device_for("cpu").name == "npu"
        assert platform.get_graph_runner_cls() is npu_graph_runner_cls()
        monkeypatch.setenv("DEVGRAPH_BACKEND", "cpu")  # the CPU reference, simulator or not
        assert devgraph_device_for("cpu").name == "cpu"
        assert platform.get_graph_runner_cls() is DevgraphDecodeGraphRunner


def _resolved_platform(env: dict[str, str]) -> dict:
    code = (
        "import json; from sglang.srt.platforms import current_platform as p; "
        "print(json.dumps({'cls': type(p).__module__ + '.' + type(p).__name__, 'oot': p.is_out_of_tree()}))"
    )
    return _printed_json(code, env)


def test_plain_sglang_resolves_its_own_platform_with_devgraph_installed():
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_PLATFORM"}
    resolved = _resolved_platform(env)
    assert not resolved["oot"] and "devgraph" not in resolved["cls"]


def test_sglang_platform_devgraph_resolves_devgraphs_platform():
    env = dict(os.environ, SGLANG_PLATFORM="devgraph", DEVGRAPH_BACKEND="cpu")
    resolved = _resolved_platform(env)
    assert resolved == {"cls": "devgraph.adapters.sglang._platform.DevgraphCpuPlatform", "oot": True}


def test_server_args_the_platform_reads_at_engine_start_exist():
    # DevgraphCpuPlatform.apply_server_args_defaults / graph_settings_notes read (and write) these.
    from sglang.srt.arg_groups.overrides import field_names
    from sglang.srt.server_args import ServerArgs

    read = {
        "device",
        "attention_backend",
        "disable_cuda_graph",
        "disable_decode_cuda_graph",
        "enable_torch_compile",
        "cuda_graph_bs_decode",
        "cuda_graph_max_bs_decode",
        "torch_compile_max_bs",
    }
    assert read <= set(field_names(ServerArgs))


def test_cpu_decode_capture_still_needs_enable_torch_compile_and_sizes_by_torch_compile_max_bs():
    # What the start-up warning and the cuda_graph_max_bs_decode translation rest on (SGLang 0.5.23).
    from sglang.srt.arg_groups import memory_hook
    from sglang.srt.model_executor.model_runner_components import cuda_graph_setup

    capture = inspect.getsource(cuda_graph_setup.capture_decode_graph)
    assert 'model_runner.device == "cpu" and not get_flags().capture.enable_torch_compile' in capture
    sizing = inspect.getsource(memory_hook)
    assert "torch_compile_max_bs=cfg.torch_compile_max_bs" in sizing
