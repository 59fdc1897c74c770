"""SGLang engine start time on CPU with devgraph's graphs against the same engine without.

Runs ``tests/adapters/sglang/engine_run.py`` (a real ``sgl.Engine``, ``SGLANG_PLATFORM=devgraph``, a tiny model
built locally with dummy weights) once per mode and model, each in its own process, and reads the
seconds ``sgl.Engine(...)`` took to return: process start and imports, model load, KV pool, and with
graphs the capture of every decode size (SGLang's default sizes for ``--max-running-requests``; 1..16
by default), whose own time (``capture_s``, from the adapter's counters) is reported too. Three modes:
``eager`` (no graphs), ``graphs`` (decode graphs) and ``prefill`` (decode graphs and prefill graphs by
breakable capture: ``cuda_graph_backend_prefill="breakable"``, SGLang's token buckets up to
``--prefill-max-tokens``, whose capture time is ``prefill_capture_s``). Targets: start with decode
graphs at most 2x start without (issue 22); with prefill and decode graphs at most 1.5x (issue 33).
``--rounds N`` runs every mode N times per model (the order rotating per round) and reports the run of
median start per mode; each round's starts are kept. It also checks that the greedy requests it then
runs are token-identical every way, and reports
each mode's generation time (on the CPU reference a replay re-issues the recorded ops: not a speed path).

The modes of one model run back to back, so their ratio is paired; this 2-core machine is shared, so
absolute seconds are noisy.

Needs the SGLang test environment (``nox -s tests-sglang`` builds it)::

    .nox/tests-sglang/bin/python benchmarks/sglang_start.py                 # 3 models, a few minutes each
    .nox/tests-sglang/bin/python benchmarks/sglang_start.py --models qwen3  # one

Writes ``<out>/sglang_start.json`` after every model (``"complete": false`` until the end); exits 1 if a
ratio is above its target or tokens differ.
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
TARGET = 2.0  # decode graphs (issue 22)
PREFILL_TARGET = 1.5  # prefill and decode graphs (issue 33)
MODES = ("eager", "graphs", "prefill")


def run(model_dir: Path, mode: str, tmp: Path, args: argparse.Namespace) -> dict:
    out = tmp / f"{model_dir.name}-{mode}.json"
    stats = tmp / f"{model_dir.name}-{mode}-stats.json"
    env = dict(
        os.environ,
        SGLANG_PLATFORM="devgraph",
        DEVGRAPH_SGLANG_STATS=str(stats),
        PYTHONPATH=os.pathsep.join([str(ROOT), str(ENGINE_DIR), os.environ.get("PYTHONPATH", "")]),
    )
    engine_mode = "graphs" if mode == "prefill" else mode
    cmd = [sys.executable, str(ENGINE_DIR / "engine_run.py"), str(model_dir), str(out), engine_mode]
    cmd += ["--requests", str(args.requests), "--max-new-tokens", str(args.max_new_tokens)]
    cmd += ["--max-running", str(args.max_running)]
    if mode == "prefill":
        cmd += ["--prefill"]
        if args.prefill_max_tokens:
            cmd += ["--prefill-max-tokens", str(args.prefill_max_tokens)]
    wall = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - wall
    if proc.returncode != 0:
        raise SystemExit(f"engine ({model_dir.name}, {mode}) failed:\n{proc.stderr[-4000:]}")
    result = json.loads(out.read_text())
    counters = json.loads(stats.read_text()) if stats.exists() else {}
    return {
        "start_s": result["start_s"],
        "generate_s": result["generate_s"],
        "capture_s": counters.get("capture_s", 0.0),
        "graphs": len(counters.get("captured", [])),
        "prefill_capture_s": counters.get("prefill_capture_s", 0.0),
        "prefill_sizes": counters.get("prefill_captured", []),
        "prefill_segments": sum(g["segments"] for g in counters.get("prefill_graphs", {}).values()),
        "prefill_replays": sum(counters.get("prefill_replays", {}).values()),
        "process_s": wall,
        "output_ids": result["output_ids"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="llama,qwen3,phi3")  # MoE: no CPU decode graphs
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--max-running", type=int, default=16)
    parser.add_argument(
        "--prefill-max-tokens",
        type=int,
        default=None,
        help="prefill graphs up to this many tokens (default: SGLang's)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="runs of every mode per model, in an order rotating per round; ratios of the medians",
    )
    parser.add_argument("--timeout", type=int, default=1200)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    sys.path.insert(0, str(ENGINE_DIR))
    import sglang
    import tiny_model
    import torch
    from _common import PartialReport, pyplot

    import devgraph

    rows: list[dict] = []
    report = {
        "benchmark": "sglang_start",
        "what": "seconds sgl.Engine(...) takes to return on cpu: no graphs, devgraph decode graphs, devgraph "
        "decode and prefill (breakable) graphs",
        "target_ratio": TARGET,
        "prefill_target_ratio": PREFILL_TARGET,
        "max_running_requests": args.max_running,
        "prefill_max_tokens": args.prefill_max_tokens,
        "requests": args.requests,
        "max_new_tokens": args.max_new_tokens,
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
            runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
            for r in range(args.rounds):  # rotating order: a load spike of this shared box hits each mode
                for mode in MODES[r % 3 :] + MODES[: r % 3]:
                    runs[mode].append(run(model_dir, mode, tmp, args))
            eager, graphs, prefill = (_median_run(runs[mode]) for mode in MODES)
            rows.append(
                {
                    "model": arch,
                    "start_eager_s": round(eager["start_s"], 2),
                    "start_graphs_s": round(graphs["start_s"], 2),
                    "start_prefill_s": round(prefill["start_s"], 2),
                    "ratio": round(graphs["start_s"] / eager["start_s"], 2),
                    "prefill_ratio": round(prefill["start_s"] / eager["start_s"], 2),
                    "capture_s": round(graphs["capture_s"], 2),
                    "graphs_captured": graphs["graphs"],
                    "prefill_capture_s": round(prefill["prefill_capture_s"], 2),
                    "prefill_sizes": prefill["prefill_sizes"],
                    "prefill_segment_graphs": prefill["prefill_segments"],
                    "prefill_replays": prefill["prefill_replays"],
                    "generate_eager_s": round(eager["generate_s"], 2),
                    "generate_graphs_s": round(graphs["generate_s"], 2),
                    "generate_prefill_s": round(prefill["generate_s"], 2),
                    "tokens_identical": all(g["output_ids"] == eager["output_ids"] for g in runs["graphs"]),
                    "prefill_tokens_identical": all(
                        p["output_ids"] == eager["output_ids"] for p in runs["prefill"]
                    ),
                    "rounds": args.rounds,
                    "starts_s": {mode: [round(x["start_s"], 2) for x in runs[mode]] for mode in MODES},
                }
            )
            row = rows[-1]
            print(
                f"{arch:8s} start eager {eager['start_s']:6.1f} s  graphs {graphs['start_s']:6.1f} s "
                f"({row['ratio']:.2f}x; {graphs['graphs']} decode sizes in {graphs['capture_s']:5.1f} s)  "
                f"+prefill {prefill['start_s']:6.1f} s ({row['prefill_ratio']:.2f}x; {len(prefill['prefill_sizes'])} "
                f"prefill sizes in {prefill['prefill_capture_s']:5.1f} s)  tokens identical: "
                f"{row['tokens_identical']}, {row['prefill_tokens_identical']}",
                flush=True,
            )
            partial.row_done(report)  # a run cut short keeps the models it measured
    print(f"wrote {partial.finish(report)}")
    plot(rows, args.out / "sglang_start.png", pyplot())
    ok = all(
        r["ratio"] <= TARGET
        and r["prefill_ratio"] <= PREFILL_TARGET
        and r["tokens_identical"]
        and r["prefill_tokens_identical"]
        for r in rows
    )
    return 0 if ok else 1


def _median_run(runs: list[dict]) -> dict:
    """The run of median engine start (the lower middle one of an even count)."""
    return sorted(runs, key=lambda x: x["start_s"])[(len(runs) - 1) // 2]


def plot(rows: list[dict], path: Path, plt) -> None:
    """Start seconds per model, one bar per mode (nothing without matplotlib)."""
    if plt is None or not rows:
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.27
    labels = {"eager": "no graphs", "graphs": "decode graphs", "prefill": "decode + prefill graphs"}
    for i, mode in enumerate(MODES):
        xs = [j + (i - 1) * width for j in range(len(rows))]
        ax.bar(xs, [r[f"start_{mode}_s"] for r in rows], width, label=labels[mode])
    ax.set_xticks(range(len(rows)), [r["model"] for r in rows])
    ax.set_ylabel("sgl.Engine start (s)")
    ax.set_title("SGLang 0.5.23 on cpu, devgraph platform")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
