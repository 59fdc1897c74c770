"""The documentation runs: every Python block of README.md and docs/, and the reference pages are complete.

Each page's ```python blocks run in order in one namespace, as a reader would paste them. A block that
needs what the test environment lacks (an engine, an accelerator) is preceded by an HTML comment
``<!-- skip: needs ... -->``; those are listed in ``EXPECTED_SKIPS``, so a new one is a decision made
here, not a silent gap. The troubleshooting page must name every fallback reason the package counts,
and the options page every ``DEVGRAPH_*`` variable it reads and every option field.
"""

from __future__ import annotations

import ast
import re
import warnings
from pathlib import Path

import attrs
import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PACKAGE = ROOT / "devgraph"

#: (page, reason) of every block that does not run here; the reason names where it does run.
EXPECTED_SKIPS = [
    ("docs/sglang.md", "needs SGLang and a model directory"),
    ("docs/sglang.md", "needs SGLang and a model directory"),  # the prefill graphs' switch
    ("docs/vllm.md", "needs vLLM"),
]

_FENCE = re.compile(r"^```(\w*)\s*$")
_SKIP = re.compile(r"<!--\s*skip:\s*(.*?)\s*-->")


def _blocks(page: Path) -> list[tuple[int, str, str | None]]:
    """``(line, code, skip reason or None)`` of each ```python block of ``page``."""
    lines = page.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = i + 1
        while not lines[end].startswith("```"):
            end += 1
        if m.group(1) == "python":
            skip, j = None, i - 1
            while j >= 0 and lines[j].strip().startswith("<!--"):  # the comments right above the fence
                found = _SKIP.search(lines[j])
                skip = skip or (found.group(1) if found else None)
                j -= 1
            blocks.append((i + 1, "\n".join(lines[i + 1 : end]) + "\n", skip))
        i = end + 1
    return blocks


def _rel(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


PAGES_WITH_CODE = [p for p in PAGES if any(skip is None for _, _, skip in _blocks(p))]


@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=_rel)
def test_python_blocks_of_page_run(page):
    namespace = {"__name__": f"docs:{_rel(page)}"}
    try:
        for line, code, skip in _blocks(page):
            if skip is not None:
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the pages' own warnings (e.g. a one-time fallback) are fine
                exec(compile(code, f"{_rel(page)}:{line}", "exec"), namespace)
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():  # a page that failed before its own clean-up
            dist.destroy_process_group()


@pytest.mark.parametrize("line", [line for line, _, skip in _blocks(ROOT / "README.md") if skip is None])
def test_each_python_block_of_the_readme_runs_alone(line):
    # A reader copies one block of the landing page, not the page: the Hugging Face block once raised
    # NameError for the torch and devgraph the quickstart above it had imported.
    code = next(code for at, code, _ in _blocks(ROOT / "README.md") if at == line)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(code, f"README.md:{line}", "exec"), {"__name__": "docs:README.md:alone"})


def test_skipped_blocks_are_the_expected_few_and_name_a_reason():
    skipped = sorted(
        (_rel(page), reason) for page in PAGES for _, _, reason in _blocks(page) if reason is not None
    )
    assert [(page, reason.split(" (")[0]) for page, reason in skipped] == sorted(EXPECTED_SKIPS), skipped
    assert all("(" in reason for _, reason in skipped), "say where a skipped block does run"


def test_readme_keeps_the_commands_ci_runs():
    readme = (ROOT / "README.md").read_text()
    assert "python3 -m pip install nox && nox -s demo" in readme
    assert "python3 -m pip install nox && nox -s tests" in readme
    assert len(readme.splitlines()) <= 150


#: Pages that cite result files: the manuals, the README, the benchmarks' README, the GPU runs' notes.
RESULT_PAGES = [
    *PAGES,
    ROOT / "benchmarks" / "README.md",
    *sorted((ROOT / "benchmarks" / "results" / "gpu").glob("*/README.md")),
]
_GPU_RESULT_PATH = re.compile(r"`(benchmarks/results/gpu/[^`\s]+)`")


def test_every_gpu_result_file_a_page_cites_is_in_the_repository():
    """A GPU number is traced to its run's file: the file a page names (a glob at most) is committed."""
    cited = [(_rel(p), path) for p in RESULT_PAGES for path in _GPU_RESULT_PATH.findall(p.read_text())]
    assert cited
    missing = [(page, path) for page, path in cited if not any(ROOT.glob(path.rstrip("/")))]
    assert not missing, missing


def test_every_gpu_row_of_the_verified_page_names_its_file():
    """A row of a CUDA-numbers table, or a row whose cuda cell names a GPU, cites a run's file."""
    section, bare = "", []
    for line in (ROOT / "docs" / "verified.md").read_text().splitlines():
        if line.startswith("## "):
            section = line
        if not line.startswith("| ") or line.startswith(("| ---", "| what |")):
            continue
        gpu_row = section.startswith("## CUDA numbers") or re.search(r"H[12]00", line.split(" | ")[-1])
        if gpu_row and "`benchmarks/results/gpu/" not in line:
            bare.append(line[:80])
    assert not bare, bare


def test_vllm_recipe_block_is_where_tests_vllm_reads_it():
    text = (ROOT / "docs" / "vllm.md").read_text()
    recipe = re.search(r"```python\n(.*?)```", text[text.index("<!-- recipe.py") :], re.S).group(1)
    assert "from vllm import LLM" in recipe


# -- the reference pages are complete -------------------------------------------------------------


def _trees() -> dict[Path, ast.Module]:
    return {p: ast.parse(p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))}


def _string_of(node: ast.AST, consts: dict[str, str], aliases: dict[str, str]) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):
        return consts.get(aliases.get(node.id, node.id))
    return None


def fallback_reasons() -> dict[str, set[str]]:
    """Every reason string the package counts an eager call under -> the files that count it.

    Read from the code: the first argument of ``Unsupported(...)``, ``note_fallback(...)`` and
    ``on_eager(...)``; keys written into ``stats.fallbacks[...]``; vLLM's ``count("eager", reason)``;
    ``(reason, message)`` pairs that functions return for their caller to count; the keys of the
    Hugging Face adapter's table of arguments that make ``generate`` run eagerly.
    """
    trees = _trees()
    consts: dict[str, str] = {}
    aliases: dict[str, str] = {}
    for tree in trees.values():
        for node in tree.body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                for target in node.targets:
                    if isinstance(target, ast.Name) and isinstance(node.value.value, str):
                        consts[target.id] = node.value.value
            if isinstance(node, ast.ImportFrom):
                aliases.update({a.asname: a.name for a in node.names if a.asname})
    found: dict[str, set[str]] = {}

    def add(reason: str | None, path: Path) -> None:
        if reason is not None:
            found.setdefault(reason, set()).add(path.relative_to(ROOT).as_posix())

    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                if name in ("Unsupported", "note_fallback", "on_eager") and node.args:
                    add(_string_of(node.args[0], consts, aliases), path)
                if (
                    name == "count"
                    and len(node.args) == 2
                    and _string_of(node.args[0], consts, aliases) == "eager"
                ):
                    add(_string_of(node.args[1], consts, aliases), path)
            elif isinstance(node, ast.Subscript) and getattr(node.value, "attr", None) == "fallbacks":
                add(_string_of(node.slice, consts, aliases), path)
            elif isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple) and node.value.elts:
                pair = node.value.elts[0] if isinstance(node.value.elts[0], ast.Tuple) else node.value
                if (
                    isinstance(pair, ast.Tuple)
                    and len(pair.elts) == 2
                    and isinstance(pair.elts[1], (ast.Constant, ast.JoinedStr))
                ):
                    reason = _string_of(pair.elts[0], consts, aliases)
                    message = pair.elts[1]
                    if isinstance(message, ast.JoinedStr) or " " in str(message.value):
                        add(reason, path)
            elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
                if any(isinstance(t, ast.Name) and "EAGER" in t.id for t in node.targets):
                    for key in node.value.keys:
                        if key is not None:
                            add(_string_of(key, consts, aliases), path)
    return found


def test_troubleshooting_page_explains_every_fallback_reason():
    page = (ROOT / "docs" / "troubleshooting.md").read_text()
    reasons = fallback_reasons()
    # The reader finds the reasons where they are made (if this fails, the code's shape changed).
    assert {"padding_changes_result", "size_not_captured", "forward_not_graphed", "mask_structure"} <= set(
        reasons
    )
    assert {"over_capture_size", "use_cache", "assistant_model", "prefill_not_piecewise"} <= set(reasons)
    missing = {
        r: sorted(files)
        for r, files in reasons.items()
        if f"`{r}`" not in page and f"`eager.{r}`" not in page
    }
    assert not missing, f"add these fallback reasons to docs/troubleshooting.md: {missing}"


def test_troubleshooting_page_names_every_generation_mode_run_eagerly():
    modes = pytest.importorskip("transformers.generation.configuration_utils").GenerationMode
    page = (ROOT / "docs" / "troubleshooting.md").read_text()
    eager = {m.value for m in modes} - {modes.GREEDY_SEARCH.value, modes.SAMPLE.value}
    assert not {m for m in eager if f"`{m}`" not in page}


def environment_variables() -> set[str]:
    """Every ``DEVGRAPH_*`` name in the package's string literals (identifiers excluded)."""
    names, identifiers = set(), set()
    for tree in _trees().values():
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.update(re.findall(r"(?<![A-Za-z0-9_])DEVGRAPH_[A-Z0-9_]*[A-Z0-9]", node.value))
            elif isinstance(node, ast.Name):
                identifiers.add(node.id)
    return names - identifiers


def test_options_page_lists_every_environment_variable():
    page = (ROOT / "docs" / "options.md").read_text()
    names = environment_variables()
    assert {"DEVGRAPH_BACKEND", "DEVGRAPH_DEBUG", "DEVGRAPH_VLLM"} <= names
    assert not sorted(n for n in names if f"`{n}`" not in page)


def test_options_page_lists_every_option_field():
    from devgraph.adapters.hf import HFOptions
    from devgraph.compile import CompileConfig
    from devgraph.runner import RunnerConfig

    page = (ROOT / "docs" / "options.md").read_text()
    fields = {f.name for cls in (RunnerConfig, CompileConfig, HFOptions) for f in attrs.fields(cls)}
    assert not sorted(f for f in fields if f"| `{f}` |" not in page)


def test_options_page_lists_every_command_with_every_option():
    # The table once lacked `devgraph bisect`.
    import argparse

    from devgraph.cli import parser

    page = (ROOT / "docs" / "options.md").read_text()
    rows = [line for line in page.splitlines() if line.startswith("| `devgraph ")]
    commands = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name, sub in commands.items():
        row = next((r for r in rows if r.startswith(f"| `devgraph {name}")), None)
        assert row is not None, f"devgraph {name} is not in the options page's command table"
        options = [s for a in sub._actions for s in a.option_strings if s.startswith("--") and s != "--help"]
        assert not [o for o in options if o not in row.split(" | ")[0]], (name, options)


def test_the_promise_reads_the_same_in_the_readme_wrap_page_and_the_rounding_report():
    # The report's words (tests/runner/test_row_count_rounding.py checks the report says them).
    from devgraph.runner._rounding import PROMISE

    for page in (ROOT / "README.md", ROOT / "docs" / "wrap.md"):
        assert PROMISE in " ".join(page.read_text().split()), _rel(page)
