"""Piecewise graphs: prefill eager vs piecewise, decode eager vs full vs piecewise, build time.

The model is devgraph's reference paged decoder (``devgraph.testing.models``) at a size where
launch overhead and compute both matter. Every token is a row, so a prefill of T tokens is T rows
(``T / seq_len`` sequences of ``--seq-len`` tokens); a decode step is one row per sequence. Modes:

| mode | what runs |
| --- | --- |
| ``eager`` | the model's forward, op by op |
| ``piecewise`` | ``devgraph.wrap(mode="piecewise")``: the pieces between attention ops replay their graphs, attention runs eagerly |
| ``full`` | ``devgraph.wrap(mode="full")``: one graph per decode batch size (decode only) |

Each sample times one call between two device timing events; the table and JSON report medians.
Build time is trace + compile (Dynamo, passes, split, per-piece compile) and capture of every size.

    python benchmarks/piecewise.py                      # best device (CUDA when present)
    python benchmarks/piecewise.py --device cpu         # reference simulator smoke run (small sizes)

Writes ``<out>/piecewise_<backend>.json`` after every row (``"complete": false`` until the end) and,
when matplotlib is importable, a plot ``piecewise_<backend>.png``.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch
from _common import DEFAULT_OUT, PartialReport, logger, pyplot, report_header, time_calls

import devgraph
from devgraph.testing.models import DecoderConfig, KVBlockManager, make_decoder

GPU_PREFILL = [64, 128, 256, 512, 1024, 2048, 4096]
GPU_DECODE = [1, 8, 32, 64]
CPU_PREFILL = [16, 32, 64]
CPU_DECODE = [1, 4, 8]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def model_config(args: argparse.Namespace, dev: devgraph.Device, tokens: int) -> DecoderConfig:
    blocks_per_seq = -(-args.seq_len // args.block_size)
    sequences = -(-tokens // args.seq_len) + max(args.decode_sizes)
    return DecoderConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=max(1, args.heads // 4),
        block_size=args.block_size,
        max_blocks_per_seq=blocks_per_seq,
        num_blocks=sequences * blocks_per_seq + 2,
        dtype=torch.bfloat16 if dev.name == "cuda" else torch.float32,
    )


def prefill_batch(manager: KVBlockManager, first_id: int, tokens: int, seq_len: int) -> dict[str, Any]:
    """``tokens`` rows: sequences of ``seq_len`` prompt tokens (the last one shorter), as one call."""
    rows, sid, left = [], first_id, tokens
    while left > 0:
        n = min(seq_len, left)
        rows += [manager.decode_batch([sid], [(sid * 31 + t) % 97 + 1]) for t in range(n)]
        sid, left = sid + 1, left - n
    batch = {k: torch.cat([r[k] for r in rows]) for k in rows[0] if k != "seq_lens_host"}
    batch["seq_lens_host"] = [x for r in rows for x in r["seq_lens_host"]]
    return batch


def run(
    args: argparse.Namespace, on_row: Callable[[dict[str, Any]], None] = lambda report: None
) -> dict[str, Any]:
    """Prefill rows, then decode rows; ``on_row(report)`` after each (the report so far)."""
    dev = devgraph.device(args.device)
    config = model_config(args, dev, max(args.prefill_sizes))
    torch_device = dev.torch_device
    eager = make_decoder(config, device=torch_device)
    results: dict[str, Any] = {"prefill": {}, "decode": {}, "build_seconds": {}}
    err: dict[str, float] = {}
    report = {
        **report_header(dev, "piecewise"),
        "model": {k: str(v) for k, v in attrs.asdict(config).items()},
        "seq_len": args.seq_len,
        "compile_backend": args.compile_backend or "device default",
        "iters": args.iters,
        "warmup": args.warmup,
        "timing": "median per-call latency between device timing events",
        "max_abs_err_vs_eager": err,
        "results": results,
    }

    def median_us(call: Callable[[], Any]) -> float:
        return 1000.0 * statistics.median(time_calls(dev, call, args.iters, args.warmup))

    # -- prefill: eager vs piecewise ------------------------------------------------------------
    pw_model = make_decoder(config, device=torch_device)
    piecewise = devgraph.wrap(
        pw_model,
        device=dev,
        mode="piecewise",
        capture_sizes=args.prefill_sizes,
        compile_backend=args.compile_backend,
    )
    manager = KVBlockManager(config, device=torch_device)
    batches = {t: prefill_batch(manager, 1000 * i, t, args.seq_len) for i, t in enumerate(args.prefill_sizes)}
    start = time.perf_counter()
    with torch.inference_mode():
        piecewise.capture(**batches[args.prefill_sizes[0]])
    dev.synchronize()
    results["build_seconds"]["piecewise_prefill"] = {
        "total": time.perf_counter() - start,
        "compile": piecewise.stats.compile_seconds,
        "capture": piecewise.stats.capture_seconds,
        "sizes": len(piecewise.stats.captured_sizes),
        "pieces": piecewise.stats.pieces,
    }
    with torch.inference_mode():
        for t, batch in batches.items():
            row: dict[str, float] = {}
            row["eager_us"] = median_us(lambda b=batch: eager(**b))
            row["piecewise_us"] = median_us(lambda b=batch: piecewise(**b))
            row["speedup"] = row["eager_us"] / row["piecewise_us"]
            results["prefill"][t] = row
            err[f"prefill {t}"] = float((piecewise(**batch).float() - eager(**batch).float()).abs().max())
            on_row(report)

    # -- decode: eager vs full vs piecewise -----------------------------------------------------
    full_model = make_decoder(config, device=torch_device)
    full = devgraph.wrap(
        full_model, device=dev, frontend="raw", batch_sizes=args.decode_sizes
    )  # the decoder's host lengths: served by the raw path only
    pw_decode = devgraph.wrap(
        make_decoder(config, device=torch_device),
        device=dev,
        mode="piecewise",
        capture_sizes=args.decode_sizes,
        compile_backend=args.compile_backend,
    )
    manager = KVBlockManager(config, device=torch_device)
    largest = max(args.decode_sizes)
    ids = list(range(largest))
    with torch.inference_mode():
        for step in range(args.context):  # some context for every sequence, through the eager model
            batch = manager.decode_batch(ids, [(i + step) % 97 + 1 for i in ids])
            eager(**batch)
            full_model(**batch)
            pw_decode.module(**batch)
        # One decode step per size at the sequences' current length (re-runnable: it writes the same
        # slots every time it is called).
        step_batches = {b: manager.decode_batch(ids[:b], [7] * b) for b in args.decode_sizes}
        start = time.perf_counter()
        full.capture(**step_batches[largest])
        dev.synchronize()
        full_seconds = time.perf_counter() - start
        start = time.perf_counter()
        pw_decode.capture(**step_batches[largest])
        dev.synchronize()
        results["build_seconds"]["full_decode"] = {
            "total": full_seconds,
            "capture": full.stats.capture_seconds,
        }
        results["build_seconds"]["piecewise_decode"] = {
            "total": time.perf_counter() - start,
            "compile": pw_decode.stats.compile_seconds,
            "capture": pw_decode.stats.capture_seconds,
        }
        for b, batch in step_batches.items():
            row = {
                "eager_us": median_us(lambda x=batch: eager(**x)),
                "full_us": median_us(lambda x=batch: full(**x)),
                "piecewise_us": median_us(lambda x=batch: pw_decode(**x)),
            }
            results["decode"][b] = row
            want = eager(**batch).float()
            err[f"decode full {b}"] = float((full(**batch).float() - want).abs().max())
            err[f"decode piecewise {b}"] = float((pw_decode(**batch).float() - want).abs().max())
            on_row(report)
    return report


def render(report: dict[str, Any]) -> str:
    r = report["results"]
    lines = [f"piecewise on {report['backend']} ({report['device_name']}), torch {report['torch']}", ""]
    lines.append(f"{'prefill tokens':>15}{'eager us':>12}{'piecewise us':>14}{'speedup':>9}")
    for t, row in r["prefill"].items():
        lines.append(f"{t:>15}{row['eager_us']:>12.1f}{row['piecewise_us']:>14.1f}{row['speedup']:>8.2f}x")
    lines.append("")
    lines.append(f"{'decode batch':>15}{'eager us':>12}{'full us':>10}{'piecewise us':>14}")
    for b, row in r["decode"].items():
        lines.append(f"{b:>15}{row['eager_us']:>12.1f}{row['full_us']:>10.1f}{row['piecewise_us']:>14.1f}")
    lines.append("")
    for what, row in r["build_seconds"].items():
        lines.append(
            f"build {what}: "
            + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items())
        )
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> bool:
    """A two-panel plot (prefill, decode latency); False when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return False
    r = report["results"]
    panels = [
        ("prefill latency (us) vs tokens", r["prefill"], ["eager_us", "piecewise_us"]),
        ("decode latency (us) vs batch", r["decode"], ["eager_us", "full_us", "piecewise_us"]),
    ]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (title, rows, keys) in zip(axes, panels):
        xs = [int(x) for x in rows]
        for key in keys:
            ax.plot(xs, [rows[x][key] for x in rows], marker="o", label=key.removesuffix("_us"))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(title)
        ax.legend()
    fig.suptitle(f"devgraph piecewise on {report['backend']} ({report['device_name']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="devgraph backend (default: best available)")
    parser.add_argument("--prefill-sizes", type=_ints, default=None, help="comma-separated token counts")
    parser.add_argument("--decode-sizes", type=_ints, default=None, help="comma-separated batch sizes")
    parser.add_argument(
        "--compile-backend", default=None, help="eager, inductor, torchair (default: device's)"
    )
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per prefill sequence")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--context", type=int, default=None, help="tokens per sequence before decode")
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    gpu = devgraph.device(args.device).name != "cpu"
    defaults = {
        "prefill_sizes": GPU_PREFILL if gpu else CPU_PREFILL,
        "decode_sizes": GPU_DECODE if gpu else CPU_DECODE,
        "layers": 8 if gpu else 2,
        "hidden": 1024 if gpu else 64,
        "heads": 16 if gpu else 4,
        "vocab": 32000 if gpu else 256,
        "seq_len": 256 if gpu else 32,
        "context": 64 if gpu else 8,
        "iters": 50 if gpu else 5,
        "warmup": 5 if gpu else 1,
        "compile_backend": "inductor" if gpu else None,
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if not gpu:
        torch.set_num_threads(1)  # tiny kernels: OpenMP wake-ups dominate otherwise

    stem = args.out / f"piecewise_{devgraph.device(args.device).name}"
    partial = PartialReport(stem.with_suffix(".json"))
    report = run(args, on_row=partial.row_done)
    print(render(report))
    partial.finish(report)
    plotted = plot(report, stem.with_suffix(".png"))
    logger.info("wrote %s.json%s", stem, " and .png" if plotted else "")
    tolerance = 0.1 if gpu else 1e-3
    bad = {k: v for k, v in report["max_abs_err_vs_eager"].items() if v > tolerance}
    if bad:
        logger.error("outputs differ from eager beyond %.0e: %s", tolerance, bad)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
