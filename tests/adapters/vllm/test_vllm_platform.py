"""The devgraph vLLM platform plugin: inert without the switch, loud when its setting is broken."""

from __future__ import annotations

import pytest
from _engine import HERE, engine_env, run_python

PLATFORM_MRO = (
    "from vllm.platforms import current_platform as p; "
    "print(' '.join(c.__module__ + '.' + c.__qualname__ for c in type(p).__mro__))"
)


def test_without_switch_vllm_uses_its_own_platform_class():
    plain = run_python(["-c", PLATFORM_MRO], engine_env(devgraph=False))
    assert plain.returncode == 0, plain.stderr
    mro = plain.stdout.split()
    assert mro[0] == "vllm.platforms.cpu.CpuPlatform"
    assert not any("devgraph" in c for c in mro)


def test_switch_subclasses_the_platform_vllm_would_use():
    switched = run_python(["-c", PLATFORM_MRO], engine_env(devgraph=True))
    assert switched.returncode == 0, switched.stderr
    mro = switched.stdout.split()
    assert mro[0] == "devgraph.adapters.vllm._platform.DevgraphPlatform"
    assert "vllm.platforms.cpu.CpuPlatform" in mro


@pytest.mark.parametrize(
    "setting",
    [{"DEVGRAPH_BACKEND": "cuda"}, {"DEVGRAPH_VLLM": "maybe"}],
    ids=["unavailable-device", "bad-switch-value"],
)
def test_broken_setting_fails_at_engine_start_naming_the_switch(tiny_model, tmp_path, setting):
    env = engine_env(devgraph=True, **setting)
    proc = run_python(
        [str(HERE / "_run_engine.py"), str(tiny_model), "PIECEWISE", str(tmp_path / "o.json")], env
    )
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("devgraph._errors.DevgraphError"), proc.stderr[-3000:]
    assert "DEVGRAPH_VLLM" in last
    if "DEVGRAPH_BACKEND" in setting:
        assert "DEVGRAPH_BACKEND" in last
    else:  # the value quoted as given, and only the switch's own remedies
        assert "DEVGRAPH_VLLM='maybe' is not understood" in last
        assert "DEVGRAPH_VLLM=1 asks" not in last and "DEVGRAPH_BACKEND" not in last


def _second_platform_package(tmp_path):
    """A site directory with a fake platform package (a platform plugin and a general plugin), as
    vllm-ascend is, plus devgraph's general-plugin entry point as ``pip install devgraph`` declares it."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "fakeaccel.py").write_text(
        "import os\n"
        "def register():\n    return 'vllm.platforms.cpu.CpuPlatform'\n"
        "def register_models():\n    os.environ['FAKEACCEL_GENERAL_PLUGIN_RAN'] = '1'\n"
    )
    for dist, entry_points in (
        (
            "fakeaccel",
            "[vllm.platform_plugins]\nfakeaccel = fakeaccel:register\n\n"
            "[vllm.general_plugins]\nfakeaccel_models = fakeaccel:register_models\n",
        ),
        (
            "devgraph_general_plugin",
            "[vllm.general_plugins]\ndevgraph = devgraph.adapters.vllm._plugin:load_general_plugins\n",
        ),
    ):
        info = site / f"{dist}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(entry_points)
    return site


PLATFORM_AND_GENERAL_PLUGINS = (
    "import os; from vllm.platforms import current_platform as p; "
    "from vllm.plugins import load_general_plugins; load_general_plugins(); "
    "print(type(p).__mro__[0].__module__, os.environ.get('FAKEACCEL_GENERAL_PLUGIN_RAN'))"
)


def test_second_platform_plugin_coexists_through_vllm_plugins_keeping_its_general_plugins(tmp_path):
    import os

    site = _second_platform_package(tmp_path)
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    both = run_python(["-c", PLATFORM_AND_GENERAL_PLUGINS], engine_env(devgraph=True, PYTHONPATH=path))
    assert both.returncode != 0 and "Only one platform plugin can be activated" in both.stderr
    # devgraph names the fix first, and the package that activated too.
    fix = both.stderr.find("Set VLLM_PLUGINS=devgraph")
    assert -1 < fix < both.stderr.find("Only one platform plugin can be activated, but"), both.stderr[-3000:]
    assert "'fakeaccel'" in both.stderr
    switched = run_python(
        ["-c", PLATFORM_AND_GENERAL_PLUGINS],
        engine_env(devgraph=True, PYTHONPATH=path, VLLM_PLUGINS="devgraph"),
    )
    assert switched.returncode == 0, switched.stderr[-3000:]
    # devgraph's platform is the active one, and the displaced package's general plugin still ran.
    assert switched.stdout.split()[-2:] == ["devgraph.adapters.vllm._platform", "1"]


# -- the platform's config check on vLLM's own VllmConfig (built on a devgraph CPU platform) ----------


@pytest.fixture
def cpu_platform():
    import os

    from _fake_engine import platform_on

    saved = dict(os.environ)  # vLLM's config resolution sets process-wide variables
    try:
        with platform_on("cpu") as platform:
            yield platform
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _vllm_config(model, *, enforce_eager=False, cudagraph_mode=None, kv_cache_dtype="auto"):
    """vLLM's VllmConfig for the tiny model: building it runs the current platform's config check."""
    from vllm.config import CacheConfig, CompilationConfig, ModelConfig, VllmConfig

    compilation = (
        CompilationConfig() if cudagraph_mode is None else CompilationConfig(cudagraph_mode=cudagraph_mode)
    )
    return VllmConfig(
        model_config=ModelConfig(
            model=str(model), dtype="float32", max_model_len=128, enforce_eager=enforce_eager
        ),
        cache_config=CacheConfig(cache_dtype=kv_cache_dtype),
        compilation_config=compilation,
    )


def _enforce_eager_warnings(caplog):
    return [r.getMessage() for r in caplog.records if "enforce_eager=True turns" in r.getMessage()]


def test_enforce_eager_is_said_once_naming_what_to_set(cpu_platform, tiny_model, caplog, monkeypatch):
    import logging

    from devgraph.adapters.vllm import _platform

    monkeypatch.setattr(_platform, "_said_enforce_eager", False)
    with caplog.at_level(logging.WARNING, logger="devgraph"):
        assert _vllm_config(tiny_model).compilation_config.cudagraph_mode.name != "NONE"
        assert _enforce_eager_warnings(caplog) == []  # graphs on: nothing to say
        for _ in range(2):
            config = _vllm_config(tiny_model, enforce_eager=True)
            assert config.compilation_config.cudagraph_mode.name == "NONE"
    (message,) = _enforce_eager_warnings(caplog)
    assert "DEVGRAPH_VLLM=1 captures no devgraph graphs: every step runs eagerly" in message
    assert "drop enforce_eager=True" in message and "unset DEVGRAPH_VLLM" in message


@pytest.mark.parametrize(
    ("mode", "kv_cache_dtype"),
    [(None, "fp8"), ("FULL", "fp8_e4m3"), ("FULL_DECODE_ONLY", "fp8_e5m2")],
    ids=["default-fp8", "full-fp8_e4m3", "full_decode_only-fp8_e5m2"],
)
def test_fp8_kv_cache_with_full_graphs_is_refused_at_the_config_check(
    cpu_platform, tiny_model, mode, kv_cache_dtype
):
    from devgraph._errors import DevgraphError

    with pytest.raises(DevgraphError) as refused:
        _vllm_config(tiny_model, cudagraph_mode=mode, kv_cache_dtype=kv_cache_dtype)
    message = str(refused.value)
    shown = "FULL_AND_PIECEWISE (vLLM's default)" if mode is None else mode
    assert (
        f"kv_cache_dtype={kv_cache_dtype!r} with cudagraph_mode={shown}: on devgraph device 'cpu'" in message
    )
    assert "which keeps the KV cache unquantised" in message
    assert "Pass kv_cache_dtype='auto', or compilation_config={'cudagraph_mode': 'PIECEWISE'}" in message


def test_fp8_kv_cache_with_piecewise_graphs_passes_the_config_check(cpu_platform, tiny_model):
    config = _vllm_config(tiny_model, cudagraph_mode="PIECEWISE", kv_cache_dtype="fp8")
    assert config.compilation_config.cudagraph_mode.name == "PIECEWISE"
    assert config.cache_config.cache_dtype == "fp8"
    # An unquantised cache keeps FULL graphs (lowered to FULL_DECODE_ONLY on the CPU reference).
    assert (
        _vllm_config(tiny_model, kv_cache_dtype="auto").compilation_config.cudagraph_mode.name
        == "FULL_DECODE_ONLY"
    )


def test_devgraphs_own_attention_takes_only_the_models_dtype_for_its_cache_with_full_graphs():
    # On NPU FULL graphs run devgraph's attention backend (its cache is the model's dtype).
    from types import SimpleNamespace

    from _fake_engine import platform_on
    from vllm.config import CUDAGraphMode

    from devgraph._errors import DevgraphError
    from devgraph.adapters.vllm._platform import _refuse_kv_cache_dtype
    from devgraph_sim.npu import simulated_torch_npu

    def config(mode, dtype):
        return SimpleNamespace(
            model_config=SimpleNamespace(get_sliding_window=lambda: None, hf_text_config=None, use_mla=False),
            compilation_config=SimpleNamespace(cudagraph_mode=mode),
            cache_config=SimpleNamespace(cache_dtype=dtype),
        )

    with simulated_torch_npu(), platform_on("npu") as npu:
        with pytest.raises(
            DevgraphError, match="kv_cache_dtype='bfloat16' with cudagraph_mode=FULL_DECODE_ONLY"
        ):
            _refuse_kv_cache_dtype(type(npu), config(CUDAGraphMode.FULL_DECODE_ONLY, "bfloat16"))
        with pytest.raises(DevgraphError, match="in the model's dtype"):
            _refuse_kv_cache_dtype(type(npu), config(CUDAGraphMode.FULL, "fp8"))
        _refuse_kv_cache_dtype(type(npu), config(CUDAGraphMode.FULL, "auto"))
        _refuse_kv_cache_dtype(type(npu), config(CUDAGraphMode.PIECEWISE, "fp8"))  # the platform's attention
