"""Paged decode attention kernels: the old whole-table float32 kernel vs the new ones, eager and graphed.

One decode step of attention (one query token per sequence) over a paged KV cache whose block
table has a fixed width (``--max-len`` tokens per sequence), at several batch sizes and context
lengths (the tokens each sequence really holds). Kernels, all called directly (no op dispatch):

| kernel | what runs |
| --- | --- |
| ``old`` | the previous CUDA kernel: gathers the whole block table, upcasts K/V to float32 |
| ``window`` | SDPA in the cache dtype over the whole block table (the new kernel's fallback path) |
| ``flex`` | the new CUDA kernel: compiled flex attention over the blocks in use |

Modes: ``eager`` (each call launched from Python) and ``graph``: per batch size, each kernel is
captured once in a ``torch.cuda.CUDAGraph`` (at the largest context), then replayed with every
context length copied into the device ``seq_lens``, as a decode loop would. The old kernel's
time should stay flat with the context (it always reads ``max-len`` tokens); flex's should grow
with it. Each sample is one call between CUDA events; the table shows medians. ``read GB/s`` is
the K/V bytes the context really holds divided by flex's graphed time.

    python benchmarks/paged_attention.py                  # CUDA (exits 0 with a message without one)
    python benchmarks/paged_attention.py --device cpu     # tiny sanity run on CPU (eager only)

Writes ``<out>/paged_attention_<gpu>.json`` (``<gpu>``: the device model as a slug, ``cpu`` on
CPU) after every row (``"complete": false`` until the end) and, when matplotlib is importable, a
``.png`` beside it. ``--reduced`` measures the grid's corners only (batches 1, 32; contexts 512, 8192). Exits 1 when a kernel's output
differs from the old kernel's by more than the dtype's tolerance.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _common import DEFAULT_OUT, PartialReport, logger, pyplot, report_header, summarise, time_calls

import devgraph
from devgraph.backends import _reference
from devgraph.backends.cuda import _kernels as cuda_kernels
from devgraph.backends.cuda import _paged_attention

KERNELS: dict[str, Callable[..., Any]] = {
    "old": _reference.paged_decode_attention_device_lens,
    "window": lambda q, k, v, bt, lens, scale, out: _paged_attention.window_decode(
        _reference.PagedAttentionArgs(q, k, v, bt, lens, [], scale, out)
    ),
    # The CUDA kernel with no window or soft cap: flex where it applies (the window otherwise).
    "flex": lambda q, k, v, bt, lens, scale, out: cuda_kernels.paged_decode_attention(
        q, k, v, bt, lens, [], scale, out
    ),
}
GPU = {"batches": [1, 8, 32, 128], "contexts": [128, 512, 2048, 8192], "max_len": 8192}
CPU = {"batches": [1, 2], "contexts": [16, 64], "max_len": 128}
#: ``--reduced``: the corners of the grid (smallest and a large batch, a short and the longest context).
REDUCED_GPU = {"batches": [1, 32], "contexts": [512, 8192]}
REDUCED_CPU = {"batches": [1], "contexts": [16]}
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def make_cache(args: argparse.Namespace, device: torch.device, batch: int) -> dict[str, Any]:
    """Query, caches and a block table for ``batch`` sequences of up to ``max_len`` tokens.

    Every sequence owns ``max_len / block_size`` distinct blocks (shuffled), so the old kernel's
    gather and flex's block list read real, scattered blocks.
    """
    gen = torch.Generator().manual_seed(batch)
    max_blocks = -(-args.max_len // args.block_size)
    num_blocks = batch * max_blocks + 1
    shape = (num_blocks, args.block_size, args.kv_heads, args.head_dim)
    cache = dict(
        q=torch.randn(batch, args.heads, args.head_dim, generator=gen).to(device, args.dtype),
        k=torch.randn(shape, dtype=args.dtype, device=device),
        v=torch.randn(shape, dtype=args.dtype, device=device),
        bt=torch.randperm(num_blocks, generator=gen)[: batch * max_blocks].view(batch, max_blocks),
        lens=torch.full((batch,), args.max_len, dtype=torch.int32, device=device),
    )
    cache["bt"] = cache["bt"].to(device, torch.int32)
    cache["out"] = torch.empty_like(cache["q"])
    return cache


def run(
    args: argparse.Namespace, on_row: Callable[[dict[str, Any]], None] = lambda report: None
) -> dict[str, Any]:
    """Every (batch, context) row; ``on_row(report)`` after each (the report so far)."""
    dev = devgraph.device(args.device)
    device = dev.torch_device
    scale = args.head_dim**-0.5
    rows: list[dict[str, Any]] = []
    report = {
        **report_header(dev, "paged_attention"),
        "workload": {
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "head_dim": args.head_dim,
            "block_size": args.block_size,
            "max_len": args.max_len,
            "dtype": str(args.dtype),
        },
        "grid": {"batches": list(args.batches), "contexts": list(args.contexts)},
        "iters": args.iters,
        "warmup": args.warmup,
        "timing": "per-call latency between device timing events; graph: replay of a CUDA graph "
        "captured once per batch, seq_lens rewritten per context",
        "results": rows,
    }
    for batch in args.batches:
        c = make_cache(args, device, batch)
        calls = {name: _bind(fn, c, scale) for name, fn in KERNELS.items()}
        graphs: dict[str, Any] = {}
        if dev.name == "cuda":
            for name, call in calls.items():
                try:
                    graphs[name] = _capture(call)
                except Exception as exc:  # recorded in the report, the run goes on
                    logger.error("capture of %s at batch %d failed: %s", name, batch, exc)
                    graphs[name] = exc
        for context in args.contexts:
            c["lens"].fill_(context)
            row: dict[str, Any] = {"batch": batch, "context": context, "max_len": args.max_len}
            expected = None
            for name, call in calls.items():
                row[name] = _measure(dev, call, args)
                out = c["out"].float().clone()
                if "eager_error" in row[name]:
                    pass  # out holds another kernel's result: nothing to compare
                elif expected is None:
                    expected = out
                else:
                    row[name]["max_abs_err_vs_old"] = float((out - expected).abs().max())
                graph = graphs.get(name)
                if isinstance(graph, Exception):
                    row[name]["graph_error"] = f"{type(graph).__name__}: {graph}"
                elif graph is not None and expected is not None:
                    samples = time_calls(dev, graph.replay, args.iters, args.warmup)
                    row[name]["graph"] = summarise([ms * 1000.0 for ms in samples], unit="us")
                    err = float((c["out"].float() - expected).abs().max())
                    row[name]["graph_max_abs_err_vs_old_eager"] = err
            kv_bytes = 2 * batch * context * args.kv_heads * args.head_dim * c["k"].element_size()
            row["kv_bytes_attended"] = kv_bytes
            flex_us = row["flex"].get("graph", row["flex"].get("eager", {})).get("median_us")
            row["flex_read_gb_per_s"] = kv_bytes / flex_us / 1e3 if flex_us else None
            rows.append(row)
            on_row(report)
            logger.info("batch %d context %d done", batch, context)
        del c, calls, graphs
        if dev.name == "cuda":
            torch.cuda.empty_cache()  # the next batch's caches and graph pools start from free memory
    return report


def _bind(kernel: Callable[..., Any], c: dict[str, Any], scale: float) -> Callable[[], Any]:
    return lambda: kernel(c["q"], c["k"], c["v"], c["bt"], c["lens"], scale, c["out"])


def _capture(call: Callable[[], Any]) -> Any:
    from _common import cuda_graph_capture

    graph, _, _ = cuda_graph_capture(call)
    return graph


def _measure(dev: devgraph.Device, call: Callable[[], Any], args: argparse.Namespace) -> dict[str, Any]:
    try:
        samples = time_calls(dev, call, args.iters, args.warmup)
    except Exception as exc:  # out of memory, a compile failure: recorded, the run goes on
        logger.error("%s", exc)
        return {"eager_error": f"{type(exc).__name__}: {str(exc)[:500]}"}
    return {"eager": summarise([ms * 1000.0 for ms in samples], unit="us")}


def _us(cell: dict[str, Any], mode: str) -> str:
    stats = cell.get(mode)
    return f"{stats['median_us']:.1f}" if stats else "-"


def render(report: dict[str, Any]) -> str:
    w = report["workload"]
    lines = [
        f"paged decode attention on {report['backend']} -- {report['device_name']}, torch {report['torch']}",
        f"Hq {w['heads']}, Hkv {w['kv_heads']}, D {w['head_dim']}, block {w['block_size']}, "
        f"table width {w['max_len']} tokens, {w['dtype']}; median us per call",
        f"{'batch':>6}{'context':>9}"
        + "".join(f"{k + ' ' + m:>14}" for k in KERNELS for m in ("eager", "graph"))
        + f"{'read GB/s':>11}{'max err':>10}",
    ]
    for row in report["results"]:
        errs = [row[k].get("max_abs_err_vs_old", 0.0) for k in KERNELS if k != "old"]
        gbs = row["flex_read_gb_per_s"]
        lines.append(
            f"{row['batch']:>6}{row['context']:>9}"
            + "".join(f"{_us(row[k], m):>14}" for k in KERNELS for m in ("eager", "graph"))
            + f"{(f'{gbs:.0f}' if gbs else '-'):>11}{max(errs):>10.1e}"
        )
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> bool:
    """Latency vs context, one panel per batch, one line per kernel and mode; False without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    batches = sorted({row["batch"] for row in report["results"]})
    fig, axes = plt.subplots(1, len(batches), figsize=(4 * len(batches), 3.6), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        rows = [r for r in report["results"] if r["batch"] == batch]
        for kernel in KERNELS:
            for mode in ("eager", "graph"):
                ys = [r[kernel].get(mode, {}).get("median_us") for r in rows]
                if all(y is not None for y in ys):
                    ax.plot([r["context"] for r in rows], ys, marker="o", label=f"{kernel} {mode}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"batch {batch}")
        ax.set_xlabel("context tokens")
    axes[0][0].set_ylabel("us per call")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(
        f"paged decode attention, table width {report['workload']['max_len']} ({report['device_name']})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _slug(report: dict[str, Any]) -> str:
    if report["backend"] == "cpu":
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "_", report["device_name"].lower()).strip("_") or report["backend"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (tiny sanity run)")
    parser.add_argument("--batches", type=_ints, default=None, help="comma-separated batch sizes")
    parser.add_argument("--contexts", type=_ints, default=None, help="comma-separated context lengths")
    parser.add_argument("--max-len", type=int, default=None, help="block table width in tokens")
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--kv-heads", type=int, default=None)
    parser.add_argument("--head-dim", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument(
        "--reduced",
        action="store_true",
        help="the grid's corners only: batches 1,32 x contexts 512,8192 on a GPU (1 x 16 on cpu); "
        "--batches/--contexts still win",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("paged_attention: no CUDA GPU visible; nothing measured (--device cpu runs a sanity check)")
        return 0
    gpu = args.device != "cpu"
    defaults = {
        **(GPU if gpu else CPU),
        **((REDUCED_GPU if gpu else REDUCED_CPU) if args.reduced else {}),
        "heads": 32 if gpu else 4,
        "kv_heads": 8 if gpu else 2,
        "head_dim": 128 if gpu else 16,
        "dtype": "bfloat16" if gpu else "float32",
        "iters": 50 if gpu else 3,
        "warmup": 5 if gpu else 1,
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.dtype = getattr(torch, args.dtype)
    if not gpu:
        torch.set_num_threads(1)  # tiny kernels: OpenMP wake-ups dominate otherwise
    if max(args.contexts) > args.max_len:
        parser.error(f"contexts {args.contexts} exceed --max-len {args.max_len}")

    stem = (
        args.out / f"paged_attention_{_slug(report_header(devgraph.device(args.device), 'paged_attention'))}"
    )
    partial = PartialReport(stem.with_suffix(".json"))
    report = run(args, on_row=partial.row_done)
    print(render(report))
    partial.finish(report)
    plotted = plot(report, stem.with_suffix(".png"))
    logger.info("wrote %s.json%s", stem, " and .png" if plotted else "")
    tolerance = TOLERANCE[args.dtype]
    bad = [
        (row["batch"], row["context"], kernel)
        for row in report["results"]
        for kernel, cell in ((k, row[k]) for k in KERNELS)
        if "eager_error" in cell
        or "graph_error" in cell
        or max(cell.get("max_abs_err_vs_old", 0.0), cell.get("graph_max_abs_err_vs_old_eager", 0.0))
        > tolerance
    ]
    if bad:
        logger.error(
            "failed or differs from the old kernel beyond %.0e at (batch, context, kernel) %s", tolerance, bad
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
