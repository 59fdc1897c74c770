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
