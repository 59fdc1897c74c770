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
