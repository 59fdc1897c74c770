"""The vLLM platform plugin's switch (runs without vLLM: the entry point must stay cheap and inert)."""

from __future__ import annotations

import importlib.metadata

from devgraph.adapters.vllm import _plugin


def test_plugin_is_inert_without_the_switch(monkeypatch):
    monkeypatch.delenv("DEVGRAPH_VLLM", raising=False)
    assert _plugin.register() is None


def test_plugin_is_inert_when_the_switch_is_off(monkeypatch):
    monkeypatch.setenv("DEVGRAPH_VLLM", "0")
    assert _plugin.register() is None


def test_plugin_names_the_devgraph_platform_when_switched_on(monkeypatch):
    monkeypatch.setenv("DEVGRAPH_VLLM", "1")
    assert _plugin.register() == "devgraph.adapters.vllm._platform.DevgraphPlatform"


def test_unrecognised_switch_value_activates_the_platform_so_it_can_refuse(monkeypatch):
    # vLLM swallows errors raised by plugin functions, so the platform reports it at engine start.
    monkeypatch.setenv("DEVGRAPH_VLLM", "maybe")
    assert _plugin.register() is not None
    assert "DEVGRAPH_VLLM='maybe'" in _plugin.switch_value_error()


def test_entry_point_is_registered_in_vllms_platform_plugin_group():
    eps = importlib.metadata.entry_points(group="vllm.platform_plugins")
    assert {ep.name: ep.value for ep in eps}.get("devgraph") == "devgraph.adapters.vllm._plugin:register"


class _Dist:
    def __init__(self, name):
        self.name = name


class _EP:
    def __init__(self, name, dist, calls=None):
        self.name, self.dist, self.value = name, _Dist(dist), f"{dist}:{name}"
        self.calls = calls

    def load(self):
        return lambda: self.calls.append(self.name)


def _fake_entry_points(calls):
    groups = {
        "vllm.platform_plugins": [_EP("devgraph", "devgraph"), _EP("ascend", "vllm-ascend")],
        "vllm.general_plugins": [
            _EP("devgraph", "devgraph", calls),
            _EP("ascend_model", "vllm-ascend", calls),
            _EP("ascend_kv_connector", "vllm-ascend", calls),
            _EP("lora_resolver", "someone-else", calls),
        ],
    }
    return lambda group: groups[group]


def test_general_plugins_of_the_platform_package_vllm_plugins_displaced_still_run(monkeypatch):
    # VLLM_PLUGINS=devgraph picks devgraph's platform over vllm-ascend's, and would drop vllm-ascend's
    # general plugins with it: devgraph's general plugin runs them (and nothing else).
    monkeypatch.setenv("DEVGRAPH_VLLM", "1")
    monkeypatch.setenv("VLLM_PLUGINS", "devgraph")
    calls = []
    assert _plugin.load_general_plugins(_fake_entry_points(calls)) == ["ascend_model", "ascend_kv_connector"]
    assert calls == ["ascend_model", "ascend_kv_connector"]


def test_general_plugins_the_list_keeps_are_left_to_vllm(monkeypatch):
    monkeypatch.setenv("DEVGRAPH_VLLM", "1")
    monkeypatch.setenv("VLLM_PLUGINS", "devgraph,ascend_model")
    calls = []
    assert _plugin.load_general_plugins(_fake_entry_points(calls)) == ["ascend_kv_connector"]


def test_general_plugin_does_nothing_without_the_switch_or_without_a_plugin_list(monkeypatch):
    calls = []
    monkeypatch.setenv("VLLM_PLUGINS", "devgraph")
    monkeypatch.delenv("DEVGRAPH_VLLM", raising=False)
    assert _plugin.load_general_plugins(_fake_entry_points(calls)) == []
    monkeypatch.setenv("DEVGRAPH_VLLM", "1")
    monkeypatch.delenv("VLLM_PLUGINS")  # vLLM loads every plugin itself
    assert _plugin.load_general_plugins(_fake_entry_points(calls)) == []
    assert calls == []


def test_general_plugin_entry_point_is_declared():
    from pathlib import Path

    import tomllib

    project = tomllib.loads((Path(__file__).parents[3] / "pyproject.toml").read_text())["project"]
    general = project["entry-points"]["vllm.general_plugins"]
    assert general["devgraph"] == "devgraph.adapters.vllm._plugin:load_general_plugins"


def test_bad_switch_value_is_quoted_as_given(monkeypatch):
    monkeypatch.setenv("DEVGRAPH_VLLM", " Maybe")
    problem = _plugin.switch_value_error()
    assert problem.startswith("DEVGRAPH_VLLM=' Maybe' is not understood")
    assert "set DEVGRAPH_VLLM=1" in problem and "unset DEVGRAPH_VLLM" in problem
    monkeypatch.setenv("DEVGRAPH_VLLM", " Yes ")  # understood: no problem, quoted as given in messages
    assert _plugin.switch_value_error() is None
    assert _plugin.switch_setting() == "DEVGRAPH_VLLM=' Yes '"


class _PlatformEP:
    def __init__(self, name, answer):
        self.name, self.answer = name, answer

    def load(self):
        def activate():
            if isinstance(self.answer, Exception):
                raise self.answer
            return self.answer

        return activate


def _platform_eps(group):
    assert group == "vllm.platform_plugins"
    return [
        _PlatformEP("devgraph", "devgraph.adapters.vllm._platform.DevgraphPlatform"),
        _PlatformEP("ascend", "vllm_ascend.platform.NPUPlatform"),
        _PlatformEP("absent", None),  # its hardware is not here
        _PlatformEP("broken", RuntimeError("no driver")),  # vLLM treats a failure as inactive
    ]


def test_other_active_platform_plugins_are_found_as_vllm_will_find_them(monkeypatch):
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    assert _plugin.other_active_platforms(_platform_eps) == ["ascend"]
    monkeypatch.setenv("VLLM_PLUGINS", "devgraph")  # the fix: vLLM then asks devgraph's only
    assert _plugin.other_active_platforms(_platform_eps) == []


def test_a_second_active_platform_plugin_is_named_with_the_fix_before_vllm_refuses(monkeypatch, caplog):
    monkeypatch.setenv("DEVGRAPH_VLLM", "1")
    monkeypatch.setattr(_plugin, "other_active_platforms", lambda: ["ascend"])
    with caplog.at_level("ERROR", logger="devgraph"):
        assert _plugin.register() == _plugin.PLATFORM_QUALNAME  # still active: vLLM decides
    (record,) = caplog.records
    assert "VLLM_PLUGINS=devgraph" in record.getMessage() and "'ascend'" in record.getMessage()
    assert "Only one platform plugin can be activated" in record.getMessage()
    caplog.clear()
    monkeypatch.setattr(_plugin, "other_active_platforms", lambda: [])
    _plugin.register()
    assert not caplog.records
