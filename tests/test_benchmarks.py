"""The benchmark scripts run end to end (smoke runs on the CPU reference backend, small sizes).

They are scripts, not timed tests: this only checks they work and write their JSON, so they are
ready for a GPU machine, and that a run cut short keeps the rows it measured (a GPU machine is lent
for minutes: a benchmark killed at its time limit must leave its numbers behind).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

RUNS = {
    "replay_vs_eager": (["--device", "cpu", "--iters", "20"], "replay_vs_eager_cpu.json"),
    "decode_step": (["--device", "cpu", "--quick"], "decode_step_cpu_quick.json"),
    "piecewise": (["--device", "cpu", "--iters", "3"], "piecewise_cpu.json"),
    "paged_attention": (["--device", "cpu", "--iters", "2"], "paged_attention_cpu.json"),
    "host_overhead": (["--device", "cpu", "--quick"], "host_overhead_quick.json"),
    "npu_update_order": (["--layers", "2", "--iters", "3"], "npu_update_order.json"),  # the simulator
    "breakable": (["--device", "cpu", "--quick"], "breakable_cpu_quick.json"),
    "hf_generate": (
        ["--device", "cpu", "--quick", "--archs", "llama", "qwen3"],
        "hf_generate_cpu_quick.json",
    ),
    "hf_static_cache_gap": (
        ["--device", "cpu", "--quick", "--archs", "llama", "minicpm3", "--dtypes", "bfloat16"],
        "hf_static_cache_gap_cpu_quick.json",
    ),
    "call_overhead": (["--device", "cpu", "--quick"], "call_overhead_cpu_quick.json"),
    "dynamo_frontend": (["--quick"], "dynamo_frontend_quick.json"),
    "spec_draft": (["--quick"], "spec_draft_quick.json"),  # cpu and the npu simulator
}


def _script(name: str, out: Path, *flags: str) -> list[str]:
    return [sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), "--out", str(out), *flags]


@pytest.mark.parametrize("script", sorted(RUNS))
def test_benchmark_script_runs_and_writes_json(script, tmp_path):
    flags, result = RUNS[script]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        _script(script, tmp_path, *flags), capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads((tmp_path / result).read_text())
    assert data["complete"] is True, f"{result} of a finished run says it is not complete"
    assert {"commit", "clean", "from"} <= set(data["checkout"]), "the report does not say what it measured"
    assert not list(tmp_path.glob(".*.partial")), "a partial write was left beside the report"


def _rows(report: dict) -> int:
    return len(report.get("results", {}))


def test_a_benchmark_killed_mid_run_leaves_the_rows_it_measured(tmp_path):
    """replay_vs_eager with many iterations per row: killed (SIGKILL, as a time limit does) once its
    first row is on disk, the JSON on disk is whole, says it is incomplete and holds that row."""
    path = tmp_path / "replay_vs_eager_cpu.json"
    flags = ["--device", "cpu", "--iters", "100000", "--warmup", "0", "--hidden", "8", "--steps", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        _script("replay_vs_eager", tmp_path, *flags),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        deadline = time.monotonic() + 240
        while not path.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert path.exists(), f"no partial JSON before the run ended: {proc.stderr.read()[-2000:]!r}"
        assert proc.poll() is None, "the run finished before it could be killed: raise --iters"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    report = json.loads(path.read_text())
    assert report["complete"] is False
    assert 1 <= _rows(report) < 3  # eager, maybe devgraph: never the row being measured when killed
    assert report["results"]["eager"]["samples"] == 100000


def test_npu_task_update_benchmark_runs_and_counts_the_calls(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "npu_task_update.py"),
            "--layers",
            "2",
            "--iters",
            "2",
            "--probe-iters",
            "1",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (case,) = json.loads((tmp_path / "npu_task_update.json").read_text())["cases"]
    devgraph_step, loop_step = case["devgraph"]["per_step"], case["loop"]["per_step"]
    assert devgraph_step["host_syncs"] == 0 and loop_step["host_syncs"] == 1
    assert devgraph_step["update_begin"] == loop_step["update_begin"] == 2
    assert devgraph_step["calls"]["stream"] == loop_step["calls"]["stream"] == 1
