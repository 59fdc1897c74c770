"""``tools/gpu_oneshot.sh``, the one command a lent GPU machine runs, dry-run here on the CPU backend.

A GPU is lent for minutes, at most once: the script must work the first time. ``--dry-run`` runs its
very step list (``--device cpu``, smallest grids, pytest steps collect only, pip replaced by the
PYTHONPATH fallback), so these tests check the script itself: every step reported in the summary,
the partial JSON of every benchmark written, what comes back packed in two files, the time limits and
the global deadline kept, a step killed at its limit leaving its Python stacks behind, the commit and
the tree's state in the summary and in every benchmark's JSON (on a copy of the tree without ``.git``,
from a stamp that must match the files). Also: the GPU machine has no ``hypothesis``, and the test files
with ``cuda`` tests must still collect there.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "gpu_oneshot.sh"


def _clean_env() -> dict[str, str]:
    """This process's environment without what pytest (and xdist) set for their own tests."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}


def _oneshot(tmp: Path, *flags: str, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    """The script with OUT=tmp/out (what comes back from a GPU machine) and its run folder in tmp/work."""
    return subprocess.run(
        ["bash", str(SCRIPT), *flags],
        env={
            **_clean_env(),
            "OUT": str(tmp / "out"),
            "ONESHOT_WORK": str(tmp / "work"),
            "PYTHON": sys.executable,
            **env,
        },
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def _listed_steps(*flags: str) -> list[str]:
    done = subprocess.run(["bash", str(SCRIPT), "--list", *flags], capture_output=True, text=True, check=True)
    return re.findall(r"^  (\w+)  \d+ s$", done.stdout, flags=re.M)


@pytest.fixture(scope="module", params=["first", "second"])
def dry_run(request, tmp_path_factory):
    """One dry run of the first (or the second) list: its output, and its run folder."""
    tmp = tmp_path_factory.mktemp(f"oneshot-{request.param}")
    flags = ["--dry-run"] + (["--second"] if request.param == "second" else [])
    done = _oneshot(tmp, *flags)
    return request.param, flags, done, tmp / "work" / request.param


def test_dry_run_reports_every_step_as_ok(dry_run):
    _, flags, done, run = dry_run
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["finished"] and summary["dry_run"] and summary["device"] == "cpu"
    assert [s["name"] for s in summary["steps"]] == _listed_steps(*flags[1:])
    for step in summary["steps"]:
        assert step["status"] == "ok", (step, (run / step.get("log", "missing")).read_text()[-3000:])
        assert step["rc"] == 0 and step["seconds"] > 0 and step["limit_s"] > 0
        assert (run / step["log"]).is_file()
    assert summary["install"] == "pythonpath"  # the fallback is what the dry run exercises
    assert summary["elapsed_s"] < summary["deadline_s"]


def test_the_summary_and_every_report_record_the_commit_and_the_trees_state(dry_run):
    _, _, done, run = dry_run
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("this checkout has no git")
    summary = json.loads((run / "summary.json").read_text())
    checkout = summary["checkout"]
    assert checkout["commit"] == head.stdout.strip() and checkout["from"] == "git"
    assert isinstance(checkout["clean"], bool) and checkout["changed_count"] >= len(checkout["changed"])
    assert f"measured on commit {head.stdout.strip()[:12]}" in done.stdout
    for path in (run / "results").rglob("*.json"):
        if path.name != "env.json":
            assert json.loads(path.read_text())["checkout"] == checkout, path.name


def test_out_receives_two_files_holding_the_whole_run(dry_run):
    """A lent machine returns at most 8 files from $OUT: the summary and the packed run folder."""
    mode, _, _, run = dry_run
    out = run.parent.parent / "out"
    assert sorted(p.name for p in out.iterdir()) == sorted([f"{mode}-summary.json", f"{mode}.tar.gz"])
    assert json.loads((out / f"{mode}-summary.json").read_text()) == json.loads(
        (run / "summary.json").read_text()
    )
    with tarfile.open(out / f"{mode}.tar.gz") as archive:
        packed = {m.name for m in archive.getmembers() if m.isfile()}
    on_disk = {
        str(p.relative_to(run.parent)) for p in run.rglob("*") if p.is_file() and not p.name.startswith(".")
    }
    assert on_disk - {f"{mode}/excluded.txt"} <= packed


def test_dry_run_leaves_every_benchmarks_json_complete(dry_run):
    mode, _, _, run = dry_run
    reports = {p.name: json.loads(p.read_text()) for p in (run / "results").rglob("*.json")}
    expected = {
        "first": {"env.json", "smoke.json", "replay_vs_eager_cpu.json", "paged_attention_cpu.json",
                  "decode_step_cpu_quick.json", "hf_generate_cpu_quick.json", "call_overhead_cpu_quick.json",
                  "host_overhead_quick.json"},
        "second": {"env.json", "piecewise_cpu.json", "decode_step_cpu_quick.json"},
    }[mode]  # fmt: skip
    assert expected <= set(reports)
    for name, report in reports.items():
        if name != "env.json":
            assert report["complete"] is True, name
    summary = json.loads((run / "summary.json").read_text())
    listed = {Path(o).name for s in summary["steps"] for o in s.get("outputs", [])}
    assert expected <= listed  # the summary names each step's files


def test_dry_run_pytest_steps_write_junit(dry_run):
    mode, _, _, run = dry_run
    steps = {"first": ["cuda_tests", "failed_capture"], "second": ["cpu_subset"]}[mode]
    for name in steps:
        assert (run / "junit" / f"{name}.xml").is_file(), name
        log = (run / "logs").glob(f"*-{name}.log")
        text = next(log).read_text()
        assert re.search(r"collected \d+ items|\d+/\d+ tests collected", text), text[-2000:]
    if mode == "first":  # run, not only collected: each test's line is in the step's JSON lines
        summary = json.loads((run / "summary.json").read_text())
        tests = {s["name"]: s["tests"] for s in summary["steps"] if s["name"] in steps}
        assert tests["cuda_tests"]["skipped"] > 30 and tests["cuda_tests"]["passed"] == 0  # no GPU here
        assert tests["failed_capture"]["passed"] >= 17 and tests["failed_capture"]["failed"] == 0


def test_failed_capture_tests_run_apart_from_the_other_cuda_tests(dry_run):
    mode, _, _, run = dry_run
    if mode != "first":
        pytest.skip("the first list holds the cuda tests")
    ids = {
        name: {
            json.loads(line)["nodeid"].rpartition("::")[2]
            for line in (run / "results" / f"tests-{name}.jsonl").read_text().splitlines()
        }
        for name in ("cuda_tests", "failed_capture")
    }
    apart = {"test_failed_capture_end_leaves_graph_uncaptured", "test_cuda_refusal_inside_capture_is_a_capture_error",
             "test_conformance[check_capture_error_on_host_sync]",
             "test_reseeding_inside_a_cuda_capture_is_a_capture_error"}  # fmt: skip
    assert apart <= set(ids["failed_capture"])
    assert not apart & set(ids["cuda_tests"])
    assert "test_cuda_graph_replays_new_lengths_with_the_new_kernel[flex]" in ids["cuda_tests"]


def test_a_step_past_its_limit_is_killed_with_its_python_stacks(tmp_path):
    """smoke limited to 2 s (importing torch alone takes about that): killed with SIGABRT, so every
    Python thread's stack lands in its log, then SIGKILL; reported as timeout."""
    done = _oneshot(tmp_path, "--dry-run", "--steps", "smoke", ONESHOT_LIMIT_smoke="2")
    assert done.returncode == 1, done.stdout[-3000:]
    (smoke,) = json.loads((tmp_path / "out" / "first-summary.json").read_text())["steps"]
    assert smoke["status"] == "timeout" and smoke["limit_s"] == 2 and smoke["rc"] in (124, 137)
    log = (tmp_path / "work" / "first" / smoke["log"]).read_text()
    assert "Fatal Python error: Aborted" in log and 'File "' in log, log[-2000:]


def test_the_deadline_clips_a_steps_limit(tmp_path):
    """A 40 s deadline keeps 12 s for the end: smoke's 60 s limit becomes what is left, at most 28 s."""
    done = _oneshot(tmp_path, "--dry-run", "--steps", "smoke", "--deadline", "40")
    assert done.returncode == 0, done.stdout[-3000:]
    (smoke,) = json.loads((tmp_path / "out" / "first-summary.json").read_text())["steps"]
    assert smoke["status"] == "ok" and 15 <= smoke["limit_s"] <= 28


def test_steps_without_time_left_are_skipped_not_started(tmp_path):
    """Under 15 s left for steps (a 26 s deadline keeps 12 s for the end): nothing starts."""
    start = time.monotonic()
    done = _oneshot(tmp_path, "--dry-run", "--steps", "env,smoke", "--deadline", "26")
    assert done.returncode == 1 and time.monotonic() - start < 26
    summary = json.loads((tmp_path / "out" / "first-summary.json").read_text())
    assert [(s["name"], s["status"]) for s in summary["steps"]] == [("env", "skipped"), ("smoke", "skipped")]
    assert all("left before the deadline" in s["note"] for s in summary["steps"]) and summary["finished"]


def test_the_first_list_runs_the_measurements_of_issue_43_in_its_order():
    """The tests, the HF generate comparison, the decode step and the call's overhead first; what
    remains as the deadline allows."""
    first = _listed_steps()
    assert first[:8] == ["env", "install", "cuda_tests", "any_device", "hf_generate", "decode_step",
                         "call_overhead", "host_overhead"]  # fmt: skip
    assert set(first[8:]) == {"smoke", "failed_capture", "bisect", "replay_vs_eager", "paged_attention"}
    assert "host_overhead" not in _listed_steps("--second")


def _git(repo: Path, *args: str) -> str:
    env = {**_clean_env(), "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}  # fmt: skip
    return subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, check=True, env=env
    ).stdout


def _provenance(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / "_provenance.py"), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_stamp_names_the_commit_on_a_copy_of_the_tree_without_git(tmp_path):
    """A lent machine gets the tree without .git: the stamp written here names the commit and the
    changes there, while every file it lists is as stamped; once one differs it names no commit."""
    repo, copy = tmp_path / "repo", tmp_path / "copy"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "a.py").write_text("a = 1\n")
    (repo / ".gitignore").write_text(".oneshot-stamp.json\nbuild/\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "one")
    head = _git(repo, "rev-parse", "HEAD").strip()
    (repo / "new.py").write_text("b = 2\n")  # untracked, not ignored: it travels, and the tree is not clean
    (repo / "build").mkdir()
    (repo / "build" / "out.bin").write_text("ignored: does not travel")
    done = _provenance("stamp", str(repo))
    assert done.returncode == 0, done.stderr
    stamp = json.loads((repo / ".oneshot-stamp.json").read_text())
    assert sorted(stamp["files"]) == [".gitignore", "new.py", "pkg/a.py"]
    shutil.copytree(repo, copy, ignore=shutil.ignore_patterns(".git", "build"))
    shown = json.loads(_provenance("show", str(copy)).stdout)
    assert shown["commit"] == head and shown["from"] == "stamp" and shown["clean"] is False
    assert shown["changed"] == ["?? new.py"]
    (copy / "pkg" / "a.py").write_text("a = 2\n")
    stale = json.loads(_provenance("show", str(copy)).stdout)
    assert stale["commit"] is None and stale["from"] == "stamp (stale)" and stale["changed"] == ["pkg/a.py"]
    (copy / ".oneshot-stamp.json").unlink()
    unknown = json.loads(_provenance("show", str(copy)).stdout)
    assert unknown["commit"] is None and unknown["from"] == "unknown" and "--stamp" in unknown["note"]


def test_unknown_steps_are_refused_by_name(tmp_path):
    done = _oneshot(tmp_path, "--steps", "env,decode", "--list")
    assert done.returncode == 2 and "no step decode in the first list" in done.stderr


def test_generated_dist_info_carries_the_entry_points(tmp_path):
    """The install fallback's .dist-info folders give importlib.metadata what pip -e would."""
    subprocess.run(
        [sys.executable, str(ROOT / "tools" / "_oneshot.py"), "dist-info", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
    )
    dists = {d.metadata["Name"]: d for d in importlib.metadata.distributions(path=[str(tmp_path)])}
    assert set(dists) == {"devgraph", "devgraph-sim", "devgraph-toy-backend"}
    toy = {ep.name: ep.value for ep in dists["devgraph-toy-backend"].entry_points if ep.group == "devgraph"}
    assert toy == {"toy": "devgraph_toy_backend"}
    builtin = {ep.name for ep in dists["devgraph"].entry_points if ep.group == "devgraph"}
    assert builtin == {"cpu", "cuda", "npu", "accelerator"}


def _pytest_without_hypothesis(*args: str) -> subprocess.CompletedProcess:
    code = (  # an import hook that finds no hypothesis, as on the GPU machine
        "import sys\n"
        "class NoHypothesis:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.partition('.')[0] == 'hypothesis':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, NoHypothesis())\n"
        "import pytest\n"
        "sys.exit(pytest.main(sys.argv[1:]))\n"
    )
    flags = ["-p", "no:hypothesispytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-q", "-rs"]
    return subprocess.run(
        [sys.executable, "-c", code, *flags, *args], capture_output=True, text=True, timeout=300, cwd=ROOT
    )


def test_cuda_test_files_collect_without_hypothesis():
    """The GPU machine has no hypothesis: every file the script's cuda step picks (the same grep)
    must collect there, and tests/ops/test_paged_attention.py's property test skips, saying why."""
    done = subprocess.run(
        ["grep", "-rl", "--include=test_*.py", r"pytest\.mark\.cuda", "tests"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    files = sorted(done.stdout.split())
    assert (
        "tests/ops/test_paged_attention.py" in files and "tests/backends/cuda/test_cuda_backend.py" in files
    )
    collected = _pytest_without_hypothesis("--collect-only", *files)
    assert collected.returncode == 0, collected.stdout[-3000:] + collected.stderr[-2000:]
    prop = _pytest_without_hypothesis(
        "tests/ops/test_paged_attention.py::test_new_kernel_equals_old_kernel_for_any_lengths"
    )
    assert prop.returncode == 0 and "hypothesis is not installed" in prop.stdout, prop.stdout[-3000:]


HANGING = """
import time

def test_quick():
    pass

def test_hangs():
    time.sleep(600)

def test_after():
    pass
"""


@pytest.mark.parametrize("workers", [0, 1], ids=["one process", "xdist"])
def test_a_hung_test_is_ended_with_its_stacks_and_results_stay_on_disk(tmp_path, workers):
    """tools/oneshot_pytest.py: past ONESHOT_TEST_TIMEOUT a test's stacks go to a file and its
    process ends (under xdist the run goes on with a new worker); each result is a JSON line."""
    (tmp_path / "test_hang.py").write_text(HANGING)
    env = {
        **_clean_env(),
        "PYTHONPATH": os.pathsep.join([str(ROOT / "tools"), os.environ.get("PYTHONPATH", "")]),
        "ONESHOT_TEST_TIMEOUT": "3",
        "ONESHOT_TEST_LOG": str(tmp_path / "tests.jsonl"),
        "ONESHOT_DUMP_DIR": str(tmp_path / "dumps"),
    }
    flags = ["-n", str(workers)] if workers else ["-p", "no:xdist"]
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "oneshot_pytest", "-p", "no:cacheprovider", "-q", "-o",
         "pythonpath=", "--rootdir", str(tmp_path), "-c", os.devnull, *flags, str(tmp_path / "test_hang.py")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert time.monotonic() - start < 120 and done.returncode != 0
    (dump,) = (tmp_path / "dumps").glob("hang-*.txt")
    text = dump.read_text()
    assert "test_hang.py::test_hangs: still running after 3 s" in text and "in test_hangs" in text, text
    lines = [json.loads(line) for line in (tmp_path / "tests.jsonl").read_text().splitlines()]
    outcomes = {line["nodeid"].rpartition("::")[2]: line["outcome"] for line in lines}
    assert outcomes["test_quick"] == "passed"
    if workers:  # the crashed worker is replaced: the test after the hung one still runs
        assert outcomes["test_hangs"] in ("failed", "error") and outcomes["test_after"] == "passed"
