"""Breakable capture: build time vs piecewise and full, host time vs a hand-written loop, graphs and pool.

The model is devgraph's reference paged decoder (``devgraph.testing.models``), one decode step per
call, attention through ``devgraph::paged_decode_attention`` (a break by default).

1. **Build** (``devgraph.wrap(...).capture``) of every size, per mode: ``full`` (one graph per size,
   attention an updatable task), ``piecewise`` (Dynamo trace + split + per-piece capture),
   ``breakable`` (one breakable capture per size: no trace). Seconds, graph count, and the bytes the
   device's graph pools hold afterwards (on the CPU reference: what its pools reserved). Each
   mode's output on a new decode step is checked against eager (``max_abs_err``).
2. **Host time per call** of ``BreakableGraph.replay(host_args)`` against a hand-written loop over the
   very same segment graphs (``graph.replay()``, then the attention op called on its captured
   tensors with the new lengths). Samples alternate between the two, so machine noise hits both;
   the report gives medians and their ratio (goal: at most 1.5).

    python benchmarks/breakable.py                  # best device
    python benchmarks/breakable.py --device cpu     # reference simulator (correctness backend)

Writes ``<out>/breakable_<backend>.json`` and, when matplotlib is importable, ``breakable_<backend>.png``.
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _common import DEFAULT_OUT, PartialReport, logger, pyplot, report_header

import devgraph
from devgraph.testing.models import DecoderConfig, KVBlockManager, make_decoder

MODES = ("full", "piecewise", "breakable")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def model_config(args: argparse.Namespace, dev: devgraph.Device) -> DecoderConfig:
    return DecoderConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 2,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=max(1, args.heads // 2),
        block_size=16,
        max_blocks_per_seq=4,
        num_blocks=2 * max(args.sizes) * 4 + 2,
        dtype=torch.float32 if dev.name == "cpu" else torch.bfloat16,
    )


def _graph_count(graphed: Any, mode: str) -> int:
    runner = graphed.runner
    stats = graphed.stats
    if mode == "piecewise":
        return int(stats.pieces * len(stats.captured_sizes))
    counted = getattr(stats, "graphs", None)  # breakable mode counts its segment graphs
    return int(counted) if counted is not None else len(getattr(runner, "sizes", stats.captured_sizes))


def build(args: argparse.Namespace, dev: devgraph.Device, config: DecoderConfig) -> dict[str, Any]:
    """Capture every size in each mode: seconds, graphs, pool bytes, error against eager."""
    torch_device = dev.torch_device
    blocks = KVBlockManager(config, device=torch_device)
    ids = list(range(max(args.sizes)))
    example = blocks.decode_batch(ids, [i % 50 + 1 for i in ids])
    rows = min(3, len(ids))  # a padded batch where the sizes allow one
    step = blocks.decode_batch(ids[:rows], [7, 8, 9][:rows])
    results: dict[str, Any] = {}
    for mode in MODES:
        model = make_decoder(config, device=torch_device)
        # mode full: frontend='raw', the decoder's host lengths (host_args) are served without Dynamo only
        options: dict[str, Any] = {"batch_sizes": args.sizes, "frontend": "raw"}
        if mode == "piecewise":
            options = {"mode": mode, "capture_sizes": args.sizes}
        elif mode == "breakable":
            options = {"batch_sizes": args.sizes, "mode": mode}
        graphed = devgraph.wrap(model, device=dev, **options)
        gc.collect()
        before = dev.memory_stats().reserved
        start = time.perf_counter()
        with torch.inference_mode():
            graphed.capture(**example)
        dev.synchronize()
        seconds = time.perf_counter() - start
        with torch.inference_mode():
            eager = make_decoder(config, device=torch_device)
            eager.load_state_dict(model.state_dict())
            for layer, src in zip(eager.layers, model.layers):  # the same cache contents
                layer.k_cache.copy_(src.k_cache)
                layer.v_cache.copy_(src.v_cache)
            err = float((graphed(**step).float() - eager(**step).float()).abs().max())
        results[mode] = {
            "capture_seconds": seconds,
            "graphs": _graph_count(graphed, mode),
            "pool_bytes": dev.memory_stats().reserved - before,
            "sizes": list(graphed.stats.captured_sizes),
            "max_abs_err": err,
        }
        logger.info(
            "%-10s %7.3f s  %4d graphs  %9d pool bytes  err %.2e",
            mode,
            seconds,
            *list(results[mode].values())[1:3],
            err,
        )
        del graphed, model
    return results


def host_time(args: argparse.Namespace, dev: devgraph.Device, config: DecoderConfig) -> dict[str, Any]:
    """Per-call host time of a breakable replay and of a hand-written loop over the same graphs."""
    torch_device = dev.torch_device
    model = make_decoder(config, device=torch_device)
    blocks = KVBlockManager(config, device=torch_device)
    size = args.host_size
    ids = list(range(size))
    static = blocks.decode_batch(ids, [i % 50 + 1 for i in ids])
    bg = devgraph.BreakableGraph(dev)
    with torch.inference_mode():
        model(**static)
        with bg.capture(host_args={"seq_lens_host": static["seq_lens_host"]}):
            model(**static)
    graphs = bg.graphs
    calls = [b.call for b in bg.captured_breaks]
    position = 5  # seq_lens_host in paged_decode_attention's schema
    lens = [n + 1 for n in static["seq_lens_host"]]

    def breakable() -> None:
        bg.replay(host_args={"seq_lens_host": lens})

    def by_hand() -> None:
        for i, graph in enumerate(graphs):
            graph.replay()
            if i < len(calls):
                func, call_args, kwargs = calls[i]
                func(*call_args[:position], lens, *call_args[position + 1 :], **kwargs)

    def measure() -> dict[str, float]:
        samples: dict[str, list[float]] = {"breakable": [], "by_hand": []}
        with torch.inference_mode():
            for _ in range(args.warmup):
                breakable()
                by_hand()
            for i in range(args.iters):
                order = (("breakable", breakable), ("by_hand", by_hand))
                for name, fn in order if i % 2 == 0 else reversed(order):
                    dev.synchronize()
                    start = time.perf_counter()
                    fn()
                    dev.synchronize()
                    samples[name].append((time.perf_counter() - start) * 1e6)
        medians = {f"{k}_us": statistics.median(v) for k, v in samples.items()}
        medians["ratio"] = medians["breakable_us"] / medians["by_hand_us"]
        return medians

    real = measure()
    # Host overhead alone: every segment's replay and every break's kernel stubbed out, in both
    # loops alike (as benchmarks/host_overhead.py does for the other modes).
    for graph in graphs:
        graph._replay = lambda: None  # type: ignore[method-assign]
    for b in bg.captured_breaks:
        b._func = _noop
    calls = [(_noop, call_args, kwargs) for _, call_args, kwargs in calls]
    stubbed = measure()
    logger.info(
        "host us/call: replays %.1f vs %.1f by hand (%.3fx); host overhead alone %.1f vs %.1f (%.3fx)",
        real["breakable_us"],
        real["by_hand_us"],
        real["ratio"],
        stubbed["breakable_us"],
        stubbed["by_hand_us"],
        stubbed["ratio"],
    )
    return {
        "size": size,
        "segments": len(graphs),
        "breaks": len(calls),
        "with_replays": real,
        "host_overhead_only": stubbed,
        "goal_ratio": 1.5,
        "samples": args.iters,
    }


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


def plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    build = report["build"]
    left.bar(list(build), [build[m]["capture_seconds"] for m in build])
    left.set_ylabel("capture of every size (s)")
    left.set_title(f"build ({report['backend']}, {len(report['sizes'])} sizes)")
    host = report["host_time"]["host_overhead_only"]
    right.bar(["breakable replay", "hand-written loop"], [host["breakable_us"], host["by_hand_us"]])
    right.set_ylabel("host overhead per call (us, replays stubbed)")
    right.set_title(f"ratio {host['ratio']:.2f} (goal <= 1.5)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default=None, help="backend name (default: the best available)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--sizes", type=_ints, default=[1, 2, 4, 8], help="batch sizes to capture")
    parser.add_argument("--host-size", type=int, default=4, help="batch size of the host-time comparison")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="a smoke run: few sizes and samples")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.iters, args.warmup, args.layers = [1, 2], 10, 2, 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    dev = devgraph.device(args.device)
    config = model_config(args, dev)
    report = report_header(dev, "breakable")
    report.update(sizes=args.sizes, layers=args.layers, hidden=args.hidden)
    name = f"breakable_{dev.name}{'_quick' if args.quick else ''}"
    partial = PartialReport(args.out / f"{name}.json")  # each part on disk as soon as it is measured
    report["build"] = build(args, dev, config)
    partial.row_done(report)
    report["host_time"] = host_time(args, dev, config)
    path = partial.finish(report)
    plot(report, args.out / f"{name}.png")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
