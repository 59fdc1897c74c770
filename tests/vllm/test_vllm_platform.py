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
