"""A devgraph decode call against a hand-written graph with the same copies, side by side, explained (issue 43).

On an H100 the paged decoder's devgraph call measured 1.02-1.12x a hand-written CUDA graph making the
same five input copies (``decode_step.py``, whose columns run one after another), while devgraph's own
host time per call is 1-4 us above a hand loop (``host_overhead.py``). This script measures the gap so
that it is explained, not guessed. For each model (``--models``: the paged decoder, the HF Llama step;
``_decode_workloads.py``) and batch (a bucket, so that both sides copy the same rows), five ways of
running the same decode step, **interleaved in one loop** (every round runs each once, the order
rotating; ``_common.time_interleaved``):

| method | one call |
| --- | --- |
| ``devgraph`` | the devgraph call: read the arguments, checks, copies into its buffers, bucket, replay |
| ``devgraph_graph_hand_copies`` | the same copies written by hand into devgraph's own buffers, then its graph's replay: the call's Python removed, its graph and buffers kept |
| ``hand_copies`` | a hand-written graph (``torch.cuda.graph`` on CUDA; on other backends a devgraph ``Graph`` captured directly, no runner) on inputs of its own, the step's tensors copied in, replay |
| ``devgraph_replay`` | devgraph's graph replayed alone (no copies) |
| ``hand_replay`` | the hand-written graph replayed alone |

Each sample is the device time between two timing events around the call, and the calling thread's
host time inside it. The gap ``devgraph - hand_copies`` splits into the call's path (``devgraph -
devgraph_graph_hand_copies``) and the graph and buffers (``devgraph_graph_hand_copies -
hand_copies``).

Then, per method, a ``torch.profiler`` run of ``--profile-calls`` calls (each marked, the device waited
for after each) counts what one call issues: device kernels, memcpys and memsets (CUDA), the runtime
calls that launch them (``cudaLaunchKernel``, ``cudaGraphLaunch``, ``cudaMemcpyAsync``, any
synchronize), and the aten ops (on the CPU reference these are all there is); with, on CUDA, the host
microseconds from the call's start to its graph launch and the device's wait, busy and span time per
call. The difference of each count to ``hand_copies`` is in the report (``extra_vs_hand_copies``).

Last, the devgraph call's host time split by stage (reading the arguments; the checks: replaced
weights, the Python-value guard, the template match, the bucket; the load: the copies and the
padding's bookkeeping; the host arguments) against the hand loop's copies, each stage run alone two
ways: ``hot`` (right after itself, as in a tight loop: what ``host_overhead.py`` measures) and
``in_situ`` (right after a replay of the graph and a device synchronize, as in a decode loop, where
the caches hold the step before it, not the call's code). On the CPU reference the call's
bookkeeping costs about 6 times more in situ than hot (``benchmarks/README.md``).

Goal (recorded, CUDA only): the devgraph call within 1.05x of ``hand_copies`` at every model and batch.
On ``cpu`` the graphs are the reference simulator's (correctness, not speed): the numbers explain
what the call does, the goal reads n/a.

    python benchmarks/call_overhead.py --device cuda                        # paged; batches 1 8 32
    python benchmarks/call_overhead.py --device cuda --models paged llama
    python benchmarks/call_overhead.py --device cpu --quick                 # smoke run (seconds)

Writes ``<out>/call_overhead_<backend>.json`` after every batch (``"complete": false`` until the end;
``_quick`` appended under ``--quick``).
"""

from __future__ import annotations

import argparse
import collections
import functools
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _common import DEFAULT_OUT, PartialReport, logger, start, summarise, time_interleaved
from _decode_workloads import (
    BUILDERS,
    FULL_SHAPE,
    QUICK_SHAPE,
    HandGraph,
    Skip,
    Workload,
    capture_by_hand,
    release_memory,
)

import devgraph
from devgraph.runner import choose_bucket, default_batch_sizes

METHODS = ("devgraph", "devgraph_graph_hand_copies", "hand_copies", "devgraph_replay", "hand_replay")
GOAL = 1.05
TOLERANCE = 1e-2  # of max(1, |eager|), or twice eager's own run-to-run difference (bf16)
MARK = "call_overhead#"  # the profiler range around each profiled call
CPU_NOTE = (
    "cpu backend: the reference simulator's graphs (correctness, not speed); the counts explain the call"
)


# -- what one call issues: the profiler ----------------------------------------------------------------


def _is_runtime(name: str) -> bool:
    """A CUDA runtime or driver call (``cudaLaunchKernel``, ``cuGraphLaunch``...)."""
    return name.startswith("cuda") or (name.startswith("cu") and name[2:3].isupper())


def profile_calls(
    dev: devgraph.Device, call: Callable[[], Any], prepare: Callable[[], Any], n: int
) -> dict[str, Any]:
    """What each of ``n`` calls issues, counted by ``torch.profiler`` (per call: the mean count of
    each name), and on CUDA the host microseconds to the graph launch and the device's wait (call
    start to its first device work), busy and span time (medians over the calls)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.name == "cuda" else [])
    with profile(activities=activities) as prof:
        for i in range(n):
            prepare()
            dev.synchronize()
            with record_function(f"{MARK}{i}"):
                call()
            dev.synchronize()
    events = list(prof.events())
    windows = sorted(
        (e.time_range.start, e.time_range.end, int(e.name[len(MARK) :]))
        for e in events
        if e.name.startswith(MARK) and e.device_type == DeviceType.CPU
    )
    starts = [w[0] for w in windows] + [float("inf")]

    def window_of(t: float, upto_next: bool = False) -> int | None:
        for j, (s, e, _) in enumerate(windows):
            if s <= t <= (starts[j + 1] if upto_next else e):
                return j
        return None

    counts: list[collections.Counter[str]] = [collections.Counter() for _ in windows]
    runtime_call: dict[int, int] = {}  # correlation id -> call
    graph_launch: dict[int, float] = {}  # call -> first graph launch's start
    device: list[list[tuple[float, float]]] = [[] for _ in windows]
    for e in events:
        if e.name.startswith(MARK) or e.device_type != DeviceType.CPU:
            continue
        j = window_of(e.time_range.start)
        if j is None:
            continue
        if e.name.startswith("aten::"):
            counts[j][e.name] += 1
        elif _is_runtime(e.name):
            counts[j][f"runtime {e.name}"] += 1
            runtime_call[e.id] = j
            if "GraphLaunch" in e.name:
                graph_launch.setdefault(j, e.time_range.start)
    for e in events:
        if e.device_type == DeviceType.CPU or e.name.startswith(MARK):
            continue
        j = runtime_call.get(e.id)
        j = j if j is not None else window_of(e.time_range.start, upto_next=True)
        if j is None:
            continue
        kind = (
            "memcpy" if e.name.startswith("Memcpy") else "memset" if e.name.startswith("Memset") else "kernel"
        )
        counts[j][f"device {kind}"] += 1
        counts[j][f"{kind} {e.name[:120]}"] += 1
        device[j].append((e.time_range.start, e.time_range.end))
    total: collections.Counter[str] = collections.Counter()
    for c in counts:
        total.update(c)
    calls = max(len(windows), 1)
    row: dict[str, Any] = {
        "calls": len(windows),
        "per_call": {name: count / calls for name, count in sorted(total.items())},
        "host_us": statistics.median(e - s for s, e, _ in windows) if windows else None,
    }
    if dev.name == "cuda" and windows:
        waits, busy, spans, launch = [], [], [], []
        for j, (s, _, _) in enumerate(windows):
            spans_j = sorted(device[j])
            if not spans_j:
                continue
            waits.append(spans_j[0][0] - s)
            spans.append(max(e for _, e in spans_j) - spans_j[0][0])
            merged, (cur_s, cur_e) = 0.0, spans_j[0]
            for a, b in spans_j[1:]:
                if a > cur_e:
                    merged += cur_e - cur_s
                    cur_s, cur_e = a, b
                else:
                    cur_e = max(cur_e, b)
            busy.append(merged + cur_e - cur_s)
            if j in graph_launch:
                launch.append(graph_launch[j] - s)
        for key, values in (
            ("device_wait_us", waits),
            ("device_busy_us", busy),
            ("device_span_us", spans),
            ("host_us_to_graph_launch", launch),
        ):
            row[key] = statistics.median(values) if values else None
    return row


def extra_counts(row: dict[str, Any], base: dict[str, Any]) -> dict[str, float]:
    """Per-call counts where ``row`` differs from ``base`` (``row - base``), kernels by name left
    out where the totals agree (they are the graph's own)."""
    a, b = row.get("per_call", {}), base.get("per_call", {})
    return {
        n: round(a.get(n, 0.0) - b.get(n, 0.0), 3)
        for n in sorted(set(a) | set(b))
        if a.get(n, 0.0) != b.get(n, 0.0)
    }


# -- the call's host time by stage -------------------------------------------------------------------


def call_stages(dev: devgraph.Device, wl: Workload, b: int, hand: HandGraph, iters: int) -> dict[str, Any]:
    """The devgraph call's host microseconds at batch ``b``, by stage, against the hand loop's.

    Each stage (reading the arguments; the checks: replaced weights, the Python-value guard, the
    template match, the bucket; the load: the copies and the padding's bookkeeping; the host
    arguments) and the hand loop's copies, run alone ``iters`` times, two ways (medians, best of
    three rounds):

    * ``hot``: right after an untimed run of itself, as in a tight loop (what ``host_overhead.py``
      sees: everything it touches is in the caches);
    * ``in_situ``: right after a replay of the bucket's graph and a device synchronize, as in a
      decode loop, where the call runs after the step before it: what a call costs there.

    And, in situ, the whole call and the hand loop (``call``, ``hand_loop``: their host time, their
    own replay's launch included; on the CPU reference the replay runs there, so these two are the
    step's time). ``extra_in_situ``: what the call's bookkeeping adds to the copies it shares with
    the hand loop (read, checks, host args, and the load beyond the hand loop's copies).
    """
    runner = wl.runner
    part = runner.part
    inputs = runner.inputs
    kwargs = wl.inputs[b]
    call = inputs.read((), kwargs)
    buckets = part.buckets or []
    size = choose_bucket(call.batch, buckets)
    guard = runner.capture_loop.guard
    host = inputs.padded_host_args(call.host, size) if runner.config.host_args else None

    def checks() -> None:
        inputs.watch.replaced()
        if guard is not None:
            guard.changed()
        inputs.match(call, part.words.match)
        choose_bucket(call.batch, buckets)

    def hand_copies() -> None:
        for static, value in hand.copies:
            static.copy_(value)

    def replay() -> None:
        part.cut(part.replay(call, size, host), size, call.batch)

    def host_us(fn: Callable[[], Any], before: Callable[[], Any]) -> float:
        wl.prepare(b)  # the HF step advances its cache's write position: put it back, untimed
        before()
        dev.synchronize()
        t0 = time.perf_counter_ns()
        fn()
        t1 = time.perf_counter_ns()
        dev.synchronize()
        return (t1 - t0) / 1e3

    stages: dict[str, Callable[[], Any]] = {
        "read": lambda: inputs.read((), kwargs),
        "checks": checks,
        "load": lambda: inputs.load(call, size),
        "host_args": lambda: inputs.padded_host_args(call.host, size),
        "hand_copies": hand_copies,
    }
    whole = {"call": lambda: wl.devgraph_call(b), "hand_loop": hand.step}
    out: dict[str, dict[str, float]] = {"hot": {}, "in_situ": {}}
    for _ in range(3):
        for name, fn in stages.items():
            for how, before in (("hot", fn), ("in_situ", replay)):
                median = statistics.median(host_us(fn, before) for _ in range(iters))
                out[how][name] = min(out[how].get(name, float("inf")), median)
        for name, fn in whole.items():
            median = statistics.median(host_us(fn, replay) for _ in range(iters))
            out["in_situ"][name] = min(out["in_situ"].get(name, float("inf")), median)
    for row in out.values():
        row["extra"] = row["read"] + row["checks"] + row["host_args"] + row["load"] - row["hand_copies"]
    return {how: {k: round(v, 2) for k, v in row.items()} for how, row in out.items()}


# -- one batch -----------------------------------------------------------------------------------------


def batch_row(
    dev: devgraph.Device,
    wl: Workload,
    b: int,
    args: argparse.Namespace,
    save: Callable[[dict[str, Any]], None] = lambda row: None,
) -> dict[str, Any]:
    """Every method at batch ``b``: interleaved timings, outputs against eager, profiler counts, stages.

    ``save(row so far)`` after the timings and after the profiles: a profiler that fails hard (CUPTI
    and graph replays) cannot take the timings with it."""
    prepare = functools.partial(wl.prepare, b)
    kwargs = wl.inputs[b]
    prepare()
    ref = wl.step(**kwargs).float().clone()
    prepare()
    noise = float((wl.step(**kwargs).float() - ref).abs().max())  # eager's own run-to-run difference
    runner = wl.runner
    bucket = choose_bucket(b, runner.sizes)
    graph = runner.graph(bucket)
    host = runner.inputs.padded_host_args(kwargs, bucket) or None  # what the runner replays with
    tensors = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    ours = [(runner.inputs.rows(k, 0, b), v) for k, v in tensors.items()]
    hand = capture_by_hand(dev, wl, b, own_inputs=True)
    prepare()
    out = wl.devgraph_call(b)  # a view of graph memory: every replay of the bucket's graph rewrites it

    def ours_by_hand() -> None:
        for static, value in ours:
            static.copy_(value)
        graph.replay(host)

    calls: dict[str, Callable[[], Any]] = {
        "devgraph": lambda: wl.devgraph_call(b),
        "devgraph_graph_hand_copies": ours_by_hand,
        "hand_copies": hand.step,
        "devgraph_replay": lambda: graph.replay(host),
        "hand_replay": hand.replay,
    }
    lands = {"devgraph_graph_hand_copies": out, "hand_copies": hand.output, "devgraph_replay": out,
             "hand_replay": hand.output}  # fmt: skip
    row: dict[str, Any] = {"bucket": bucket, "copies": len(hand.copies), "eager_run_to_run_abs_err": noise}
    try:
        timed = time_interleaved(dev, calls, args.iters, args.warmup, prepare)
        for name, fn in calls.items():
            prepare()
            got = fn()
            dev.synchronize()
            got = lands.get(name, got)
            err = float((got.float() - ref).abs().max())
            row[name] = {
                "device": summarise(timed[name]["device_ms"]),
                "host": summarise(timed[name]["host_us"], unit="us"),
                "max_abs_err": err,
                "matches_eager": err <= max(TOLERANCE * max(1.0, float(ref.abs().max())), 2 * noise),
            }
        med = {name: row[name]["device"]["median_ms"] * 1e3 for name in calls}
        row["ratios"] = {
            "devgraph_vs_hand_copies": med["devgraph"] / med["hand_copies"],
            "devgraph_graph_hand_copies_vs_hand_copies": med["devgraph_graph_hand_copies"]
            / med["hand_copies"],
            "devgraph_replay_vs_hand_replay": med["devgraph_replay"] / med["hand_replay"],
        }

        def gap(a: str, b: str) -> float:  # the median of the rounds' differences: both ran in each round
            return statistics.median(
                (x - y) * 1e3 for x, y in zip(timed[a]["device_ms"], timed[b]["device_ms"])
            )

        row["gap_us"] = {
            "devgraph_minus_hand_copies": gap("devgraph", "hand_copies"),
            "call_path": gap("devgraph", "devgraph_graph_hand_copies"),
            "graph_and_buffers": gap("devgraph_graph_hand_copies", "hand_copies"),
            "copies_by_hand": gap("hand_copies", "hand_replay"),
            "copies_in_the_call": gap("devgraph", "devgraph_replay"),
            "replays": gap("devgraph_replay", "hand_replay"),
        }
        save(row)
        profiled: dict[str, Any] = {}
        for name, fn in calls.items() if args.profile_calls else ():
            try:
                profiled[name] = profile_calls(dev, fn, prepare, args.profile_calls)
            except Exception as exc:  # the profiler is an explanation: timings stand without it
                logger.warning("profiling %s failed:\n%s", name, traceback.format_exc())
                profiled[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        for name, prof in profiled.items():
            for base in ("hand_copies", "devgraph_graph_hand_copies"):
                if name != base and "per_call" in prof and "per_call" in profiled[base]:
                    prof[f"extra_vs_{base}"] = extra_counts(prof, profiled[base])
        row["profile"] = profiled
        save(row)
        row["stages_host_us"] = call_stages(dev, wl, b, hand, args.stage_iters)
    finally:
        hand.output = None
        hand.reset()
    return row


# -- the report ----------------------------------------------------------------------------------------


def measure_model(
    dev: devgraph.Device, name: str, args: argparse.Namespace, on_row: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    """One model's rows (skipped or failed with why); ``on_row(result so far)`` after each batch."""
    logger.info("== %s", name)
    result: dict[str, Any] = {"batches": {}}
    wl = None
    try:
        with torch.no_grad():
            wl = BUILDERS[name](dev, args)
            result.update(shape=wl.shape, devgraph=wl.devgraph)
            if wl.runner is None:
                raise RuntimeError(f"devgraph capture failed: {wl.devgraph.get('all_buckets_error')}")
            for b in args.batches:
                logger.info("%s batch %d", name, b)

                def save(row: dict[str, Any], b: int = b) -> None:
                    result["batches"][str(b)] = row
                    on_row(result)

                save(batch_row(dev, wl, b, args, save))
    except Skip as why:
        result["skipped"] = str(why)
    except Exception as exc:
        logger.error("%s failed:\n%s", name, traceback.format_exc())
        result["error"] = f"{type(exc).__name__}: {exc}"[:1000]
    finally:
        del wl
        release_memory(dev)
    return result


def goal(report: dict[str, Any]) -> dict[str, Any]:
    per = {
        f"{m} batch {b}": row["ratios"]["devgraph_vs_hand_copies"]
        for m, result in report["models"].items()
        for b, row in result.get("batches", {}).items()
        if "ratios" in row
    }
    applies = report["backend"] == "cuda"
    return {
        "goal": f"devgraph call within {GOAL}x of the hand-written graph with the same copies, every model and batch",
        "per_batch": per,
        "worst": max(per.values()) if per else None,
        "passed": (max(per.values()) <= GOAL) if applies and per else None,
        "reason": None if applies else f"applies to CUDA; device is {report['backend']}",
    }


def render(report: dict[str, Any]) -> str:
    lines = [
        f"call_overhead on {report['backend']} ({report['device_name']}), torch {report['torch']}; "
        f"medians of {report['config']['iters']} interleaved rounds, device us (host us)",
        f"{'model':<7}{'batch':>6}" + "".join(f"{m:>28}" for m in METHODS) + f"{'dg/hand':>9}",
    ]
    for name, result in report["models"].items():
        if not result.get("batches"):
            lines.append(f"{name:<7}  {result.get('skipped') or result.get('error')}")
            continue
        if "error" in result:
            lines.append(f"{name:<7}  failed after the rows below: {result['error']}")
        for b, row in result["batches"].items():
            cells = "".join(
                f"{row[m]['device']['median_ms'] * 1e3:>17.1f} ({row[m]['host']['median_us']:>6.1f})"
                + (" " if row[m]["matches_eager"] else "!")
                + " " * 2
                for m in METHODS
            )
            lines.append(f"{name:<7}{b:>6}{cells}{row['ratios']['devgraph_vs_hand_copies']:>8.3f}x")
            gap = row["gap_us"]
            lines.append(
                f"{'':13}gap {gap['devgraph_minus_hand_copies']:+.1f} us = call path {gap['call_path']:+.1f}"
                f" + graph and buffers {gap['graph_and_buffers']:+.1f}"
            )
            for base in ("devgraph_graph_hand_copies", "hand_copies"):
                extra = row.get("profile", {}).get("devgraph", {}).get(f"extra_vs_{base}")
                if extra is not None:
                    shown = {k: v for k, v in extra.items() if not k.startswith("kernel ")}
                    text = str(shown or "nothing")
                    lines.append(f"{'':13}the call issues per call beyond {base}: {text[:400]}")
            st = row.get("stages_host_us")
            if st is None:
                continue
            for how in ("hot", "in_situ"):
                h = st[how]
                lines.append(
                    f"{'':13}host us {how:>7}: read {h['read']} + checks {h['checks']} + load {h['load']} + host "
                    f"args {h['host_args']}, hand copies {h['hand_copies']}: the call's bookkeeping "
                    f"{h['extra']:+.2f} us"
                    + (f"; whole call {h['call']}, hand loop {h['hand_loop']}" if how == "in_situ" else "")
                )
    g = report["goal"]
    state = {True: "PASS", False: "MISS", None: "n/a "}[g["passed"]]
    worst = "-" if g["worst"] is None else f"{g['worst']:.3f}x"
    lines.append(f"{state} {g['goal']}: worst {worst}" + (f" ({g['reason']})" if g["reason"] else ""))
    lines.append("(! = output differs from eager beyond tolerance)")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="devgraph backend (default: best available)")
    parser.add_argument("--models", nargs="+", choices=sorted(BUILDERS), default=["paged"])
    parser.add_argument("--batches", nargs="+", type=int, default=None, help="buckets (default 1 8 32)")
    parser.add_argument("--iters", type=int, default=None, help="interleaved rounds (default 200)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed rounds (default 20)")
    parser.add_argument(
        "--profile-calls", type=int, default=None, help="profiled calls per method (10; 0: no profile)"
    )
    parser.add_argument("--stage-iters", type=int, default=None, help="calls per stage timing (100)")
    parser.add_argument("--context", type=int, default=None, help="cached tokens per row (256)")
    parser.add_argument("--cache-len", type=int, default=None, help="cache slots per row (context + 64)")
    parser.add_argument("--quick", action="store_true", help="tiny models, few iterations (a smoke run)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    quick = args.quick
    args.batches = sorted(set(args.batches or ([1] if quick else [1, 8, 32])))
    args.iters = args.iters or (10 if quick else 200)
    args.warmup = args.warmup if args.warmup is not None else (2 if quick else 20)
    if args.profile_calls is None:
        args.profile_calls = 3 if quick else 10
    args.stage_iters = args.stage_iters or (50 if quick else 100)
    args.context = args.context or (32 if quick else 256)
    args.cache_len = args.cache_len or args.context + (16 if quick else 64)
    args.shape = dict(QUICK_SHAPE if quick else FULL_SHAPE)
    args.pool_check = False  # the builders' capture of the largest bucket alone: not needed here
    buckets = default_batch_sizes(args.batches[-1])
    if not set(args.batches) <= set(buckets):
        parser.error(
            f"--batches {args.batches} must be devgraph buckets ({buckets}): both sides copy the same rows"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dev, header = start(args.device, "call_overhead")
    report: dict[str, Any] = {
        **header,
        "config": {
            "models": args.models,
            "batches": args.batches,
            "iters": args.iters,
            "warmup": args.warmup,
            "profile_calls": args.profile_calls,
            "stage_iters": args.stage_iters,
            "context": args.context,
            "cache_len": args.cache_len,
            "shape": args.shape,
            "dtype": "bfloat16",
            "quick": args.quick,
        },
        "timing": "interleaved rounds (order rotating); per call the device time between timing events and "
        "the host time inside the call; medians",
        "models": {},
    }
    partial = PartialReport(
        args.out / (f"call_overhead_{dev.name}" + ("_quick" if args.quick else "") + ".json")
    )

    def row_done(name: str, result: dict[str, Any]) -> None:
        report["models"][name] = result
        report["goal"] = goal(report)
        partial.row_done(report)

    for name in args.models:
        report["models"][name] = measure_model(dev, name, args, functools.partial(row_done, name))
        report["goal"] = goal(report)
    path = partial.finish(report)
    print(render(report))
    print(f"wrote {path}")
    failed = [n for n, r in report["models"].items() if "error" in r]
    failed += [
        f"{n} batch {b} {m}"
        for n, r in report["models"].items()
        for b, row in r.get("batches", {}).items()
        for m in METHODS
        if row.get(m, {}).get("matches_eager") is False
    ]
    if failed:
        logger.error("failed: %s", ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
