"""vLLM engine start time on CPU with devgraph (``DEVGRAPH_VLLM=1``) against the same engine without.

Each run is its own process (vLLM resolves its platform once per process): it imports vLLM, then
times ``LLM(...)`` (model load, KV cache, and with devgraph the capture of vLLM's FULL decode graphs;
vLLM's default compilation config, ``max_num_seqs=8``: capture sizes 1, 2, 4, 8) and generates a few
greedy tokens, which must be identical both ways. Modes:

* ``plain``: vLLM without devgraph, its default config (on CPU: no graphs, the model compiled by
  Dynamo; warm once its compile cache is, if vLLM can load it back);
* ``plain-eager``: vLLM without devgraph, ``enforce_eager=True`` (nothing compiled: the least a start does);
* ``devgraph``: ``DEVGRAPH_VLLM=1``, vLLM's default config (FULL decode graphs through devgraph, model
  uncompiled);
* ``devgraph-breakable``: ``DEVGRAPH_VLLM=1`` with vLLM's ``VLLM_USE_BREAKABLE_CUDAGRAPH=1`` and
  ``cudagraph_mode=PIECEWISE``: one devgraph breakable capture of the whole uncompiled model per size
  (attention and KV-cache writes eager between segments), no torch.compile;
* ``devgraph-full-and-breakable``: the same flag with vLLM's default config (FULL_AND_PIECEWISE): FULL
  decode graphs and breakable graphs for the other batches, both captured at start;
* ``devgraph-piecewise``: ``DEVGRAPH_VLLM=1``, ``cudagraph_mode=PIECEWISE`` without the flag: vLLM's
  compile-split pieces (Dynamo trace, eager backend on CPU) captured through devgraph.

Each run also reports the seconds of vLLM's ``capture_model()`` inside the start (timed by this
script's child around vLLM's method): devgraph's graph capture, the part of the start it adds.

One untimed run of each mode first warms the caches (vLLM's compile cache, the OS file cache), then
``--pairs`` rounds run every mode once, in an order rotating per round, so that a load spike of this
shared machine hits each mode alike. Reported: min and median ``LLM(...)`` seconds per mode, and the
ratios devgraph/plain, devgraph/plain-eager of the medians and of the per-round pairs.

Needs the vLLM test environment (``nox -s tests-vllm --install-only`` builds it)::

    .nox/tests-vllm/bin/python benchmarks/vllm_start.py --pairs 3

Writes ``<out>/<name>.json`` (``vllm_start.json``) beside ``sglang_start.json``; exits 1 if the median
ratio of the ``--check`` mode (``devgraph``) to the ``--baseline`` mode is above ``--target`` (1.5) or
tokens differ. The breakable modes' run::

    .nox/tests-vllm/bin/python benchmarks/vllm_start.py --pairs 3 --name vllm_start_breakable \
        --modes plain-eager,devgraph,devgraph-breakable,devgraph-full-and-breakable,devgraph-piecewise
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VLLM_TESTS = ROOT / "tests" / "adapters" / "vllm"
TARGET = 1.5
MODES = (
    "plain",
    "plain-eager",
    "devgraph",
    "devgraph-breakable",
    "devgraph-full-and-breakable",
    "devgraph-piecewise",
)
#: The modes that switch devgraph on, and their extra environment.
DEVGRAPH_MODES = {
    "devgraph": {},
    "devgraph-breakable": {"VLLM_USE_BREAKABLE_CUDAGRAPH": "1"},
    "devgraph-full-and-breakable": {"VLLM_USE_BREAKABLE_CUDAGRAPH": "1"},
    "devgraph-piecewise": {},
}

#: The child: import vLLM (untimed), time LLM(...), generate, write JSON.
CHILD = r"""
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
model, mode, out = sys.argv[1:4]
kwargs = {"enforce_eager": True} if mode == "plain-eager" else {}
if mode in ("devgraph-breakable", "devgraph-piecewise"):
    kwargs = {"compilation_config": {"cudagraph_mode": "PIECEWISE"}}
# The share of the start that graph capture takes (this harness's own timer around vLLM's method).
capture_s = [0.0]
capture_model = GPUModelRunner.capture_model
def timed_capture(self, *args, **kwargs):
    t = time.perf_counter()
    try:
        return capture_model(self, *args, **kwargs)
    finally:
        capture_s[0] += time.perf_counter() - t
GPUModelRunner.capture_model = timed_capture
start = time.perf_counter()
llm = LLM(model=model, dtype="float32", seed=0, max_model_len=128, max_num_seqs=8, **kwargs)
started = time.perf_counter() - start
res = llm.generate(["w1 w2 w3", "w5 w6", "w9"], SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
stats = {}
if mode.startswith("devgraph"):
    from devgraph.adapters.vllm import stats as devgraph_stats
    stats = devgraph_stats()
cc = llm.llm_engine.vllm_config.compilation_config
json.dump({"start_s": started, "capture_s": capture_s[0], "stats": stats,
           "cudagraph_mode": cc.cudagraph_mode.name, "compilation_mode": cc.mode.name,
           "tokens": [list(r.outputs[0].token_ids) for r in res]}, open(out, "w"))
"""


def run(model_dir: Path, mode: str, tmp: Path, timeout: int) -> dict:
    out = tmp / f"{mode}-{time.monotonic_ns()}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DEVGRAPH_", "VLLM_"))}
    env.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_LOGGING_LEVEL="WARNING",
        TOKENIZERS_PARALLELISM="false",
    )
    if mode in DEVGRAPH_MODES:
        env.update(DEVGRAPH_VLLM="1", DEVGRAPH_BACKEND="cpu", **DEVGRAPH_MODES[mode])
    cmd = [sys.executable, "-c", CHILD, str(model_dir), mode, str(out)]
    proc = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"engine ({mode}) failed:\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def summary(values: list[float]) -> dict:
    return {"min_s": round(min(values), 2), "median_s": round(statistics.median(values), 2), "runs": values}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=3, help="rounds of one timed run per mode")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--baseline", default="plain-eager", choices=MODES)
    parser.add_argument(
        "--check",
        default="devgraph",
        choices=MODES,
        help="the mode whose ratio to --baseline must meet --target",
    )
    parser.add_argument("--target", type=float, default=TARGET)
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--name", default="vllm_start", help="the JSON file's name in --out (without .json)")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    sys.path.insert(0, str(VLLM_TESTS))
    from _tiny_model import build_tiny_llama

    times: dict[str, list[float]] = {m: [] for m in modes}
    captures: dict[str, list[float]] = {m: [] for m in modes}
    tokens: dict[str, list] = {}
    last: dict[str, dict] = {}  # each mode's last timed run (its graph counters, config)
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = build_tiny_llama(tmp / "llama")
        for mode in modes:  # warm-up: caches filled, not timed
            tokens[mode] = run(model_dir, mode, tmp, args.timeout)["tokens"]
            print(f"warm-up {mode} done", flush=True)
        for i in range(args.pairs):
            order = modes[i % len(modes) :] + modes[: i % len(modes)]
            row = {}
            for mode in order:
                result = run(model_dir, mode, tmp, args.timeout)
                times[mode].append(round(result["start_s"], 2))
                captures[mode].append(round(result["capture_s"], 2))
                row[mode] = round(result["start_s"], 2)
                row[f"{mode}_capture"] = round(result["capture_s"], 2)
                if result["tokens"] != tokens[mode]:
                    raise SystemExit(f"{mode}: tokens changed between runs")
                last[mode] = result
            rounds.append(row)
            print("round", i, row, flush=True)
    import torch
    import vllm

    import devgraph

    report = {
        "benchmark": "vllm_start",
        "what": (
            "seconds LLM(...) takes to return on cpu (tiny Llama, fp32, max_num_seqs=8), devgraph on vs off, "
            "with devgraph's FULL, breakable and compile-split piecewise graphs"
        ),
        "target_ratio": args.target,
        "baseline": args.baseline,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus, shared (noisy)",
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "devgraph": devgraph.__version__,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "modes": {
            m: {
                **summary(v),
                "capture_median_s": statistics.median(captures[m]),
                "cudagraph_mode": last[m].get("cudagraph_mode"),
                "compilation_mode": last[m].get("compilation_mode"),
                "stats": last[m].get("stats", {}),
            }
            for m, v in times.items()
        },
        "rounds": rounds,
        "tokens_identical": all(tokens[m] == tokens[modes[0]] for m in modes),
    }
    for mode in (m for m in modes if m in DEVGRAPH_MODES):
        for base in (m for m in modes if m != mode and (m not in DEVGRAPH_MODES or mode != "devgraph")):
            pairs = [r[mode] / r[base] for r in rounds]
            report[f"ratio_{mode}_to_{base}"] = {
                "of_medians": round(statistics.median(times[mode]) / statistics.median(times[base]), 2),
                "pairs_min": round(min(pairs), 2),
                "pairs_median": round(statistics.median(pairs), 2),
            }
        if mode != "devgraph":
            pairs = [
                r[f"{mode}_capture"] / r["devgraph_capture"] for r in rounds if r.get("devgraph_capture")
            ]
            if pairs:
                report[f"capture_ratio_{mode}_to_devgraph"] = round(statistics.median(pairs), 2)
    for key, value in report.items():
        if key.startswith(("modes", "ratio_", "capture_ratio_", "tokens_")):
            print(key, value)
    from _common import write_json  # the commit and the tree's state recorded with the result

    print(f"wrote {write_json(report, args.out / f'{args.name}.json')}")
    ratio = report.get(f"ratio_{args.check}_to_{args.baseline}", {}).get("of_medians", 0.0)
    return 0 if ratio <= args.target and report["tokens_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
