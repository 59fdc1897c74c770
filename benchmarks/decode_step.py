"""Decode-step latency: eager vs devgraph vs a hand-written CUDA graph vs torch.compile (issue 4).

Two bf16 decoders with random weights (built in ``_decode_workloads.py``), one decode step (one new
token per row) at a fixed context length, for each batch size:

* ``llama``: a transformers ``LlamaForCausalLM`` built in code (hidden 1024, 8 layers, 16 heads,
  8 KV heads, MLP 2816, vocab 32000, ``sdpa``), stepping over a static KV cache. The step is the
  Hugging Face adapter's own decode step (``devgraph.adapters.hf``): every method runs the very
  module ``GraphedCausalLM`` captures, on its one shared static cache.
* ``paged``: ``devgraph.testing.models.PagedDecoder`` at the same size, paged KV cache of 16-token
  blocks, batches built by ``KVBlockManager``. Both caches hold ``--context`` tokens of random K/V
  (written directly, no token-by-token prefill) and attend over ``context + 64`` slots.

Methods (columns):

| column | what one timed call is |
| --- | --- |
| ``eager`` | the step module called eagerly |
| ``devgraph`` | the devgraph wrapper's call: input copies into its buffers, bucket choice, replay |
| ``devgraph_replay`` | ``runner.graph(bucket).replay()`` alone (no input copies: devgraph's floor) |
| ``cuda_graph`` | ``graph.replay()`` of a ``torch.cuda.graph`` capture of the same step on static inputs |
| ``cuda_graph_copies`` | the same hand-written graph on buffers of its own, the step's inputs copied in before each replay (as an engine does; the fair baseline of a devgraph call) |
| ``torch_compile`` | ``torch.compile(step, mode="reduce-overhead")`` (CUDA graph trees), after compiling |

Each sample is one call between two timing events of the device (CUDA events on ``cuda``: start,
call, end, wait for end); tables report the median of ``--iters`` samples after ``--warmup`` untimed
calls. Before every call, and
outside the timed window, the static cache's write position is put back to ``--context`` (the HF
step advances it on the device), so every method times the same step on the same cache state.
Every method's output is compared with eager's first call, within a tolerance widened to twice
eager's own run-to-run difference (bf16 kernels at some batch sizes do not repeat to the bit).

devgraph's buckets are the defaults for ``max_batch_size = max(--batches)``; the script records their
capture seconds and the graph-pool bytes of all buckets against a runner that captured only the
largest. Targets (recorded pass/fail, misses included): devgraph within 5% of the hand-written
graph, at least 2x faster than eager at batch 1, pool of all buckets at most 1.25x the largest alone.

On ``cpu`` the devgraph columns run the *reference simulator* (a correctness backend that replays
recorded ops from Python, not a speed path); the CUDA-only columns and the targets are skipped with
the reason recorded. ``--quick`` shrinks everything (tiny models, few iterations) to exercise the
script anywhere in well under a minute.

    python benchmarks/decode_step.py --device cuda                   # everything (minutes)
    python benchmarks/decode_step.py --device cuda --models llama    # one model per process...
    python benchmarks/decode_step.py --device cuda --models paged --merge   # ...into one report
    python benchmarks/decode_step.py --device cpu --quick            # smoke run (< 1 min)

Writes ``<out>/decode_step_<backend>.json`` after every batch's row (``"complete": false`` until the
last model is done) and, with matplotlib, ``.png`` at the end (``_quick`` appended to the names under
``--quick``).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _common import DEFAULT_OUT, PartialReport, logger, pyplot, report_header, summarise, time_calls
from _decode_workloads import (
    BUILDERS,
    FULL_SHAPE,
    QUICK_SHAPE,
    Skip,
    Workload,
    attempt,
    capture_by_hand,
    pool_segment_bytes,
    release_memory,
)

import devgraph
from devgraph.runner import choose_bucket, default_batch_sizes

METHODS = ("eager", "devgraph", "devgraph_replay", "cuda_graph", "cuda_graph_copies", "torch_compile")
LABELS = {
    "eager": "eager",
    "devgraph": "devgraph (call)",
    "devgraph_replay": "devgraph (replay only)",
    "cuda_graph": "hand-written CUDA graph",
    "cuda_graph_copies": "hand-written CUDA graph + input copies",
    "torch_compile": 'torch.compile("reduce-overhead")',
}
#: Largest |output - eager| accepted, relative to max(1, |eager|.max()): graph replays run eager's
#: kernels; torch.compile fuses (and rounds bf16) differently.
TOLERANCE = {
    "eager": 1e-2,
    "devgraph": 1e-2,
    "devgraph_replay": 1e-2,
    "cuda_graph": 1e-2,
    "cuda_graph_copies": 1e-2,
    "torch_compile": 5e-2,
}
TARGETS = {"within_cuda_graph": 1.05, "speedup_at_batch1": 2.0, "pool_ratio": 1.25}
CPU_NOTE = "cpu backend: the reference simulator (correctness, not speed); CUDA-only columns skipped"


# -- measuring -----------------------------------------------------------------------------------


def time_method(
    dev: devgraph.Device,
    call: Callable[[], Any],
    prepare: Callable[[], None],
    args: argparse.Namespace,
    ref: torch.Tensor,
    tolerance: float,
    output: torch.Tensor | None = None,
    noise: float = 0.0,
) -> tuple[dict[str, Any], Any]:
    """Latency samples of ``call`` (``prepare`` runs before each, outside the events) and its error.

    ``output``: where the result lands when ``call`` returns nothing (a bare graph replay).
    ``noise``: how far eager's own last call lands from its first (bf16 kernels need not repeat to
    the bit); an output within twice that of eager's first matches, whatever ``tolerance`` says.
    """
    samples = time_calls(dev, call, args.iters, args.warmup, prepare)
    row: dict[str, Any] = summarise(samples)
    prepare()
    out = call()
    dev.synchronize()
    got = output if output is not None else out
    err = float((got.float() - ref).abs().max())
    row["max_abs_err"] = err
    row["matches_eager"] = err <= max(tolerance * max(1.0, float(ref.abs().max())), 2 * noise)
    return row, out


# -- the methods ---------------------------------------------------------------------------------


def cuda_graph_method(
    dev: devgraph.Device, wl: Workload, b: int, args: argparse.Namespace, ref: torch.Tensor, noise: float
) -> dict[str, Any]:
    """Capture the step by hand with ``torch.cuda.graph`` on static inputs; time ``replay()``."""
    prepare = functools.partial(wl.prepare, b)
    hand = capture_by_hand(dev, wl, b, own_inputs=False)
    try:
        row, _ = time_method(
            dev, hand.replay, prepare, args, ref, TOLERANCE["cuda_graph"], output=hand.output, noise=noise
        )
        row["capture_s"] = hand.capture_s
        row["segment_pool_bytes"] = pool_segment_bytes(dev, {tuple(hand.pool)})
    finally:
        hand.output = None
        hand.reset()
    return row


def cuda_graph_copies_method(
    dev: devgraph.Device, wl: Workload, b: int, args: argparse.Namespace, ref: torch.Tensor, noise: float
) -> dict[str, Any]:
    """The hand-written graph as an engine runs it: captured on buffers of its own, the step's input
    tensors copied into them before each ``replay()`` (what devgraph's call does for you)."""
    prepare = functools.partial(wl.prepare, b)
    hand = capture_by_hand(dev, wl, b, own_inputs=True)
    try:
        row, _ = time_method(
            dev, hand.step, prepare, args, ref, TOLERANCE["cuda_graph"], output=hand.output, noise=noise
        )
        row["capture_s"] = hand.capture_s
        row["copies"] = len(hand.copies)
    finally:
        hand.output = None
        hand.reset()
    return row


class SkipReasons(logging.Handler):
    """Collects inductor's "skipping cudagraphs due to ..." messages while attached."""

    #: The artifact logger ``torch._inductor.cudagraph_utils`` warns on (the reason a graph is not used).
    LOGGER = "torch._inductor.cudagraph_utils.__cudagraphs"

    def __init__(self) -> None:
        super().__init__()
        self.reasons: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "skipping cudagraphs" in message and message not in self.reasons:
            self.reasons.append(message[:300])

    def __enter__(self) -> SkipReasons:
        logging.getLogger(self.LOGGER).addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger(self.LOGGER).removeHandler(self)


def compile_one(
    dev: devgraph.Device, compiled: Any, wl: Workload, b: int, args: argparse.Namespace, ref: torch.Tensor
) -> dict[str, Any]:
    """Compile (first calls) and time the compiled step at batch ``b``."""
    from torch._dynamo.utils import counters

    kwargs = wl.inputs[b]

    def prepare() -> None:
        wl.prepare(b)
        torch.compiler.cudagraph_mark_step_begin()  # a new step: earlier outputs may be overwritten

    skips = counters["inductor"]["cudagraph_skips"]
    breaks = sum(counters["graph_break"].values())
    start = time.perf_counter()
    with SkipReasons() as skipped:
        for _ in range(3):  # compile, then CUDA graph trees warm up and record
            prepare()
            compiled(**kwargs)
        dev.synchronize()
    compile_s = time.perf_counter() - start
    row, _ = time_method(dev, lambda: compiled(**kwargs), prepare, args, ref, TOLERANCE["torch_compile"])
    row["compile_s"] = compile_s  # the first three calls: compile, warm-up, graph recording
    row["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"] - skips  # > 0: no CUDA graph used
    row["cudagraph_skip_reasons"] = skipped.reasons
    row["graph_breaks"] = sum(counters["graph_break"].values()) - breaks
    return row


def compile_methods(
    dev: devgraph.Device, wl: Workload, args: argparse.Namespace, refs: dict[int, torch.Tensor]
) -> dict[int, dict[str, Any]]:
    """``torch.compile(step, mode="reduce-overhead")`` per batch (one static-shape graph each)."""
    import torch._dynamo

    config = torch._dynamo.config
    for knob in ("recompile_limit", "cache_size_limit"):  # one recompile per batch size
        if hasattr(config, knob):
            setattr(config, knob, max(getattr(config, knob), 2 * len(args.batches)))
            break
    torch._dynamo.reset()
    compiled = torch.compile(wl.step, mode="reduce-overhead", dynamic=False)
    rows: dict[int, dict[str, Any]] = {}
    failed: str | None = None
    for b in args.batches:
        if failed is not None:
            rows[b] = {"skipped": f"not tried: torch.compile failed at a smaller batch ({failed})"}
            continue
        row, err = attempt(
            f"torch.compile of {wl.name} at batch {b}",
            lambda b=b: compile_one(dev, compiled, wl, b, args, refs[b]),
        )
        rows[b] = row if err is None else {"skipped": f"torch.compile failed: {err}"}
        failed = f"batch {b}: {err}" if err else None
    torch._dynamo.reset()
    try:
        from torch._inductor.cudagraph_trees import reset_cudagraph_trees

        reset_cudagraph_trees()
    except Exception:  # private API: releasing memory early is only a nicety
        logger.debug("could not reset CUDA graph trees", exc_info=True)
    return rows


def devgraph_methods(
    dev: devgraph.Device, wl: Workload, b: int, args: argparse.Namespace, ref: torch.Tensor, noise: float
) -> dict[str, Any]:
    """The devgraph call at batch ``b``, then the bare replay of its bucket's graph."""
    if wl.runner is None:
        reason = wl.devgraph.get("all_buckets_error", "unknown")
        skipped = {"skipped": f"devgraph capture failed: {reason}"}
        return {"devgraph": skipped, "devgraph_replay": dict(skipped)}
    prepare = functools.partial(wl.prepare, b)
    call, err = attempt(
        f"devgraph {wl.name} batch {b}",
        lambda: time_method(
            dev, lambda: wl.devgraph_call(b), prepare, args, ref, TOLERANCE["devgraph"], noise=noise
        ),
    )
    if call is None:
        return {"devgraph": {"error": err}, "devgraph_replay": {"skipped": "the devgraph call failed"}}
    row, output = call
    bucket = choose_bucket(b, wl.runner.sizes)
    row["bucket"] = bucket
    graph = wl.runner.graph(bucket)
    host = wl.runner.inputs.padded_host_args(wl.inputs[b], bucket) or None  # what the runner replays with
    replay, err = attempt(
        f"devgraph replay {wl.name} batch {b}",
        lambda: time_method(
            dev,
            lambda: graph.replay(host),
            prepare,
            args,
            ref,
            TOLERANCE["devgraph_replay"],
            output=output,  # the call's output view: a replay overwrites it
            noise=noise,
        )[0],
    )
    return {"devgraph": row, "devgraph_replay": replay or {"error": err}}


def batch_methods(
    dev: devgraph.Device, wl: Workload, b: int, args: argparse.Namespace
) -> tuple[dict[str, Any], torch.Tensor]:
    """Eager, devgraph and the hand-written graph at batch ``b``; also eager's output (the reference)."""
    kwargs = wl.inputs[b]
    prepare = functools.partial(wl.prepare, b)
    prepare()
    ref = wl.step(**kwargs).float().clone()
    row: dict[str, Any] = {}
    row["eager"], _ = time_method(dev, lambda: wl.step(**kwargs), prepare, args, ref, TOLERANCE["eager"])
    noise = row["eager"]["max_abs_err"]  # eager's last call vs its first: the step's own run-to-run noise
    row["eager"]["run_to_run_abs_err"] = noise
    row["eager"]["matches_eager"] = True  # eager is the reference; its noise widens the others' tolerance
    row.update(devgraph_methods(dev, wl, b, args, ref, noise))
    if dev.name == "cuda":
        for method, measure in (
            ("cuda_graph", cuda_graph_method),
            ("cuda_graph_copies", cuda_graph_copies_method),
        ):
            hand, err = attempt(
                f"hand-written CUDA graph ({method}) {wl.name} batch {b}",
                lambda measure=measure: measure(dev, wl, b, args, ref, noise),
            )
            row[method] = hand or {"error": err}
    else:
        skipped = {"skipped": f"torch.cuda.CUDAGraph needs CUDA; device is {dev.name}"}
        row["cuda_graph"], row["cuda_graph_copies"] = skipped, dict(skipped)
    return row, ref


def bench_workload(
    dev: devgraph.Device,
    wl: Workload,
    args: argparse.Namespace,
    on_row: Callable[[dict[str, Any]], None] = lambda batches: None,
) -> dict[str, Any]:
    """Every method at every batch; ratios per batch. ``on_row(batches so far)`` after each batch's
    row (the torch.compile column, measured last over all batches, is marked not measured yet)."""
    rows: dict[int, dict[str, Any]] = {}
    refs: dict[int, torch.Tensor] = {}
    for b in args.batches:
        logger.info("%s batch %d", wl.name, b)
        rows[b], refs[b] = batch_methods(dev, wl, b, args)
        release_memory(dev)
        rows[b]["torch_compile"] = {"skipped": "not measured yet (runs after every batch's other columns)"}
        rows[b]["ratios"] = ratios(rows[b])
        on_row({str(k): row for k, row in rows.items()})
    if dev.name != "cuda":
        compiled = {
            b: {"skipped": f'mode="reduce-overhead" means CUDA graphs; device is {dev.name}'}
            for b in args.batches
        }
    elif args.no_compile:
        compiled = {b: {"skipped": "--no-compile"} for b in args.batches}
    else:
        compiled = compile_methods(dev, wl, args, refs)
    for b in args.batches:
        rows[b]["torch_compile"] = compiled[b]
        rows[b]["ratios"] = ratios(rows[b])
    return {str(b): row for b, row in rows.items()}


def ratios(row: dict[str, Any]) -> dict[str, float | None]:
    def median(method: str) -> float | None:
        return row.get(method, {}).get("median_ms")

    def div(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    return {
        "devgraph_vs_cuda_graph": div(median("devgraph"), median("cuda_graph")),
        "devgraph_replay_vs_cuda_graph": div(median("devgraph_replay"), median("cuda_graph")),
        "devgraph_vs_cuda_graph_copies": div(median("devgraph"), median("cuda_graph_copies")),
        "eager_vs_devgraph": div(median("eager"), median("devgraph")),
        "eager_vs_cuda_graph": div(median("eager"), median("cuda_graph")),
        "torch_compile_vs_devgraph": div(median("torch_compile"), median("devgraph")),
    }


# -- targets, report -----------------------------------------------------------------------------


def evaluate_targets(name: str, result: dict[str, Any], applicable: str | None) -> list[dict[str, Any]]:
    """The three targets of issue 4 for one model; ``passed`` is None (with a reason) when unmeasured."""
    batches = result.get("batches", {})
    within = {b: r["ratios"]["devgraph_vs_cuda_graph"] for b, r in batches.items()}
    within = {b: v for b, v in within.items() if v is not None}
    fair = {b: r["ratios"].get("devgraph_vs_cuda_graph_copies") for b, r in batches.items()}
    fair = {b: v for b, v in fair.items() if v is not None}
    dg = result.get("devgraph", {})
    pool_key = "segment_pool_bytes" if dg.get("ratio_segment_pool_bytes") is not None else "stats_pool_bytes"
    specs = [
        (
            "devgraph_within_5pct_of_cuda_graph",
            "devgraph call median / hand-written CUDA graph median, worst batch",
            max(within.values()) if within else None,
            "<=",
            TARGETS["within_cuda_graph"],
            {"per_batch": within},
        ),
        (
            "devgraph_within_5pct_of_cuda_graph_with_copies",
            "devgraph call median / hand-written CUDA graph with its input copies median, worst batch",
            max(fair.values()) if fair else None,
            "<=",
            TARGETS["within_cuda_graph"],
            {"per_batch": fair},
        ),
        (
            "speedup_vs_eager_at_batch1",
            "eager median / devgraph call median at batch 1",
            batches.get("1", {}).get("ratios", {}).get("eager_vs_devgraph"),
            ">=",
            TARGETS["speedup_at_batch1"],
            {},
        ),
        (
            "pool_all_buckets_vs_largest_alone",
            f"graph pool bytes, all buckets / largest bucket alone ({pool_key})",
            dg.get(f"ratio_{pool_key}"),
            "<=",
            TARGETS["pool_ratio"],
            {"measure": pool_key},
        ),
    ]
    out = []
    for target, description, value, op, threshold, extra in specs:
        entry: dict[str, Any] = {"model": name, "target": target, "description": description}
        entry.update(value=value, op=op, threshold=threshold, **extra)
        if applicable is not None:
            entry.update(passed=None, reason=applicable)
        elif value is None:
            entry.update(passed=None, reason="not measured (see the model's skipped/error entries)")
        else:
            entry["passed"] = value <= threshold if op == "<=" else value >= threshold
            if target.startswith("devgraph_within_5pct"):
                entry["per_batch_passed"] = {b: v <= threshold for b, v in extra["per_batch"].items()}
        out.append(entry)
    return out


def mib(n: Any) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def render(report: dict[str, Any]) -> str:
    cfg = report["config"]
    backend = report["backend"] + (" (reference simulator: correctness, not speed)" if report["note"] else "")
    lines = [
        f"decode_step on {backend} -- {report['device_name']}, torch {report['torch']}",
        f"bf16, context {cfg['context']} tokens, median of {cfg['iters']} calls (ms)"
        + (" [--quick: tiny models]" if cfg["quick"] else ""),
        f"{'model':<7}{'batch':>6}{'eager':>10}{'devgraph':>10}{'dg replay':>11}{'cuda graph':>12}"
        f"{'graph+cp':>10}{'compile':>10}{'dg/graph':>10}{'dg/g+cp':>9}{'eager/dg':>10}",
    ]

    def cell(row: dict[str, Any], method: str, width: int) -> str:
        value = row.get(method, {}).get("median_ms")
        text = "-" if value is None else f"{value:.3f}"
        return (
            text.rjust(width) if row.get(method, {}).get("matches_eager", True) else (text + "!").rjust(width)
        )

    def ratio(value: float | None, width: int) -> str:
        return ("-" if value is None else f"{value:.2f}x").rjust(width)

    notes = []
    for name, result in report["models"].items():
        if "batches" not in result:
            lines.append(f"{name:<7}  {result.get('skipped') or result.get('error')}")
            continue
        for b, row in result["batches"].items():
            r = row["ratios"]
            lines.append(
                f"{name:<7}{b:>6}{cell(row, 'eager', 10)}{cell(row, 'devgraph', 10)}"
                f"{cell(row, 'devgraph_replay', 11)}{cell(row, 'cuda_graph', 12)}"
                f"{cell(row, 'cuda_graph_copies', 10)}"
                f"{cell(row, 'torch_compile', 10)}{ratio(r['devgraph_vs_cuda_graph'], 10)}"
                f"{ratio(r.get('devgraph_vs_cuda_graph_copies'), 9)}{ratio(r['eager_vs_devgraph'], 10)}"
            )
            for method in METHODS:
                why = row.get(method, {}).get("skipped") or row.get(method, {}).get("error")
                if why:
                    notes.append(f"{name} batch {b} {method}: {why}")
            if row["torch_compile"].get("cudagraph_skips"):
                reasons = "; ".join(row["torch_compile"].get("cudagraph_skip_reasons", [])) or "see the log"
                notes.append(f"{name} batch {b} torch_compile ran without CUDA graphs: {reasons}")
        dg = result["devgraph"]
        if "all_buckets" in dg:
            alone = dg.get("largest_alone", {})
            sizes = dg["all_buckets"]["sizes"]
            ratio_text = " / ".join(
                f"{dg[f'ratio_{k}_pool_bytes']:.2f}x ({k})"
                for k in ("segment", "stats")
                if dg.get(f"ratio_{k}_pool_bytes")
            )
            lines.append(
                f"  {name}: {len(sizes)} buckets ({sizes[0]}..{sizes[-1]}) captured in "
                f"{dg['all_buckets']['capture_seconds']:.2f} s; pool all buckets "
                f"{mib(dg['all_buckets']['segment_pool_bytes'])} (segments) / "
                f"{mib(dg['all_buckets']['stats_pool_bytes'])} (stats) vs largest alone "
                f"{mib(alone.get('segment_pool_bytes'))} / {mib(alone.get('stats_pool_bytes'))}"
                + (f": {ratio_text}" if ratio_text else "")
            )
        compile_s = {b: row["torch_compile"].get("compile_s") for b, row in result["batches"].items()}
        if any(v is not None for v in compile_s.values()):
            lines.append(
                f"  {name}: torch.compile first three calls (compile, warm-up, record), seconds: "
                + ", ".join(f"batch {b} {v:.1f}" for b, v in compile_s.items() if v is not None)
            )
        for key in ("largest_alone_error", "all_buckets_error"):
            if key in dg:
                notes.append(f"{name} devgraph {key}: {dg[key]}")
    lines.append("targets:")
    for t in report["targets"]:
        state = {True: "PASS", False: "MISS", None: "n/a "}[t["passed"]]
        value = "-" if t["value"] is None else f"{t['value']:.3f}"
        why = f" ({t['reason']})" if t.get("reason") else ""
        lines.append(f"  {state} {t['model']:<6} {t['target']}: {value} {t['op']} {t['threshold']}{why}")
    if notes:
        lines.append("skipped / failed:")
        lines.extend(f"  {n}" for n in notes)
    lines.append("(! = output differs from eager beyond tolerance)")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> bool:
    """Latency vs batch, one panel per model, one line per method; False when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return False
    models = {n: r["batches"] for n, r in report["models"].items() if "batches" in r}
    if not models:
        return False
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.8), squeeze=False)
    for ax, (name, rows) in zip(axes[0], models.items()):
        batches = sorted(int(b) for b in rows)
        for method in METHODS:
            points = [(b, rows[str(b)][method].get("median_ms")) for b in batches]
            points = [(b, v) for b, v in points if v is not None]
            if points:
                ax.plot(*zip(*points), marker="o", label=LABELS[method])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_xlabel("batch size")
        ax.set_ylabel("median step latency (ms)")
        ax.set_title(f"{name} decode step")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    title = f"{report['device_name']} ({report['backend']}), torch {report['torch']}, bf16"
    fig.suptitle(title + (" -- cpu reference simulator, not a speed path" if report["note"] else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# -- main ----------------------------------------------------------------------------------------


#: Config entries that must agree for --merge to combine two runs' models in one report.
MERGE_KEYS = ("batches", "context", "cache_len", "iters", "warmup", "quick", "seed", "shape")


def new_report(dev: devgraph.Device, args: argparse.Namespace) -> dict[str, Any]:
    return {
        **report_header(dev, "decode_step", note=CPU_NOTE),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "config": {
            "models": list(args.models),
            "batches": list(args.batches),
            "devgraph_buckets": default_batch_sizes(max(args.batches)),
            "context": args.context,
            "cache_len": args.cache_len,
            "iters": args.iters,
            "warmup": args.warmup,
            "quick": args.quick,
            "seed": args.seed,
            "shape": args.shape,
            "dtype": "bfloat16",
            "tolerance": TOLERANCE,
        },
        "timing": "per-call latency between device timing events (start, call, end, end.synchronize()); "
        "the cache's write position is reset before each call, outside the events",
        "models": {},
        "targets": [],
    }


def merge_previous(report: dict[str, Any], path: Path, args: argparse.Namespace) -> None:
    """Carry over the models this run does not measure from an earlier report at ``path``."""
    if not path.exists():
        logger.info("--merge: no earlier report at %s", path)
        return
    old = json.loads(path.read_text())
    differs = [k for k in MERGE_KEYS if old.get("config", {}).get(k) != report["config"][k]]
    if old.get("device_name") != report["device_name"]:
        differs.append("device_name")
    if differs:
        raise SystemExit(
            f"--merge: {path} was measured with a different {differs}; rerun every model instead"
        )
    for name, result in old.get("models", {}).items():
        if name not in args.models:
            report["models"][name] = result
            when = result.get("timestamp", result.get("date")) or old.get("timestamp", old.get("date"))
            logger.info("--merge: keeping %s from %s (%s)", name, path, when)


def measure_model(
    dev: devgraph.Device,
    name: str,
    args: argparse.Namespace,
    on_row: Callable[[dict[str, Any]], None] = lambda result: None,
) -> dict[str, Any]:
    """One model's whole result: skipped (why), error (what), or shape, devgraph capture and batches.

    ``on_row(result so far)`` after each batch's row.
    """
    logger.info("== %s", name)
    result: dict[str, Any] = {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    wl = None

    def row_done(batches: dict[str, Any]) -> None:
        result["batches"] = batches
        on_row(result)

    try:
        with torch.no_grad():
            wl = BUILDERS[name](dev, args)
            result.update(shape=wl.shape, devgraph=wl.devgraph)
            result["batches"] = bench_workload(dev, wl, args, row_done)
    except Skip as why:
        result["skipped"] = str(why)
    except Exception as exc:
        logger.error("%s failed:\n%s", name, traceback.format_exc())
        result["error"] = f"{type(exc).__name__}: {exc}"[:1000]
        result.pop("batches", None)
    finally:
        del wl
        release_memory(dev)
    return result


def save(report: dict[str, Any], stem: Path, *, complete: bool = True) -> bool:
    """Targets recomputed over every model in the report, then the JSON (``"complete"``: whether the
    run ended) and, when complete, the plot (True when plotted)."""
    applicable = (
        None if report["backend"] == "cuda" else f"targets apply to CUDA; device is {report['backend']}"
    )
    order = [n for n in BUILDERS if n in report["models"]]
    report["models"] = {n: report["models"][n] for n in order}
    report["targets"] = [t for n in order for t in evaluate_targets(n, report["models"][n], applicable)]
    partial = PartialReport(stem.with_suffix(".json"))
    if not complete:
        partial.row_done(report)
        return False
    partial.finish(report)
    return plot(report, stem.with_suffix(".png"))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="devgraph backend (default: best available)")
    parser.add_argument("--models", nargs="+", choices=sorted(BUILDERS), default=["llama", "paged"])
    parser.add_argument("--batches", nargs="+", type=int, default=None, help="default 1 8 32 128")
    parser.add_argument("--iters", type=int, default=None, help="timed calls per cell (default 300)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls per cell (default 20)")
    parser.add_argument("--context", type=int, default=None, help="cached tokens per row (default 256)")
    parser.add_argument("--cache-len", type=int, default=None, help="cache slots per row (context + 64)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    parser.add_argument("--quick", action="store_true", help="tiny models, few iterations (a smoke run)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for the JSON and PNG")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the other models' results from the report already in --out (models run separately)",
    )
    args = parser.parse_args(argv)
    quick = args.quick
    args.batches = sorted(set(args.batches or ([1, 8] if quick else [1, 8, 32, 128])))
    args.iters = args.iters or (10 if quick else 300)
    args.warmup = args.warmup if args.warmup is not None else (2 if quick else 20)
    args.context = args.context or (32 if quick else 256)
    args.cache_len = args.cache_len or args.context + (16 if quick else 64)
    args.shape = dict(QUICK_SHAPE if quick else FULL_SHAPE)
    buckets = default_batch_sizes(args.batches[-1]) if args.batches[0] >= 1 else []
    if not set(args.batches) <= set(buckets):
        parser.error(
            f"--batches {args.batches} must be devgraph buckets for max_batch_size={args.batches[-1]} "
            f"({buckets}), so that every method runs the same shapes without padding"
        )
    if args.cache_len <= args.context:
        parser.error(f"--cache-len ({args.cache_len}) must exceed --context ({args.context})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dev = devgraph.device(args.device)
    if dev.name == "cpu" and args.quick:
        torch.set_num_threads(1)  # tiny matmuls: threads only add barrier stalls on a busy machine
    report = new_report(dev, args)
    stem = args.out / (f"decode_step_{dev.name}" + ("_quick" if args.quick else ""))
    if args.merge:
        merge_previous(report, stem.with_suffix(".json"), args)
    plotted = False

    def row_done(name: str, result: dict[str, Any]) -> None:
        report["models"][name] = result
        save(report, stem, complete=False)  # after every row: a run cut short keeps what it measured

    for i, name in enumerate(args.models):
        report["models"][name] = measure_model(dev, name, args, functools.partial(row_done, name))
        plotted = save(report, stem, complete=i == len(args.models) - 1)
    print(render(report))
    logger.info("wrote %s.json%s", stem, " and .png" if plotted else "")
    failed = [n for n in args.models if "error" in report["models"][n]]
    for name in args.models:
        for b, row in report["models"][name].get("batches", {}).items():
            for method in ("devgraph", "devgraph_replay"):
                if row[method].get("matches_eager") is False:
                    failed.append(f"{name} batch {b} {method}")
                    logger.error(
                        "%s %s at batch %s differs from eager by %.3g",
                        name,
                        method,
                        b,
                        row[method]["max_abs_err"],
                    )
    if failed:
        logger.error("failed: %s", ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
