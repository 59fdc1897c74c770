"""Plugin discovery, backend selection, and the errors around them."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import warnings

import pytest

import devgraph
from devgraph import _plugins
from devgraph.testing import conformance


def _names():
    return [b.name for b in devgraph.list_backends()]


def test_builtin_backends_are_listed(fresh_plugins):
    names = _names()
    assert names[:3] == ["cpu", "cuda", "npu"]


def test_cpu_is_available_and_accelerators_report_reasons(fresh_plugins):
    rows = {b.name: b for b in devgraph.list_backends()}
    assert rows["cpu"].available and rows["cpu"].version
    for name in ("cuda", "npu"):
        if not rows[name].available:
            assert rows[name].reason, f"{name} unavailable without a reason"


def test_builtins_register_through_the_entry_point_group():
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="devgraph")}
    assert eps["cpu"] == "devgraph.backends.cpu"
    assert eps["cuda"] == "devgraph.backends.cuda"
    assert eps["npu"] == "devgraph.backends.npu"


def test_best_device_without_accelerators_is_cpu(fresh_plugins, monkeypatch):
    monkeypatch.delenv("DEVGRAPH_BACKEND", raising=False)
    rows = {b.name: b for b in devgraph.list_backends()}
    if rows["cuda"].available or rows["npu"].available:
        pytest.skip("an accelerator is present")
    assert devgraph.device().name == "cpu"


def test_env_override_selects_backend(fresh_plugins, monkeypatch):
    monkeypatch.setenv("DEVGRAPH_BACKEND", "cpu")
    assert devgraph.device().name == "cpu"


def test_unknown_backend_lists_known_ones(fresh_plugins):
    with pytest.raises(devgraph.DevgraphError, match=r"unknown devgraph backend 'tpu'.*cpu.*cuda.*npu"):
        devgraph.device("tpu")


def test_unavailable_backend_raises_with_reason(fresh_plugins):
    rows = {b.name: b for b in devgraph.list_backends()}
    if rows["npu"].available:
        pytest.skip("npu is available here")
    with pytest.raises(devgraph.BackendUnavailable) as info:
        devgraph.device("npu")
    assert info.value.reason == rows["npu"].reason


def test_device_name_with_index(fresh_plugins):
    assert devgraph.device("cpu:0") is devgraph.device("cpu", 0)
    with pytest.raises(devgraph.DevgraphError, match="index"):
        devgraph.device("cpu", 3)


def test_third_party_backend_is_discovered_through_its_entry_point(fresh_plugins, monkeypatch):
    monkeypatch.setenv("DEVGRAPH_TOY_BACKEND", "1")
    row = {b.name: b for b in devgraph.list_backends()}["toy"]
    assert row.available and row.plugin == "toy"


def test_available_third_party_backend_wins_selection(fresh_plugins, monkeypatch):
    monkeypatch.setenv("DEVGRAPH_TOY_BACKEND", "1")
    monkeypatch.delenv("DEVGRAPH_BACKEND", raising=False)
    assert devgraph.device().name == "toy"


def test_third_party_backend_passes_conformance(fresh_plugins, monkeypatch):
    monkeypatch.setenv("DEVGRAPH_TOY_BACKEND", "1")
    assert len(conformance.run(devgraph.device("toy"))) == len(conformance.CHECKS)


def test_autoload_off_skips_third_party_plugins(fresh_plugins, monkeypatch):
    monkeypatch.setenv("DEVGRAPH_AUTOLOAD", "0")
    names = _names()
    assert "toy" not in names and "cpu" in names


def _fake_entry_points(*extra):
    real = list(importlib.metadata.entry_points(group="devgraph"))

    def entry_points(group=None, **kw):
        assert group == "devgraph"
        return real + list(extra)

    return entry_points


def test_broken_plugin_error_names_plugin_and_switch(fresh_plugins, monkeypatch):
    broken = importlib.metadata.EntryPoint("broken", "devgraph_no_such_module_xyz", "devgraph")
    monkeypatch.setattr(_plugins.importlib.metadata, "entry_points", _fake_entry_points(broken))
    with pytest.raises(
        devgraph.PluginLoadError, match=r"'broken = devgraph_no_such_module_xyz'.*DEVGRAPH_AUTOLOAD=0"
    ):
        devgraph.list_backends()


def test_broken_plugin_is_skipped_with_autoload_off(fresh_plugins, monkeypatch):
    broken = importlib.metadata.EntryPoint("broken", "devgraph_no_such_module_xyz", "devgraph")
    monkeypatch.setattr(_plugins.importlib.metadata, "entry_points", _fake_entry_points(broken))
    monkeypatch.setenv("DEVGRAPH_AUTOLOAD", "0")
    assert "cpu" in _names()


def test_ambiguous_selection_lists_candidates(fresh_plugins, monkeypatch):
    monkeypatch.delenv("DEVGRAPH_BACKEND", raising=False)
    specs = _plugins._specs()
    for name in ("twin_a", "twin_b"):
        specs[name] = (_plugins.BackendSpec(name, lambda: _plugins.Probe(True), "x:Y"), "test")
    with pytest.raises(devgraph.DevgraphError, match=r"twin_a, twin_b.*DEVGRAPH_BACKEND"):
        devgraph.device()


def test_probe_that_raises_is_reported_not_raised(fresh_plugins):
    def bad_probe():
        raise OSError("boom")

    _plugins._specs()["flaky"] = (_plugins.BackendSpec("flaky", bad_probe, "x:Y"), "test")
    row = {b.name: b for b in devgraph.list_backends()}["flaky"]
    assert not row.available and "OSError: boom" in row.reason


def test_info_cli_lists_backends():
    out = subprocess.run(
        [sys.executable, "-m", "devgraph", "info"], capture_output=True, text=True, check=True
    ).stdout
    assert "cpu" in out and "available" in out and "npu" in out and "unavailable" in out


def test_info_cli_json():
    out = subprocess.run(
        [sys.executable, "-m", "devgraph", "info", "--json"], capture_output=True, text=True, check=True
    ).stdout
    rows = {r["name"]: r for r in json.loads(out)}
    assert rows["cpu"]["available"] is True
    assert set(rows["cpu"]) == {"name", "available", "reason", "version", "plugin", "device_count"}


def test_failed_registration_is_reported_every_time(fresh_plugins, monkeypatch):
    class Twice:
        @devgraph.hookimpl
        def devgraph_register_backends(self, register):
            register(_plugins.BackendSpec("cpu", lambda: _plugins.Probe(True), "x:Y"))

    _plugins.plugin_manager().register(Twice(), name="twice")
    for _ in range(2):  # a half-built registry must not be published after the first failure
        with pytest.raises(devgraph.DevgraphError, match="registered twice"):
            devgraph.list_backends()


def test_hook_calls_are_logged_when_tracing(fresh_plugins, monkeypatch, caplog):
    monkeypatch.setenv("DEVGRAPH_TRACE_HOOKS", "1")
    with caplog.at_level("DEBUG", logger="devgraph"):
        devgraph.list_backends()
    assert any("devgraph_register_backends from plugin 'cpu'" in r.getMessage() for r in caplog.records)


def test_hook_error_names_the_plugin(fresh_plugins):
    class Broken:
        @devgraph.hookimpl
        def devgraph_register_backends(self, register):
            raise KeyError("oops")

    _plugins.plugin_manager().register(Broken(), name="broken_backend_plugin")
    with pytest.raises(devgraph.PluginLoadError, match=r"broken_backend_plugin \(registering backends\)"):
        devgraph.list_backends()


# -- devgraph.backends: the package, whose call is the deprecated name of list_backends ----------

_CALL_BACKENDS = """
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    rows = devgraph.backends()
calls.append({
    "names": [r.name for r in rows],
    "warnings": [(w.category.__name__, str(w.message), w.filename) for w in caught],
})
"""


@pytest.mark.parametrize(
    "steps",
    [
        ["call", "import devgraph.backends.cpu", "call"],  # the package binds the name after a call
        ["import devgraph.backends.cpu", "call"],  # ... or before one
        ["import devgraph.backends", "call"],
        ["from devgraph import backends as b; assert b is devgraph.backends", "call"],
    ],
)
def test_calling_devgraph_backends_warns_and_lists_in_any_import_order(steps):
    # A fresh interpreter per order: which of the package and the call comes first is the point.
    script = "import json, sys, warnings\nimport devgraph\ncalls = []\n"
    for step in steps:
        script += _CALL_BACKENDS if step == "call" else step + "\n"
    script += (
        "assert devgraph.backends is sys.modules['devgraph.backends']\n"
        "assert devgraph.backends.cpu is sys.modules['devgraph.backends.cpu']\n"
        "print(json.dumps({'calls': calls, 'listed': [r.name for r in devgraph.list_backends()]}))\n"
    )
    out = json.loads(
        subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    )
    assert len(out["calls"]) == steps.count("call")
    for call in out["calls"]:
        assert call["names"] == out["listed"]
        [(category, message, filename)] = call["warnings"]
        assert category == "DeprecationWarning"
        assert "devgraph.list_backends()" in message
        assert filename == "<string>"  # the caller's line, not devgraph's


def test_list_backends_does_not_warn(fresh_plugins):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert devgraph.list_backends()


def test_backends_is_the_package_not_a_public_name():
    import devgraph.backends

    assert devgraph.backends.__name__ == "devgraph.backends"
    assert "list_backends" in devgraph.__all__ and "backends" not in devgraph.__all__
