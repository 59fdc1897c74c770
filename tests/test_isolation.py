"""import devgraph touches no device, survives a disabled torch_npu, and patches nothing in torch;
its modules import one another in no circle and only down the layers of DESIGN.md."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch
from _import_graph import Import, circles, imported_names, imports, modules

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
        rows = {b.name: b for b in devgraph.list_backends()}
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
        devgraph.list_backends()
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
    for info in devgraph.list_backends():
        if info.available:
            conformance.run(devgraph.device(info.name))
    from devgraph_sim.npu import simulated_torch_npu

    with simulated_torch_npu():
        conformance.run(devgraph.device("npu"))
    after_cuda = _snapshot(torch.cuda)
    changed = [n for n in before_cuda if after_cuda.get(n) != before_cuda[n]]
    assert not changed, f"torch.cuda attributes replaced: {changed}"
    added = [n for n in set(after_cuda) - set(before_cuda) if not n.startswith("_")]
    assert not added, f"attributes added to torch.cuda: {added}"  # torch's own lazy private submodules aside
    assert {n: id(getattr(torch, n)) for n in before_torch} == before_torch
    assert getattr(torch, "npu", None) is npu_before


# -- the import graph (read statically: every import statement counts, see tests/_import_graph.py)

_PACKAGE_DIR = pathlib.Path(devgraph.__file__).parent


@pytest.fixture(scope="module")
def import_graph() -> list[Import]:
    return imports(_PACKAGE_DIR)


def test_the_import_graph_sees_function_level_and_type_checking_imports(import_graph):
    # Without these the circle test below could pass by not looking where circles hide.
    assert any(
        e.source == "devgraph._wrap" and e.target == "devgraph.adapters.hf" and e.lazy for e in import_graph
    )
    assert any(
        e.source == "devgraph._plugins" and e.target == "devgraph.graph" and e.type_only for e in import_graph
    )


def test_circles_are_found_through_function_level_and_type_only_imports():
    edges = [
        Import("a", "b", "a.py", 1, False, False),
        Import("b", "c", "b.py", 2, True, False),
        Import("c", "a", "c.py", 3, False, True),
        Import("c", "d", "c.py", 4, False, False),
        Import("d", "e", "d.py", 5, False, False),
    ]
    [(members, cycle)] = circles(edges)
    assert members == ["a", "b", "c"]
    assert [str(e) for e in cycle] == [
        "a -> b (a.py:1)",
        "b -> c (b.py:2, in a function)",
        "c -> a (c.py:3, TYPE_CHECKING only)",
    ]
    assert circles(edges[:2] + edges[3:]) == []


def test_devgraph_modules_import_in_no_circle(import_graph):
    found = circles(import_graph)
    if found:
        pytest.fail(
            "import circles (move the piece both modules need one layer down):\n"
            + "\n".join(
                f"  {', '.join(members)} need one another; one circle:\n    "
                + "\n    ".join(str(edge) for edge in cycle)
                for members, cycle in found
            ),
            pytrace=False,
        )


def _layer(module: str) -> str:
    """The DESIGN.md layer of a devgraph module."""
    parts = module.split(".")
    if len(parts) == 1:
        return "api"  # devgraph/__init__: the public names
    if parts[1] in ("cli", "demo", "__main__"):
        return "entry"  # the command line: an application on top of every layer, like the tests
    if parts[1].startswith("_") or parts[1] == "graph":
        return "core"  # the ground floor and the graph package: the contract and its capture semantics
    return parts[1]  # backends, ops, runner, compile, adapters, testing


#: Which layers a layer may import. Arrows point down (adapters > debug > frontend > runner > compile > ops > core);
#: backends implement the core contract and are found through plugins, so no layer imports one
#: (nor another backend: each is its own package); no layer imports devgraph.testing, which sits
#: beside the stack and may import anything. Inside the library, names come from the module that
#: defines them, not from the package ``devgraph`` (whose wrap() reaches every layer).
_MAY_IMPORT = {
    "api": {"core"},
    "core": {"core"},
    "backends": {"core", "backends"},
    "ops": {"core", "ops"},
    "runner": {"core", "ops", "compile", "runner"},
    "frontend": {"core", "ops", "compile", "runner", "frontend"},
    "compile": {"core", "ops", "compile"},
    "debug": {"core", "ops", "runner", "compile", "frontend", "debug"},
    "adapters": {"core", "ops", "runner", "compile", "frontend", "debug", "adapters", "api"},
}

#: The upward reaches DESIGN.md allows, made when called (or named for types only): wrap() builds
#: runners and hands Hugging Face models to their adapter, ``devgraph.GraphedModule`` loads the
#: runner on first use (so ``import devgraph`` stays cheap); wrap() builds its Dynamo front end
#: (``devgraph.frontend``, above the runner: it builds a runner per graph Dynamo hands it).
_LAZY_REACH = {
    ("devgraph", "devgraph.runner"),
    ("devgraph._wrap", "devgraph.frontend"),
    ("devgraph._wrap", "devgraph.runner"),
    ("devgraph._wrap", "devgraph.compile"),
    ("devgraph._wrap", "devgraph.adapters.hf"),
}


def _reaches(edge: Import) -> bool:
    return any(
        edge.source == source and (edge.target == target or edge.target.startswith(target + "."))
        for source, target in _LAZY_REACH
    )


def _backend(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "backends" and not parts[2].startswith("_") else None


def _layer_violations(edges: list[Import]) -> list[str]:
    wrong = []
    for edge in edges:
        source, target = _layer(edge.source), _layer(edge.target)
        if source in ("entry", "testing"):
            continue
        allowed = _MAY_IMPORT[source]
        if target not in allowed and not ((edge.lazy or edge.type_only) and _reaches(edge)):
            wrong.append(f"{source} imports {target}: {edge}")
        elif (
            _backend(edge.source) and _backend(edge.target) and _backend(edge.source) != _backend(edge.target)
        ):
            wrong.append(f"one backend imports another: {edge}")
    return wrong


def test_imports_point_down_the_layers(import_graph):
    wrong = _layer_violations(import_graph)
    if wrong:
        pytest.fail("imports against the layers of DESIGN.md:\n  " + "\n  ".join(wrong), pytrace=False)


@pytest.mark.parametrize(
    ("source", "target", "lazy", "why"),
    [
        ("devgraph.graph._contract", "devgraph.runner._inputs", True, "core imports runner"),
        ("devgraph._wrap", "devgraph.runner", False, "core imports runner"),  # wrap()'s reach is lazy only
        ("devgraph._wrap", "devgraph.adapters.vllm", True, "core imports adapters"),
        ("devgraph.backends.cpu._device", "devgraph.ops._registry", True, "backends imports ops"),
        (
            "devgraph.backends.npu._device",
            "devgraph.backends.cpu._pool",
            False,
            "one backend imports another",
        ),
        ("devgraph.compile._trace", "devgraph.runner._calls", True, "compile imports runner"),
        ("devgraph.compile", "devgraph.runner._runner", True, "compile imports runner"),
        ("devgraph.compile", "devgraph.runner._pieces", False, "compile imports runner"),
        ("devgraph.ops._defs", "devgraph.backends.cpu", False, "ops imports backends"),
        ("devgraph.compile._trace", "devgraph", True, "compile imports api"),
        ("devgraph.adapters.hf", "devgraph.testing.models", True, "adapters imports testing"),
    ],
)
def test_the_layer_check_refuses_an_upward_import(source, target, lazy, why):
    assert [w.split(":")[0] for w in _layer_violations([Import(source, target, "x.py", 1, lazy, False)])] == [
        why
    ]


def test_the_compiler_loads_without_the_runner():
    # The runner uses the compiler, never the reverse (DESIGN.md, "Layers"): devgraph.compile
    # neither loads the runner nor answers for its names (they are devgraph.runner's).
    out = _run(
        """
        import sys
        import devgraph.compile
        print(any(m.startswith("devgraph.runner") for m in sys.modules))
        print(any(hasattr(devgraph.compile, n) for n in ("PiecewiseRunner", "PiecewiseStats", "piecewise_runner")))
        print(any(m.startswith("devgraph.runner") for m in sys.modules))
        """
    )
    assert out.split() == ["False", "False", "False"]


def test_compile_modules_import_no_runner_module(import_graph):
    reach = [
        e for e in import_graph if e.source.startswith("devgraph.compile") and _layer(e.target) == "runner"
    ]
    assert [(e.source, e.target, e.lazy) for e in reach] == []


def test_the_package_imports_none_of_its_test_doubles():
    """The torch_npu simulator and the accelerator stand-in live with the tests (tests/sim), not in
    the wheel: no module of devgraph imports them, at any level (demo and testing/ included)."""
    root = pathlib.Path(devgraph.__file__).parent
    offenders = [
        f"{path.relative_to(root.parent)}:{line}: import {name}"
        for path in sorted(root.rglob("*.py"))
        for name, line in imported_names(path)
        if name.split(".")[0] in ("devgraph_sim", "devgraph_toy_backend")
    ]
    assert not offenders, offenders
    assert not (root / "testing" / "npu_sim").exists()


def test_the_test_double_check_sees_an_import(tmp_path):
    bad = tmp_path / "m.py"
    bad.write_text("def f():\n    from devgraph_sim.npu import simulated_torch_npu\n")
    assert imported_names(bad) == [("devgraph_sim.npu", 2)]


def _private_owner(module: str) -> str | None:
    """The package whose private module ``module`` is (``devgraph.graph`` for
    ``devgraph.graph._tasks``), or None when every component of its name is public."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_"):
            return ".".join(parts[:i])
    return None


def _face_violations(edges: list[Import], packages: set[str]) -> list[str]:
    """Imports of another package's private module: a module may import the private modules of
    its own package and of the packages it sits in (``devgraph._errors`` is the ground floor of
    every package), and otherwise only faces (``__init__`` exports)."""
    bad = []
    for edge in edges:
        owner = _private_owner(edge.target)
        if owner is None:
            continue
        here = edge.source if edge.source in packages else edge.source.rpartition(".")[0]
        if here != owner and not here.startswith(owner + "."):
            bad.append(f"{edge} (import it from {owner}'s face)")
    return bad


def test_packages_meet_only_at_their_faces(import_graph):
    packages = {name for name, path in modules(_PACKAGE_DIR).items() if path.name == "__init__.py"}
    bad = _face_violations(import_graph, packages)
    if bad:
        pytest.fail(
            "a module imports another package's private module (export the name from that package's "
            "__init__ and import it from there):\n  " + "\n  ".join(bad),
            pytrace=False,
        )


@pytest.mark.parametrize(
    "source, target, ok",
    [
        ("devgraph.runner._runner", "devgraph.graph._contract", False),  # another package's room
        ("devgraph.runner._runner", "devgraph.runner._calls", True),  # its own package's room
        ("devgraph.backends.cpu._device", "devgraph.backends._reference", True),  # its parent's room
        ("devgraph.backends.cpu._device", "devgraph.backends.npu._device", False),  # a sibling's room
        ("devgraph.graph._contract", "devgraph._errors", True),  # the ground floor
        ("devgraph.adapters.hf", "devgraph.runner._weights", False),  # a package face reaching in
    ],
)
def test_the_face_check_refuses_a_reach_into_another_package(source, target, ok):
    packages = {"devgraph", "devgraph.runner", "devgraph.graph", "devgraph.backends", "devgraph.adapters.hf"}
    edge = Import(source, target, "x.py", 1, False, False)
    assert (_face_violations([edge], packages) == []) is ok


def test_the_toy_plugin_uses_public_names_only():
    toy = pathlib.Path(__file__).parent / "plugins" / "devgraph_toy_backend"
    reached = [
        f"{path.relative_to(toy)}:{line} imports {name}"
        for path in sorted(toy.rglob("*.py"))
        for name, line in imported_names(path)
        if name.startswith("devgraph.") and _private_owner(name) is not None
    ]
    assert reached == [], "a third-party backend must need no private devgraph module"
