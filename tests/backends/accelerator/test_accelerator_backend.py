"""The generic ``accelerator`` backend over torch.accelerator.Graph, tested on a stand-in (no XPU here).

The stand-in (devgraph_sim.accelerator) must follow torch 2.13's Python API exactly; the
first tests check that against torch itself (the Graph class and module functions by ``inspect``,
``torch.Stream`` / ``torch.Event`` by torch's own stubs, ``torch/_C/__init__.pyi``). On a torch without
``torch.accelerator.Graph`` (before 2.12: no ``Graph``, no ``Stream.is_capturing``) those comparisons
skip by capability, saying what is missing; the backend's own tests run on the stand-in everywhere.
"""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import devgraph
from devgraph import DevgraphError
from devgraph.backends import accelerator as accelerator_plugin
from devgraph.backends.accelerator._device import AcceleratorDevice
from devgraph_sim import accelerator as accelerator_standin
from devgraph_sim.accelerator import standin_accelerator

#: torch.accelerator.Graph and the API that came with it (Stream.is_capturing...): torch 2.12+.
HAS_GRAPH = hasattr(torch.accelerator, "Graph")
needs_accelerator_graph = pytest.mark.skipif(
    not HAS_GRAPH,
    reason=f"torch {torch.__version__} has no torch.accelerator.Graph (torch 2.12+): nothing to compare the "
    "stand-in with",
)


@pytest.fixture
def api():
    with standin_accelerator(hang_timeout=0.5) as api:
        yield api


@pytest.fixture
def acc(api):
    return AcceleratorDevice(0, api=api)


def _params(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


# -- the stand-in follows torch's Python API ----------------------------------------------------------


@needs_accelerator_graph
@pytest.mark.parametrize(
    "method",
    ["__new__", "__init__", "capture_begin", "capture_end", "instantiate", "replay", "reset", "pool",
     "enable_debug_mode", "debug_dump", "__enter__", "__exit__"],
)  # fmt: skip
def test_standin_graph_has_torchs_signatures(method):
    assert _params(getattr(accelerator_standin.Graph, method)) == _params(
        getattr(torch.accelerator.Graph, method)
    )


@pytest.mark.parametrize("name", [n for n in accelerator_standin._ACCELERATOR_NAMES if n != "Graph"])
def test_standin_functions_have_torchs_signatures(name):
    if not hasattr(torch.accelerator, name):
        pytest.skip(
            f"torch {torch.__version__} has no torch.accelerator.{name}: the stand-in follows torch 2.13"
        )
    assert _params(getattr(accelerator_standin, name)) == _params(getattr(torch.accelerator, name))


def _stub_methods(cls_name):
    stub = Path(torch.__file__).parent / "_C" / "__init__.pyi"
    tree = ast.parse(stub.read_text(encoding="utf-8"))
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name]
    methods = {}
    for fn in cls.body:
        if isinstance(fn, ast.FunctionDef) and fn.name not in methods:  # Stream.__new__: the first overload
            args = fn.args
            methods[fn.name] = (
                [a.arg for a in args.posonlyargs + args.args][1:],
                [a.arg for a in args.kwonlyargs],
                [ast.literal_eval(d) for d in args.kw_defaults],
            )
    return methods


@pytest.mark.parametrize("cls_name", ["Stream", "Event"])
def test_standin_stream_and_event_have_torchs_signatures(cls_name):
    stub = _stub_methods(cls_name)
    cls = getattr(accelerator_standin, cls_name)
    if not HAS_GRAPH:  # an older torch: compare only what it has, and say what it lacks
        newer = sorted(
            n for n, fn in vars(cls).items() if callable(fn) and not n.startswith("_") and n not in stub
        )
        if newer:
            pytest.skip(
                f"torch {torch.__version__}'s {cls_name} has no {', '.join(newer)} (torch 2.12+, with "
                "torch.accelerator.Graph): the stand-in follows torch 2.13"
            )
    for name, fn in vars(cls).items():
        if name.startswith("_") and name not in ("__enter__", "__exit__", "__eq__", "__hash__", "__init__"):
            continue
        if not callable(fn):
            continue
        sig = inspect.signature(fn)
        pos = [p.name for p in sig.parameters.values() if p.kind <= p.POSITIONAL_OR_KEYWORD][1:]
        kw = [p for p in sig.parameters.values() if p.kind == p.KEYWORD_ONLY and not p.name.startswith("_")]
        want = stub["__new__" if name == "__init__" else name]
        assert (pos, [p.name for p in kw], [p.default for p in kw]) == want, f"{cls_name}.{name}"


# -- the backend on the stand-in --------------------------------------------------------------------------


def test_the_backend_drives_the_standin(acc, api):
    assert acc.torch_device == torch.device("cpu") and acc.dispatch_key == "CPU"
    x = torch.ones(4)
    graph = acc.graph()
    with graph.capture():
        y = x * 3
    x.fill_(2)
    graph.replay()
    acc.synchronize()
    assert torch.equal(y, torch.full((4,), 6.0))
    assert acc.memory_stats().reserved > 0  # the capture allocated y in the graph's pool


def test_graphs_of_one_pool_share_torchs_pool_id(acc):
    pool = acc.pool()
    x = torch.ones(4)
    first, second = acc.graph(), acc.graph()
    assert pool.id is None  # torch's id comes with the first capture into the pool
    with first.capture(pool=pool):
        x + 1
    assert pool.id == pool.handle == first.native.pool() and isinstance(pool.id, tuple)
    with second.capture(pool=pool):
        x + 2
    assert second.native.pool() == first.native.pool()


def test_capture_error_mode_reaches_torchs_graph(acc):
    graph = acc.graph()
    with graph.capture(capture_error_mode="relaxed"):
        torch.ones(2) + 1
    assert graph.native.capture_error_mode == "relaxed"
    with pytest.raises(DevgraphError, match="capture_error_mode 'loose'"):
        with acc.graph().capture(capture_error_mode="loose"):
            pass


def test_debug_dump_through_the_contract(acc, tmp_path):
    graph = acc.graph()
    graph.enable_debug_mode()
    with graph.capture():
        torch.ones(2).mul(3)
    graph.debug_dump(tmp_path / "graph.txt")
    assert "mul" in (tmp_path / "graph.txt").read_text()
    with pytest.raises(DevgraphError, match="needs a captured graph"):
        acc.graph().debug_dump(tmp_path / "none.txt")


def test_pools_without_a_torch_id_say_none():
    assert devgraph.device("cpu").pool().id is None


def test_backends_without_a_dump_say_so(tmp_path):
    graph = devgraph.device("cpu").graph()
    with pytest.raises(DevgraphError, match="no debug dump"):
        graph.enable_debug_mode()


def test_task_update_is_refused_not_ignored(acc):
    x, out = torch.ones(4), torch.zeros(4)
    graph = acc.graph()
    with graph.capture():
        with graph.task_group() as group:
            torch.mul(x, 2, out=out)
    with pytest.raises(DevgraphError, match="no task update"):
        with graph.task_update(group):
            torch.mul(x, 3, out=out)
    assert acc.updatable_ops == ()


# -- registration, selection, devgraph info ------------------------------------------------------------


def test_registered_through_the_entry_point_group_in_pyproject():
    import tomllib

    pyproject = tomllib.loads((Path(__file__).parents[3] / "pyproject.toml").read_text(encoding="utf-8"))
    assert pyproject["project"]["entry-points"]["devgraph"]["accelerator"] == "devgraph.backends.accelerator"


def test_probe_here_reports_why_not(fresh_plugins):
    if not HAS_GRAPH:
        why = "has no torch.accelerator.Graph"
    elif torch.accelerator.current_accelerator() is None:
        why = "no accelerator visible"  # CPU-only torch (CI)
    else:
        why = "has devgraph's own backend"  # a CUDA GPU: the dedicated backend serves it
    rows = {b.name: b for b in devgraph.list_backends()}
    row = rows["accelerator"]
    assert not row.available and why in row.reason


def test_devgraph_info_shows_the_backend():
    done = subprocess.run(
        [sys.executable, "-m", "devgraph", "info"], capture_output=True, text=True, timeout=120, check=True
    )
    assert "accelerator" in done.stdout


def _pretend_an_xpu(monkeypatch, api):
    """An XPU with a graph implementation, as the probe would find one (the device is the stand-in)."""
    from devgraph.backends.accelerator import _device

    monkeypatch.setattr(accelerator_plugin, "_accelerator", lambda: (torch, "xpu", ""))
    monkeypatch.setattr(torch.accelerator, "Graph", lambda *a, **k: None, raising=False)  # torch < 2.12: none
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 1)
    monkeypatch.setattr(_device, "torch_api", lambda: api)


def test_an_xpu_resolves_to_the_accelerator_backend(fresh_plugins, monkeypatch, api):
    _pretend_an_xpu(monkeypatch, api)
    device = devgraph.device("xpu")
    assert device.name == "accelerator" and devgraph.device(torch.device("xpu", 0)) is device
    monkeypatch.delenv("DEVGRAPH_BACKEND", raising=False)
    assert devgraph.device() is device  # no dedicated accelerator backend available: this one


def test_dedicated_backends_keep_their_devices(fresh_plugins, monkeypatch):
    monkeypatch.setattr(accelerator_plugin, "_accelerator", lambda: (torch, "cuda", ""))
    probe = accelerator_plugin.probe()
    assert not probe.available and "devgraph.device('cuda')" in probe.reason
    assert accelerator_plugin.device_types() == ()


def test_a_device_without_a_graph_implementation_is_unavailable(fresh_plugins, monkeypatch):
    def no_impl(*args, **kwargs):
        raise RuntimeError("Graph is not supported on xpu")

    monkeypatch.setattr(accelerator_plugin, "_accelerator", lambda: (torch, "xpu", ""))
    monkeypatch.setattr(torch.accelerator, "Graph", no_impl, raising=False)
    with pytest.raises(devgraph.BackendUnavailable, match=r"registers no torch\.accelerator\.Graph"):
        devgraph.device("xpu")
