"""SGLang engine start time on CPU with devgraph's decode graphs against the same engine without.

Runs ``tests/adapters/sglang/engine_run.py`` (a real ``sgl.Engine``, ``SGLANG_PLATFORM=devgraph``, a tiny model
built locally with dummy weights) once per mode and model, each in its own process, and reads the
seconds ``sgl.Engine(...)`` took to return: process start and imports, model load, KV pool, and with
graphs the capture of every decode size (SGLang's default sizes for ``--max-running-requests``; 1..16
by default), whose own time (``capture_s``, from the adapter's counters) is reported too. Target: start
with graphs at most 2x start without (issue 22). It also checks that the few greedy requests it then
runs are token-identical both ways.

Needs the SGLang test environment (``nox -s tests-sglang`` builds it)::

    .nox/tests-sglang/bin/python benchmarks/sglang_start.py                 # 3 models, a few minutes
    .nox/tests-sglang/bin/python benchmarks/sglang_start.py --models qwen3  # one

Writes ``<out>/sglang_start.json`` after every model (``"complete": false`` until the end); exits 1 if a ratio is above the target or tokens differ.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENGINE_DIR = ROOT / "tests" / "adapters" / "sglang"
TARGET = 2.0


def run(model_dir: Path, mode: str, tmp: Path, args: argparse.Namespace) -> dict:
    out = tmp / f"{model_dir.name}-{mode}.json"
    stats = tmp / f"{model_dir.name}-{mode}-stats.json"
    env = dict(
        os.environ,
        SGLANG_PLATFORM="devgraph",
        DEVGRAPH_SGLANG_STATS=str(stats),
        PYTHONPATH=os.pathsep.join([str(ROOT), str(ENGINE_DIR), os.environ.get("PYTHONPATH", "")]),
    )
    cmd = [sys.executable, str(ENGINE_DIR / "engine_run.py"), str(model_dir), str(out), mode]
    cmd += ["--requests", str(args.requests), "--max-new-tokens", str(args.max_new_tokens)]
    cmd += ["--max-running", str(args.max_running)]
    wall = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - wall
    if proc.returncode != 0:
        raise SystemExit(f"engine ({model_dir.name}, {mode}) failed:\n{proc.stderr[-4000:]}")
    result = json.loads(out.read_text())
    counters = json.loads(stats.read_text()) if stats.exists() else {}
    return {
        "start_s": result["start_s"],
        "capture_s": counters.get("capture_s", 0.0),
        "graphs": len(counters.get("captured", [])),
        "process_s": wall,
        "output_ids": result["output_ids"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="llama,qwen3,phi3")  # MoE: no CPU decode graphs
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--max-running", type=int, default=16)
    parser.add_argument("--timeout", type=int, default=1200)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    sys.path.insert(0, str(ENGINE_DIR))
    import sglang
    import tiny_model
    import torch
    from _common import PartialReport

    import devgraph

    rows: list[dict] = []
    report = {
        "benchmark": "sglang_start",
        "what": "seconds sgl.Engine(...) takes to return on cpu, devgraph decode graphs on vs off",
        "target_ratio": TARGET,
        "max_running_requests": args.max_running,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus",
        "sglang": sglang.__version__,
        "torch": torch.__version__,
        "devgraph": devgraph.__version__,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "rows": rows,
    }
    partial = PartialReport(args.out / "sglang_start.json")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for arch in args.models.split(","):
            model_dir = tiny_model.build(tmp / arch, arch)
            eager, graphs = (run(model_dir, mode, tmp, args) for mode in ("eager", "graphs"))
            rows.append(
                {
                    "model": arch,
                    "start_eager_s": round(eager["start_s"], 2),
                    "start_graphs_s": round(graphs["start_s"], 2),
                    "ratio": round(graphs["start_s"] / eager["start_s"], 2),
                    "capture_s": round(graphs["capture_s"], 2),
                    "graphs_captured": graphs["graphs"],
                    "tokens_identical": eager["output_ids"] == graphs["output_ids"],
                }
            )
            print(
                f"{arch:10s} start eager {eager['start_s']:6.1f} s  graphs {graphs['start_s']:6.1f} s  "
                f"ratio {rows[-1]['ratio']:.2f}  (capture of {graphs['graphs']} sizes {graphs['capture_s']:5.1f} s)  "
                f"tokens identical: {rows[-1]['tokens_identical']}",
                flush=True,
            )
            partial.row_done(report)  # a run cut short keeps the models it measured
    print(f"wrote {partial.finish(report)}")
    return 0 if all(r["ratio"] <= TARGET and r["tokens_identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
