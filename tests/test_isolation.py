"""import devgraph touches no device, survives a disabled torch_npu, and patches nothing in torch."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

import devgraph
from devgraph.testing import conformance


def _run(code: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, check=True
    ).stdout


def test_import_devgraph_imports_no_accelerator_runtime():
    out = _run(
        """
        import sys
        import devgraph
        print("torch_npu" in sys.modules, "torch" in sys.modules)
        """
    )
    assert out.split() == ["False", "False"]


def test_import_and_list_with_torch_npu_disabled():
    out = _run(
        """
        import sys
        sys.modules["torch_npu"] = None
        import devgraph
        rows = {b.name: b for b in devgraph.backends()}
        print(rows["cpu"].available, rows["npu"].available)
        print(rows["npu"].reason)
        """
    )
    first, reason = out.strip().splitlines()
    assert first == "True False"
    assert "torch_npu" in reason


def test_cuda_not_initialised_by_devgraph():
    out = _run(
        """
        import devgraph, torch
        devgraph.backends()
        d = devgraph.device("cpu")
        g = d.graph()
        x = torch.ones(3)
        with g.capture():
            y = x + 1
        g.replay()
        print(torch.cuda.is_initialized())
        """
    )
    assert out.strip() == "False"


def _snapshot(module):
    return {name: id(getattr(module, name)) for name in dir(module) if not name.startswith("__")}


def test_no_torch_cuda_attribute_changes_after_using_every_backend():
    before_cuda = _snapshot(torch.cuda)
    before_torch = {n: id(getattr(torch, n)) for n in ("cuda", "Tensor", "Stream", "Event")}
    npu_before = getattr(torch, "npu", None)
    for info in devgraph.backends():
        if info.available:
            conformance.run(devgraph.device(info.name))
    try:
        from devgraph.testing import simulated_torch_npu
    except ImportError:
        simulated_torch_npu = None
    if simulated_torch_npu is not None:
        with simulated_torch_npu():
            conformance.run(devgraph.device("npu"))
    after_cuda = _snapshot(torch.cuda)
    changed = [n for n in before_cuda if after_cuda.get(n) != before_cuda[n]]
    assert not changed, f"torch.cuda attributes replaced: {changed}"
    added = [n for n in set(after_cuda) - set(before_cuda) if not n.startswith("_")]
    assert not added, f"attributes added to torch.cuda: {added}"  # torch's own lazy private submodules aside
    assert {n: id(getattr(torch, n)) for n in before_torch} == before_torch
    assert getattr(torch, "npu", None) is npu_before
