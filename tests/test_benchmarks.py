"""The benchmark scripts run end to end (smoke runs on the CPU reference backend, small sizes).

They are scripts, not timed tests: this only checks they work and write their JSON, so they are
ready for a GPU machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

RUNS = {
    "replay_vs_eager": (["--iters", "20"], "replay_vs_eager_cpu.json"),
    "decode_step": (["--quick"], "decode_step_cpu_quick.json"),
    "piecewise": (["--iters", "3"], "piecewise_cpu.json"),
    "paged_attention": (["--iters", "2"], "paged_attention_cpu.json"),
    "host_overhead": (["--quick"], "host_overhead_quick.json"),
}


@pytest.mark.parametrize("script", sorted(RUNS))
def test_benchmark_script_runs_and_writes_json(script, tmp_path):
    flags, result = RUNS[script]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / f"{script}.py"),
            "--device",
            "cpu",
            "--out",
            str(tmp_path),
            *flags,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads((tmp_path / result).read_text())
    assert data, f"{result} is empty"


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
