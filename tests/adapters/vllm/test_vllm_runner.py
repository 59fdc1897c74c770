"""The device-neutral model-runner path (``_runner``, ``_worker``) against vLLM's own classes, on the
CPU reference backend, without an engine: the FULL wrapper swap, graph lifecycle (profiling graphs,
``clear_all_graphs`` and re-capture), over-size decode batches, and the settings refused up front.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from _fake_engine import AttentionModel, platform_on, step, vllm_config

import devgraph
from devgraph._errors import DevgraphError

CAPTURED, LATER = [5, 9], [30, 3]


@pytest.fixture
def cpu():
    with platform_on("cpu") as platform:
        yield platform


def _full_config():
    from vllm.config import CompilationMode, CUDAGraphMode

    config = vllm_config()
    config.compilation_config.mode = CompilationMode.VLLM_COMPILE
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL
    return config


class _GpuLikeRunner:
    """Stands in for vLLM's GPU runner: ``load_model`` wraps the model with vLLM's CUDAGraphWrapper."""

    def __init__(self, config, model) -> None:
        self.vllm_config = config
        self.compilation_config = config.compilation_config
        self._model = model
        self.profiled = None

    def load_model(self) -> None:
        from vllm.compilation.cuda_graph import CUDAGraphWrapper
        from vllm.config import CUDAGraphMode

        self.model = CUDAGraphWrapper(self._model, self.vllm_config, runtime_mode=CUDAGraphMode.FULL)

    def get_model(self):
        return self.model

    def profile_cudagraph_memory(self) -> int:
        # What vLLM's does, as far as devgraph's wrappers see it: a capture phase through the wrapper.
        step(self.model, self._model, self.vllm_config, CAPTURED, capture=True)
        self.profiled = [(g, g.pool()) for _, g in self.model.graphs.items()]
        return 0

    def _model_forward(self, **kwargs):
        return "ran"


def test_load_model_replaces_the_platforms_full_wrapper_around_the_same_model(cpu):
    from vllm.compilation.cuda_graph import CUDAGraphWrapper

    from devgraph.adapters.vllm._runner import DevgraphModelRunnerMixin, adopt_model_runner
    from devgraph.adapters.vllm._wrapper import DevgraphGraphWrapper

    model = AttentionModel(torch.float32)
    runner = adopt_model_runner(_GpuLikeRunner(_full_config(), model))
    assert isinstance(runner, DevgraphModelRunnerMixin) and isinstance(runner, _GpuLikeRunner)
    runner.load_model()
    assert isinstance(runner.model, DevgraphGraphWrapper)
    assert not isinstance(runner.model.runnable, CUDAGraphWrapper)
    assert runner.model.runnable is model and runner.get_model() is model


def test_unwrapped_model_gets_the_full_wrapper_and_piecewise_only_configs_are_left_alone(cpu):
    from vllm.config import CUDAGraphMode

    from devgraph.adapters.vllm._runner import wrap_full_model
    from devgraph.adapters.vllm._wrapper import DevgraphGraphWrapper

    model = AttentionModel(torch.float32)
    config = _full_config()
    assert isinstance(wrap_full_model(model, config), DevgraphGraphWrapper)  # vLLM's CPU runner: unwrapped
    config.compilation_config.cudagraph_mode = CUDAGraphMode.PIECEWISE
    assert wrap_full_model(model, config) is model


def test_adopting_vllms_cpu_runner_keeps_its_class_behind_the_mixin():
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    from devgraph.adapters.vllm._runner import DevgraphModelRunnerMixin, adopt_model_runner

    runner = CPUModelRunner.__new__(CPUModelRunner)  # its state does not matter to the adoption
    adopt_model_runner(runner)
    mro = type(runner).__mro__
    assert mro[1:3] == (DevgraphModelRunnerMixin, CPUModelRunner)
    assert type(runner).load_model is DevgraphModelRunnerMixin.load_model
    assert adopt_model_runner(runner) is runner and type(runner).__mro__ == mro  # idempotent


def test_model_runner_v2_is_refused_naming_the_setting():
    from devgraph.adapters.vllm._runner import adopt_model_runner

    V2 = type("GPUModelRunner", (), {"__module__": "vllm.v1.worker.gpu.model_runner"})
    with pytest.raises(DevgraphError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        adopt_model_runner(V2())


def test_profiling_graphs_go_to_a_profiling_pool_and_do_not_survive_into_serving(cpu):
    from devgraph.adapters.vllm._runner import adopt_model_runner

    model = AttentionModel(torch.float32)
    config = _full_config()
    runner = adopt_model_runner(_GpuLikeRunner(config, model))
    runner.load_model()
    serving_pool = runner.model.graph_pool
    runner.profile_cudagraph_memory()
    ((profiled_graph, profiled_pool),) = runner.profiled
    assert profiled_pool is not serving_pool  # captured into a profiling pool
    assert runner.model.entries == {} and runner.model.graph_pool is serving_pool
    # The real capture phase captures again (a stale profiling graph would have been replayed).
    step(runner.model, model, config, CAPTURED, capture=True)
    (graph,) = [g for _, g in runner.model.graphs.items()]
    assert graph is not profiled_graph and graph.pool() is serving_pool


def test_clear_all_graphs_then_recapture_replays_correctly(cpu):
    from vllm.config import CUDAGraphMode

    from devgraph.adapters.vllm._wrapper import DevgraphGraphWrapper

    model = AttentionModel(torch.float32)
    config = _full_config()
    wrapper = DevgraphGraphWrapper(model, config, runtime_mode=CUDAGraphMode.FULL)
    step(wrapper, model, config, CAPTURED, capture=True)
    first_pool = wrapper.graph_pool
    DevgraphGraphWrapper.clear_all_graphs()
    assert wrapper.entries == {}
    # Every graph of the pool was reset: the pool cannot be captured into again, so a fresh one is used
    # (also as the platform's global pool).
    assert wrapper.graph_pool is not first_pool and cpu.get_global_graph_pool() is wrapper.graph_pool
    step(wrapper, model, config, CAPTURED, capture=True)
    model.acc.zero_()
    step(wrapper, model, config, LATER)
    torch.testing.assert_close(model.acc, model.expected(LATER))


def test_replay_refuses_an_undescribed_step_outside_the_capture_phase(cpu):
    from vllm.config import CUDAGraphMode

    from devgraph.adapters.vllm._wrapper import DevgraphGraphWrapper

    model = AttentionModel(torch.float32)
    config = _full_config()
    wrapper = DevgraphGraphWrapper(model, config, runtime_mode=CUDAGraphMode.FULL)
    with pytest.raises(RuntimeError):  # vLLM's own guard: no capture outside its capture phase
        step(wrapper, model, config, CAPTURED, capture=False)


_LIB = None


def _opaque_attention_model():
    """The model's attention inside a Python-bodied custom op, as vLLM's opaque attention op is."""
    global _LIB
    if _LIB is None:
        _LIB = torch.library.Library("devgraph_vllm_test", "DEF")
        _LIB.define("attention(Tensor x) -> ()")

        def attention(x):
            _OPAQUE.model.__call__(_OPAQUE.model.input_ids)

        _LIB.impl("attention", attention, "CPU")
    model = AttentionModel(torch.float32)
    _OPAQUE.model = model
    return model, lambda input_ids, positions=None: torch.ops.devgraph_vllm_test.attention(input_ids)


_OPAQUE = SimpleNamespace(model=None)


def test_full_capture_sees_into_a_python_bodied_attention_op(cpu):
    # vLLM's attention runs inside a Python-bodied custom op: the capture check enters its body, so
    # devgraph's attention inside becomes an updatable task and replays with each step's lengths.
    from vllm.config import CUDAGraphMode

    from devgraph.adapters.vllm._wrapper import DevgraphGraphWrapper

    model, opaque = _opaque_attention_model()
    config = _full_config()
    wrapper = DevgraphGraphWrapper(opaque, config, runtime_mode=CUDAGraphMode.FULL)
    step(wrapper, model, config, CAPTURED, capture=True)
    (graph,) = [g for _, g in wrapper.graphs.items()]
    assert graph.tasks, "the attention inside the op was captured without a task"
    model.acc.zero_()
    step(wrapper, model, config, LATER)
    torch.testing.assert_close(model.acc, model.expected(LATER))


def test_full_capture_that_records_no_attention_task_is_refused(cpu):
    # The step's metadata carries host lengths, but no devgraph attention ran where the capture could
    # see it (an attention the platform does not route through devgraph): every replay would reuse
    # the capture-time lengths.
    from vllm.config import CUDAGraphMode

    from devgraph.adapters.vllm._wrapper import DevgraphGraphWrapper

    model = AttentionModel(torch.float32)
    config = _full_config()
    wrapper = DevgraphGraphWrapper(
        lambda input_ids, positions=None: input_ids * 2, config, runtime_mode=CUDAGraphMode.FULL
    )
    with pytest.raises(DevgraphError, match="no updatable attention task"):
        step(wrapper, model, config, CAPTURED, capture=True)
    assert wrapper.entries == {}


def _decode_steps(runner, config, steps):
    from _fake_engine import metadata
    from vllm.forward_context import set_forward_context

    for tokens, mode in steps:
        with set_forward_context(metadata([3] * tokens), config, cudagraph_runtime_mode=mode):
            assert runner._model_forward(input_ids=torch.zeros(tokens, dtype=torch.int64)) == "ran"


def _over_size_runner():
    from devgraph.adapters.vllm import _runner, reset_stats

    config = _full_config()
    config.compilation_config.max_cudagraph_capture_size = 8
    config.scheduler_config.max_num_seqs = 12
    reset_stats()
    return config, _runner.adopt_model_runner(_GpuLikeRunner(config, None))


def _eager_warnings(caplog):
    return [r.getMessage() for r in caplog.records if "decode steps ran eagerly" in r.getMessage()]


def test_decode_batches_above_the_largest_capture_size_are_counted_and_reported_once_with_numbers(
    cpu, caplog
):
    from vllm.config import CUDAGraphMode

    from devgraph.adapters.vllm import stats

    config, runner = _over_size_runner()
    none, full = CUDAGraphMode.NONE, CUDAGraphMode.FULL
    with caplog.at_level(logging.WARNING, logger="devgraph"):
        # 10 and 9 tokens are above the largest size (8): eager; 4 eager (a prefill-free step vLLM
        # chose not to replay) is not over-size; 8 and 2 replayed.
        _decode_steps(runner, config, [(2, full), (10, none), (9, none), (10, none), (4, none), (8, full)])
        assert stats()["eager.over_capture_size"] == 3
        assert _eager_warnings(caplog) == []  # a short run: reported at shutdown
        runner.devgraph_report_eager_decode()  # what the worker's shutdown() calls
        runner.devgraph_report_eager_decode()
    (message,) = _eager_warnings(caplog)
    assert message.startswith("devgraph: 3 of 5 decode steps ran eagerly")  # counted from the first
    assert "largest graph capture size 8 (batch sizes in tokens: 9 (1x), 10 (2x))" in message
    assert "capture sizes up to 12: compilation_config={'max_cudagraph_capture_size': 12}" in message
    assert "lower max_num_seqs to 8" in message


def test_over_size_eager_decode_under_load_is_reported_once_after_a_window(cpu, caplog, monkeypatch):
    from vllm.config import CUDAGraphMode

    from devgraph.adapters.vllm import _runner

    monkeypatch.setattr(_runner.EagerDecodeReport, "WINDOW", 4)
    config, runner = _over_size_runner()
    with caplog.at_level(logging.WARNING, logger="devgraph"):
        _decode_steps(runner, config, [(10, CUDAGraphMode.NONE), (4, CUDAGraphMode.FULL)] * 5)
        runner.devgraph_report_eager_decode()  # shutdown: already reported, nothing more
    (message,) = _eager_warnings(caplog)
    assert message.startswith("devgraph: 2 of 4 decode steps ran eagerly")


def test_prefill_batches_above_the_largest_capture_size_are_not_counted(cpu):
    from _fake_engine import metadata
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import set_forward_context

    from devgraph.adapters.vllm import _runner, reset_stats, stats

    config = _full_config()
    config.compilation_config.max_cudagraph_capture_size = 8
    runner = _runner.adopt_model_runner(_GpuLikeRunner(config, None))
    reset_stats()
    meta = metadata([20])
    meta["layer0"].max_query_len = 20
    with set_forward_context(meta, config, cudagraph_runtime_mode=CUDAGraphMode.NONE):
        runner._model_forward(input_ids=torch.zeros(20, dtype=torch.int64))
    assert "eager.over_capture_size" not in stats()


def test_sleep_mode_and_model_runner_v2_are_refused_at_config_time(monkeypatch):
    from devgraph.adapters.vllm._platform import _refuse_unsupported

    graphs = SimpleNamespace(cudagraph_mode=SimpleNamespace(name="FULL_AND_PIECEWISE"))
    sleepy = SimpleNamespace(model_config=SimpleNamespace(enable_sleep_mode=True), compilation_config=graphs)
    with pytest.raises(DevgraphError, match="sleep mode"):
        _refuse_unsupported(sleepy)
    v2 = SimpleNamespace(
        model_config=SimpleNamespace(enable_sleep_mode=False),
        compilation_config=graphs,
        use_v2_model_runner=True,
    )
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")  # the user's own choice: refused
    with pytest.raises(DevgraphError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        _refuse_unsupported(v2)
    v2.compilation_config = SimpleNamespace(cudagraph_mode=SimpleNamespace(name="NONE"))
    _refuse_unsupported(v2)  # no graphs: nothing of devgraph's runs


class _V2ByDefault:
    """vLLM's choice of runner as ``VllmConfig.use_v2_model_runner`` makes it: the env var, else V2."""

    model_config = SimpleNamespace(enable_sleep_mode=False)
    compilation_config = SimpleNamespace(cudagraph_mode=SimpleNamespace(name="FULL_AND_PIECEWISE"))

    @property
    def use_v2_model_runner(self):
        import os

        value = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
        return True if value is None else value == "1"


def test_model_runner_v2_chosen_by_vllm_itself_is_switched_to_v1(monkeypatch):
    import os

    from devgraph.adapters.vllm._platform import _refuse_unsupported

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "")  # recorded, so that teardown restores it
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
    _refuse_unsupported(_V2ByDefault())
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"  # inherited by the worker processes


def test_worker_name_carries_its_base_worker_across_processes():
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.worker.cpu_worker import CPUWorker

    from devgraph.adapters.vllm._worker import DevgraphWorkerMixin, worker_qualname

    cls = resolve_obj_by_qualname(worker_qualname("vllm.v1.worker.cpu_worker.CPUWorker"))
    assert cls.__mro__[1:3] == (DevgraphWorkerMixin, CPUWorker)
    assert resolve_obj_by_qualname(worker_qualname("vllm.v1.worker.cpu_worker.CPUWorker")) is cls


def test_the_device_neutral_path_uses_the_devgraph_device_of_the_platform(cpu):
    from vllm.config import CUDAGraphMode

    from devgraph.adapters.vllm._wrapper import DevgraphGraphWrapper

    wrapper = DevgraphGraphWrapper(
        AttentionModel(torch.float32), _full_config(), runtime_mode=CUDAGraphMode.FULL
    )
    assert wrapper.device is devgraph.device("cpu")


def _windowed_soft_capped_model():
    return SimpleNamespace(
        get_sliding_window=lambda: 6,
        hf_text_config=SimpleNamespace(attn_logit_softcapping=10.0),
        use_mla=False,
    )


def test_sliding_window_and_soft_cap_use_devgraph_attention_on_cpu_and_are_refused_on_npu():
    from vllm.config import CUDAGraphMode

    from devgraph.adapters.vllm._platform import (
        _devgraph_attention,
        _model_attention_limits,
        _refuse_attention_limits,
    )
    from devgraph_sim.npu import simulated_torch_npu

    config = SimpleNamespace(
        model_config=_windowed_soft_capped_model(),
        compilation_config=SimpleNamespace(cudagraph_mode=CUDAGraphMode.FULL_DECODE_ONLY),
    )
    with platform_on("cpu") as cpu:
        assert _model_attention_limits(type(cpu), config) == []
        assert _devgraph_attention(type(cpu), config)
        _refuse_attention_limits(type(cpu), config)
    # The NPU kernel declares both arguments unsupported: the platform's config check refuses the
    # model at engine start (DevgraphError naming both) rather than run another attention.
    with simulated_torch_npu(), platform_on("npu") as npu:
        limits = _model_attention_limits(type(npu), config)
        assert limits == ["sliding-window attention", "attention logit soft-capping"]
        assert not _devgraph_attention(type(npu), config)
        with pytest.raises(
            DevgraphError,
            match="this model uses sliding-window attention and attention logit soft-capping, which",
        ):
            _refuse_attention_limits(type(npu), config)
        config.compilation_config.cudagraph_mode = CUDAGraphMode.PIECEWISE
        _refuse_attention_limits(type(npu), config)  # no FULL graphs: vLLM-ascend's attention, pieces


def _bloom_like():
    """An ALiBi model's config as vLLM holds it (Bloom: ALiBi by model type)."""
    return SimpleNamespace(
        get_sliding_window=lambda: None,
        hf_text_config=SimpleNamespace(model_type="bloom"),
        use_mla=False,
    )


@pytest.mark.parametrize(
    "hf",
    [
        {"model_type": "bloom"},
        {"model_type": "mpt", "attn_config": {"alibi": True}},
        {"model_type": "falcon", "alibi": True},
        {"model_type": "jais", "position_embedding_type": "alibi"},
    ],
    ids=["bloom", "mpt", "falcon", "jais"],
)
def test_alibi_models_are_recognised_from_their_config(hf):
    from devgraph.adapters.vllm._platform import uses_alibi

    assert uses_alibi(SimpleNamespace(hf_text_config=SimpleNamespace(**hf)))
    assert not uses_alibi(SimpleNamespace(hf_text_config=SimpleNamespace(model_type="falcon", alibi=False)))


def test_alibi_runs_vllms_kernel_on_cpu_and_is_refused_at_the_config_check_on_npu_in_default_words():
    from vllm.config import CUDAGraphMode

    from devgraph.adapters.vllm._platform import (
        _attention_backend_qualname,
        _devgraph_attention,
        _refuse_attention_limits,
    )
    from devgraph_sim.npu import simulated_torch_npu

    config = SimpleNamespace(
        model_config=_bloom_like(),
        compilation_config=SimpleNamespace(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE),
    )
    with platform_on("cpu") as cpu:  # vLLM's own CPU kernel takes the ALiBi slopes
        assert _devgraph_attention(type(cpu), config)
        assert _attention_backend_qualname(type(cpu)).endswith("_cpu_attention.DevgraphCpuAttentionBackend")
        _refuse_attention_limits(type(cpu), config)
    with simulated_torch_npu(), platform_on("npu") as npu:
        assert _attention_backend_qualname(type(npu)).endswith("_attention.DevgraphAttentionBackend")
        # Refused before the model (and its weights) loads, in words for a user who chose nothing.
        with pytest.raises(DevgraphError) as refused:
            _refuse_attention_limits(type(npu), config)
        message = str(refused.value)
        assert "this model uses ALiBi position biases" in message
        assert "cudagraph_mode=FULL_AND_PIECEWISE (vLLM's default) captures FULL decode graphs" in message
        assert "compilation_config={'cudagraph_mode': 'PIECEWISE'}" in message
        config.compilation_config.cudagraph_mode = CUDAGraphMode.PIECEWISE
        _refuse_attention_limits(type(npu), config)  # the platform's own attention, in pieces


def _collections() -> int:
    import gc

    return sum(s["collections"] for s in gc.get_stats())


@pytest.mark.parametrize("app_froze", [False, True])
def test_capture_freezes_gc_without_vllms_two_full_collections(app_froze, monkeypatch):
    import gc

    from vllm import envs

    from devgraph.adapters.vllm._runner import DevgraphModelRunnerMixin

    monkeypatch.setattr(envs, "VLLM_ENABLE_CUDAGRAPH_GC", False, raising=False)
    if app_froze:
        gc.freeze()  # as vLLM and SGLang do after start-up: stays frozen
    try:
        before = _collections()
        with DevgraphModelRunnerMixin._freeze_gc():
            assert not gc.isenabled()
            assert gc.get_freeze_count() > 0
            garbage = [[] for _ in range(5000)]
            del garbage
        assert _collections() == before  # vLLM's own context collects twice (0.4 s each in an engine)
        assert gc.isenabled()
        assert (gc.get_freeze_count() > 0) == app_froze
    finally:
        gc.unfreeze()


def test_vllm_enable_cudagraph_gc_keeps_gc_on_during_capture(monkeypatch):
    import gc

    from vllm import envs

    from devgraph.adapters.vllm._runner import DevgraphModelRunnerMixin

    monkeypatch.setattr(envs, "VLLM_ENABLE_CUDAGRAPH_GC", True, raising=False)
    with DevgraphModelRunnerMixin._freeze_gc():
        assert gc.isenabled() and gc.get_freeze_count() == 0


# -- inputs at their capture addresses: checked on each graph's first replay, debug or not ----------


def _piece_step(wrapper, config, x, capture: bool = False):
    """One PIECEWISE step through ``wrapper`` with the piece's input ``x`` (pieces are called positionally)."""
    from vllm.compilation.monitor import set_cudagraph_capturing_enabled
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor, set_forward_context

    descriptor = BatchDescriptor(num_tokens=x.shape[0])
    set_cudagraph_capturing_enabled(capture)
    try:
        with set_forward_context(
            None, config, cudagraph_runtime_mode=CUDAGraphMode.PIECEWISE, batch_descriptor=descriptor
        ):
            return wrapper(x)
    finally:
        set_cudagraph_capturing_enabled(False)


@pytest.fixture
def no_debug(monkeypatch):
    """The wrapper as users run it: neither DEVGRAPH_DEBUG nor vLLM's debug logging."""
    monkeypatch.delenv("DEVGRAPH_DEBUG", raising=False)
    monkeypatch.setattr(logging.getLogger("vllm"), "level", logging.INFO)


def test_a_piece_input_that_moved_is_refused_on_the_first_replay_without_debug(cpu, no_debug):
    from vllm.config import CUDAGraphMode

    from devgraph.adapters.vllm._wrapper import DevgraphGraphWrapper

    config = _full_config()
    wrapper = DevgraphGraphWrapper(lambda x: x * 2, config, runtime_mode=CUDAGraphMode.PIECEWISE)
    assert not wrapper.debug
    x = torch.arange(4.0)
    _piece_step(wrapper, config, x, capture=True)
    new = torch.full((4,), 7.0)  # this step's data in a new tensor, not copied into the captured one
    with pytest.raises(DevgraphError) as refused:
        _piece_step(wrapper, config, new)  # the graph would return 2 * arange(4): stale, no error
    message = str(refused.value)
    assert message.startswith("PIECEWISE graph replay for BatchDescriptor(num_tokens=4")
    assert f"argument 0 (captured at {x.data_ptr():#x}, now at {new.data_ptr():#x}) moved since capture" in (
        message
    )
    assert "must write each step's data into the tensor passed at capture" in message
    assert "take that op out of splitting_ops" in message
    assert "compilation_config={'cudagraph_mode': 'NONE'}" in message
    with pytest.raises(DevgraphError, match="argument 0"):  # refused again: never marked checked
        _piece_step(wrapper, config, new)
    x.copy_(new)  # what a runner does: the step's data in the captured tensor
    torch.testing.assert_close(_piece_step(wrapper, config, x), new * 2)


def test_a_moved_input_ids_buffer_is_refused_by_name_on_a_full_graphs_first_replay(cpu, no_debug):
    from vllm.config import CUDAGraphMode

    from devgraph.adapters.vllm._wrapper import DevgraphGraphWrapper

    model = AttentionModel(torch.float32)
    config = _full_config()
    wrapper = DevgraphGraphWrapper(model, config, runtime_mode=CUDAGraphMode.FULL)
    step(wrapper, model, config, CAPTURED, capture=True)
    captured = model.input_ids
    model.input_ids = captured.clone()  # the runner's persistent buffer replaced after capture
    with pytest.raises(DevgraphError) as refused:
        step(wrapper, model, config, LATER)
    message = str(refused.value)
    assert message.startswith("FULL graph replay for BatchDescriptor(num_tokens=2, num_reqs=2, uniform=True")
    assert (
        f"input_ids (captured at {captured.data_ptr():#x}, now at {model.input_ids.data_ptr():#x})" in message
    )
    model.input_ids = captured
    model.acc.zero_()
    step(wrapper, model, config, LATER)
    torch.testing.assert_close(model.acc, model.expected(LATER))


def test_input_addresses_are_checked_once_per_captured_graph_unless_debugging(cpu, no_debug, monkeypatch):
    from vllm.config import CUDAGraphMode

    from devgraph.adapters.vllm._wrapper import DevgraphGraphWrapper

    checked = []
    original = DevgraphGraphWrapper._check_addresses

    def counting(self, descriptor, entry, now):
        checked.append(descriptor.num_tokens)
        return original(self, descriptor, entry, now)

    monkeypatch.setattr(DevgraphGraphWrapper, "_check_addresses", counting)
    config = _full_config()
    wrapper = DevgraphGraphWrapper(lambda x: x + 1, config, runtime_mode=CUDAGraphMode.PIECEWISE)
    inputs = {n: torch.zeros(n) for n in (2, 4)}
    for x in inputs.values():
        _piece_step(wrapper, config, x, capture=True)
    for _ in range(3):
        for x in inputs.values():
            _piece_step(wrapper, config, x)
    assert checked == [2, 4]  # each graph's first replay, none after
    wrapper.debug = True  # DEVGRAPH_DEBUG=1: every replay
    _piece_step(wrapper, config, inputs[2])
    assert checked == [2, 4, 2]
