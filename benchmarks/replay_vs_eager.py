"""Launch overhead: eager vs devgraph replay vs a hand-written ``torch.cuda.CUDAGraph``.

The workload is many tiny kernels (``--steps`` x [matmul, silu, mul, add] on a 1 x ``--hidden``
activation), so eager time is dominated by per-kernel launch cost -- the case graph capture exists
for. Each iteration is timed with the device's timing events (start, call, end, wait for end), so a
sample is the latency of one call; the table reports the median after ``--warmup`` iterations.

On ``cpu`` the devgraph column is the *reference simulator* (a correctness backend that re-executes
recorded ops from Python): expect it to be slower than eager there.

    python benchmarks/replay_vs_eager.py                 # best available device
    python benchmarks/replay_vs_eager.py --device cuda --iters 2000

Writes ``<out>/replay_vs_eager_<device>.json``, after every mode (``"complete": false`` until the end).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _common import (
    DEFAULT_OUT,
    PartialReport,
    cuda_graph_capture,
    logger,
    report_header,
    summarise,
    time_calls,
)

import devgraph


def make_workload(
    device: torch.device, hidden: int, steps: int
) -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
    """A static input and a function of it issuing ``4 * steps`` small kernels."""
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(hidden, hidden, generator=gen) / hidden**0.5).to(device) for _ in range(steps)]
    x = torch.randn(1, hidden, generator=gen).to(device)

    def fn() -> torch.Tensor:
        y = x
        for w in weights:
            y = torch.nn.functional.silu(y @ w) + y * 0.5
        return y

    return x, fn


def devgraph_replay(
    dev: devgraph.Device, fn: Callable[[], torch.Tensor]
) -> tuple[Callable[[], Any], torch.Tensor]:
    """Capture ``fn`` with devgraph (warm-up on the capture stream first, as runners do)."""
    stream = dev.stream()
    stream.wait_stream(dev.current_stream())
    with stream:
        for _ in range(3):
            fn()
    dev.current_stream().wait_stream(stream)
    graph = dev.graph()
    with graph.capture(stream=stream):
        out = fn()
    dev.synchronize()
    return graph.replay, out


def run(
    args: argparse.Namespace, on_row: Callable[[dict[str, Any]], None] = lambda report: None
) -> dict[str, Any]:
    """Every mode's row; ``on_row(report)`` after each (the report so far)."""
    dev = devgraph.device(args.device)
    x, fn = make_workload(dev.torch_device, args.hidden, args.steps)
    results: dict[str, dict[str, float]] = {}
    report = {
        **report_header(dev, "replay_vs_eager"),
        "workload": {
            "hidden": args.hidden,
            "steps": args.steps,
            "kernels_per_call": 4 * args.steps,
            "dtype": str(x.dtype),
        },
        "iters": args.iters,
        "warmup": args.warmup,
        "timing": "per-call latency between device timing events (start, call, end, end.synchronize())",
        "results": results,
    }
    with torch.inference_mode():
        expected = fn().clone()
        calls: dict[str, tuple[Callable[[], Any], torch.Tensor | None]] = {"eager": (fn, None)}
        calls["devgraph"] = devgraph_replay(dev, fn)
        if dev.name == "cuda":
            graph, out, _ = cuda_graph_capture(fn)  # the same capture by hand: what devgraph wraps
            calls["torch.cuda.CUDAGraph"] = (graph.replay, out)
        for label, (call, out) in calls.items():
            samples = time_calls(dev, call, args.iters, args.warmup)
            results[label] = summarise([ms * 1000.0 for ms in samples], unit="us")
            if out is not None:
                dev.synchronize()
                results[label]["max_abs_err"] = float((out - expected).abs().max())
            eager = results["eager"]["median_us"]
            median = results[label]["median_us"]
            results[label]["speedup_vs_eager"] = eager / median if median else float("nan")
            on_row(report)
    return report


def render(report: dict[str, Any]) -> str:
    label = report["backend"] + (
        " (reference simulator: correctness, not speed)" if report["backend"] == "cpu" else ""
    )
    lines = [
        f"replay_vs_eager on {label} -- {report['device_name']}, torch {report['torch']}",
        f"{report['workload']['kernels_per_call']} kernels per call, median of {report['iters']} iterations",
        f"{'mode':<22}{'median us':>12}{'p10 us':>10}{'p90 us':>10}{'speedup':>10}{'max err':>10}",
    ]
    for mode, row in report["results"].items():
        err = f"{row['max_abs_err']:.1e}" if "max_abs_err" in row else "-"
        lines.append(
            f"{mode:<22}{row['median_us']:>12.1f}{row['p10_us']:>10.1f}{row['p90_us']:>10.1f}"
            f"{row['speedup_vs_eager']:>9.2f}x{err:>10}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="devgraph backend (default: best available)")
    parser.add_argument("--iters", type=int, default=200, help="timed iterations per mode")
    parser.add_argument("--warmup", type=int, default=20, help="untimed iterations per mode")
    parser.add_argument("--hidden", type=int, default=1024, help="width of the activation and weights")
    parser.add_argument("--steps", type=int, default=20, help="chained [matmul, silu, mul, add] steps")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for the JSON result")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    backend = devgraph.device(args.device).name
    partial = PartialReport(args.out / f"replay_vs_eager_{backend}.json")
    report = run(args, on_row=partial.row_done)
    print(render(report))
    logger.info("wrote %s", partial.finish(report))
    for mode, row in report["results"].items():
        if row.get("max_abs_err", 0.0) > 1e-3:
            logger.error("%s output differs from eager by %.3g", mode, row["max_abs_err"])
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
