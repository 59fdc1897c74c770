"""A speculative draft of k steps: one merged graph against k replays of one step's graph (issue 47).

The draft is devgraph's reference ``PagedDecoder`` (``--layers`` layers, hidden 64, paged attention:
one updatable task per layer) drafting ``k`` tokens for ``--batch`` rows; every step's metadata
(positions, slots, block tables, lengths growing by one per step) is built on the host before the
draft runs (``devgraph.testing.speculative``). Per spec step (one draft of k tokens) two ways:

* ``merged``: the k steps captured as one ``devgraph.graph.MultiStepGraph``; the metadata copied in,
  one ``replay`` giving every step its host lengths: one update.
* ``separate``: one step captured once, replayed k times, each with its host lengths (k updates), the
  step's metadata copied in before each and its token copied out after.

Reported per k: host time per spec step and per draft step (the calling thread's CPU time,
``time.thread_time``, median of ``--iters`` interleaved samples), the calls each makes per spec step
(device-wide and stream/event host syncs, update submissions, replays), capture seconds and pool bytes.
Before timing, both ways' tokens are checked equal to k eager steps (exit 1 if not).

Per k also a whole greedy speculative loop served by ``devgraph.runner.GraphFamilies`` (decode,
verify at ``k + 1`` tokens per request, the merged draft, the draft's plain step; one pool, one
budget): per family its graphs, capture seconds, pool growth during its capture and replays, and the
acceptance rate; its tokens and acceptance are checked equal to the same loop run eagerly (exit 1 if
not). On ``npu`` this loop runs on the simulator's eager streams (it reads tokens between calls).

On ``cpu`` the graphs are the **reference backend**, which re-executes the recorded ops from Python:
the time is mostly the draft's compute. On ``npu`` the device is devgraph's **torch_npu simulator**
(tests/sim) in lazy mode: only the host calls are timed, the device work runs at an untimed
synchronize after each sample; ``sim_us`` is the time spent inside the simulator (its torch_npu calls
and its recording of each re-issued op), ``own_us`` the rest. No figure here is an Ascend figure.

    python benchmarks/spec_draft.py                       # cpu and npu (simulator), k = 2, 4, 8
    python benchmarks/spec_draft.py --quick               # smoke run (seconds)

Writes ``<out>/spec_draft<_quick>.json`` after every row (``"complete": false`` until the end).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from _common import DEFAULT_OUT, PartialReport, report_header
from npu_update_order import instrument

import devgraph
from devgraph.runner import GraphFamilies, RunnerConfig
from devgraph.testing.models import DecoderConfig, KVBlockManager, PagedDecoder, make_decoder
from devgraph.testing.speculative import (
    MergedDraft,
    SeparateDraft,
    draft_metadata,
    eager_draft,
    eager_families,
    perturbed_draft,
    speculative_decode,
)

NOTE = (
    "host figures on a shared 2-core CPU machine (torch CPU build): 'cpu' is the reference backend (a "
    "correctness backend re-executing recorded ops, not a speed path); 'npu' is devgraph's torch_npu "
    "simulator, not Ascend hardware"
)
SYNCS = ("synchronize", "Stream.synchronize", "Event.synchronize")
#: Metadata rounds precomputed per k and replayed in turn (the lengths cycle; the KV cache is rewritten).
ROUNDS = 4


def _config(backend: str, layers: int, k: int, rounds: int) -> DecoderConfig:
    blocks_per_seq = 2 + (40 + k * rounds) // 16
    return DecoderConfig(
        num_layers=layers,
        max_blocks_per_seq=blocks_per_seq,
        num_blocks=2 + 8 * blocks_per_seq,
        dtype=torch.bfloat16 if backend == "npu" else torch.float32,
    )


@contextlib.contextmanager
def _device(backend: str) -> Iterator[tuple[devgraph.Device, Any]]:
    if backend == "cpu":
        yield devgraph.device("cpu"), None
        return
    from devgraph_sim.npu import simulated_torch_npu

    with simulated_torch_npu(streams="lazy") as sim:
        yield devgraph.device("npu"), sim


@contextlib.contextmanager
def _counting(dev: devgraph.Device, sim: Any, graph: devgraph.Graph) -> Iterator[tuple[Counter, list[float]]]:
    """The calls of the block: the simulator's torch_npu calls (npu), or the device's synchronize and
    the graph's update (cpu); and (a one-item list) the seconds spent inside the simulator."""
    if sim is not None:
        with instrument(sim, clock=time.thread_time) as probe:
            seconds = [0.0]
            yield probe.counts, seconds
        seconds[0] = probe.seconds
        return
    counts: Counter = Counter()
    saved = []
    for owner, attr in ((dev, "synchronize"), (graph, "update")):
        real = getattr(owner, attr)
        setattr(owner, attr, lambda *a, _r=real, _n=attr, **k: counts.update([_n]) or _r(*a, **k))
        saved.append((owner, attr))
    try:
        yield counts, [0.0]
    finally:
        for owner, attr in saved:
            delattr(owner, attr)  # the class's method again


def _calls(counts: Counter, sim: Any) -> dict[str, int]:
    if sim is None:
        return {"device_syncs": counts["synchronize"], "update_submissions": counts["update"]}
    return {
        "host_syncs": sum(counts[name] for name in SYNCS),
        "update_submissions": counts["stream"],  # entries onto the update stream
        "fences": counts["Stream.wait_stream"],
        "task_update_begins": counts["graph_task_update_begin"],
        "replays": counts["NPUGraph.replay"],
    }


def measure(backend: str, k: int, layers: int, batch: int, iters: int) -> dict[str, Any]:
    with _device(backend) as (dev, sim):
        config = _config(backend, layers, k, ROUNDS)
        where = dev.torch_device
        models = {
            name: make_decoder(config, seed=5, device=where) for name in ("eager", "merged", "separate")
        }
        manager = KVBlockManager(config, device=where)
        rows = list(range(batch))
        with torch.no_grad():  # prompts of 8..8+batch tokens, prefilled in every model
            for t in range(7 + batch):
                live = [r for r in rows if t < 8 + r]
                step = manager.decode_batch(live, [(t * 7 + r) % config.vocab_size for r in live])
                for model in models.values():
                    model(**step)
        first = torch.tensor([(3 * r + 1) % config.vocab_size for r in rows], device=where)
        rounds = [draft_metadata(manager, rows, k) for _ in range(ROUNDS)]

        drafts: dict[str, Any] = {}
        result: dict[str, Any] = {}
        # One capture first, untimed: the first capture in a process pays for one-time setup (op
        # registration, the recorder's first dispatch) that neither way should carry.
        # Kept to the end: freed now, its pool would be released during a measured capture.
        warm = SeparateDraft(make_decoder(config, seed=5, device=where), dev, batch, 1)
        dev.synchronize()
        for name, cls in (("merged", MergedDraft), ("separate", SeparateDraft)):
            gc.collect()  # graphs of earlier rows release their pools now, not during this capture
            before = dev.memory_stats().reserved
            start = time.perf_counter()
            drafts[name] = cls(models[name], dev, batch, k)
            dev.synchronize()
            result[name] = {
                "capture_s": time.perf_counter() - start,
                "pool_bytes": dev.memory_stats().reserved - before,
            }
        # The check: what k eager steps draft. Not the separate way's on the lazy simulator: it copies
        # each step's metadata in between replays with host tensor ops, which the simulator runs at once
        # (it queues graph work only), so they overtake the replays (tests/graph/test_multistep_draft.py).
        checked = ["merged"] if sim is not None else ["merged", "separate"]
        for meta in rounds[:2]:
            want = eager_draft(models["eager"], first, meta)
            for name in checked:
                got = drafts[name].propose(first, meta)
                dev.synchronize()
                if not torch.equal(got.cpu(), want.cpu()):
                    sys.exit(f"{backend} k={k} {name}: drafted {got.tolist()}, eager {want.tolist()}")
            first = want[-1]
        result["checked_equal_to_eager"] = checked

        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in drafts}
        calls: dict[str, dict[str, int]] = {}
        for i in range(iters + 2):
            meta = rounds[i % ROUNDS]
            for name, draft in drafts.items():
                graph = draft.graph.graph if name == "merged" else draft.graph
                with _counting(dev, sim, graph) as (counts, sim_s):
                    start = time.thread_time()
                    draft.propose(first, meta)
                    elapsed = time.thread_time() - start
                dev.synchronize()  # the device work (npu: the simulator's queues), untimed
                if i >= 2:  # warm-up
                    samples[name].append((elapsed, sim_s[0]))
                calls[name] = _calls(counts, sim)
        for name in drafts:
            total = statistics.median(s for s, _ in samples[name]) * 1e6
            in_sim = statistics.median(s for _, s in samples[name]) * 1e6
            result[name].update(
                host_us_per_spec_step=total,
                host_us_per_draft_step=total / k,
                calls_per_spec_step=calls[name],
            )
            if sim is not None:
                result[name].update(sim_us_per_spec_step=in_sim, own_us_per_spec_step=total - in_sim)
        result["ratio_separate_over_merged"] = (
            result["separate"]["host_us_per_spec_step"] / result["merged"]["host_us_per_spec_step"]
        )
        dev.synchronize()
        del warm
    return result


def measure_families(backend: str, k: int, layers: int, batch: int, rounds: int = 3) -> dict[str, Any]:
    """A greedy speculative loop of ``batch`` requests served by graph families: per family its
    graphs, capture seconds, pool growth and replays; the acceptance rate; checked against eager."""
    context: Any
    if backend == "cpu":
        context = contextlib.nullcontext()
    else:
        from devgraph_sim.npu import simulated_torch_npu

        context = simulated_torch_npu(streams="eager")
    with context:
        dev = devgraph.device(backend)
        config = _config(backend, layers, k, ROUNDS)
        where = dev.torch_device

        def models() -> tuple[Any, Any]:
            target = make_decoder(config, seed=5, device=where).eval()
            return target, perturbed_draft(target, noise=0.1)

        options = PagedDecoder.devgraph_options()
        runner_config = RunnerConfig(
            batch_sizes=(batch,), pad_values=options["pad_values"], host_args=options["host_args"]
        )
        families = GraphFamilies(dev, capture_budget=4)
        target, draft = models()
        families.add("decode", target, runner_config)
        families.add_verify("verify", target, runner_config, k=k, requests=(batch,))
        families.add_draft("draft", draft, runner_config, k=k)
        families.add("draft_decode", draft, runner_config)
        prompts = [[(5 * r + t) % config.vocab_size for t in range(4)] for r in range(batch)]
        gc.collect()
        served = speculative_decode(
            families.families,
            KVBlockManager(config, device=where),
            prompts,
            k,
            rounds,
            check=eager_families(*models(), k),
            note=families.note_acceptance,
            sync=dev.synchronize,
        )
        eager = speculative_decode(
            eager_families(*models(), k), KVBlockManager(config, device=where), prompts, k, rounds
        )
        stats = families.close()
        acceptance = stats["acceptance"]
        if served.tokens != eager.tokens or served.accepted != eager.accepted or acceptance.eager_mismatches:
            sys.exit(f"{backend} k={k} families: tokens or acceptance differ from the eager loop")
        return {
            "families": {
                name: {
                    "graphs": f.graphs,
                    "capture_s": f.capture_seconds,
                    "pool_bytes": f.pool_bytes,
                    "replays": f.replays,
                    "eager_calls": f.eager_calls,
                }
                for name, f in stats.items()
                if name != "acceptance"
            },
            "rounds": rounds,
            "acceptance_rate": acceptance.rate,
            "checked_equal_to_eager_loop": True,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", nargs="+", default=["cpu", "npu"], choices=["cpu", "npu"])
    parser.add_argument(
        "--steps", type=int, nargs="+", default=[2, 4, 8], help="k: draft steps per spec step"
    )
    parser.add_argument("--layers", type=int, default=1, help="draft layers (EAGLE's draft has one)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="smoke run: k = 2, 3 iterations")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for the JSON result")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.iters = [2], 3
    torch.set_num_threads(1)  # tiny matmuls on a shared machine: threads only add stalls
    report: dict[str, Any] = {
        **report_header(devgraph.device("cpu"), "spec_draft", note=NOTE),
        "backend": "cpu and npu (simulated)",
        "device_name": "host CPU; npu: torch_npu simulator (lazy streams) on the host CPU",
        "command": " ".join(["python", "benchmarks/spec_draft.py", *sys.argv[1:]]),
        "layers": args.layers,
        "batch": args.batch,
        "iters": args.iters,
        "timing": "median thread CPU microseconds of one propose (metadata copies + replay(s)); device work untimed",
        "results": {},
    }
    partial = PartialReport(args.out / f"spec_draft{'_quick' if args.quick else ''}.json")
    print(
        f"draft of k steps, {args.layers} layer(s), batch {args.batch}, median of {args.iters} (host CPU time)"
    )
    head = (
        f"{'device':>6} {'k':>3} {'way':>9} {'us/spec':>9} {'us/step':>8} {'own us/spec':>11} {'capture s':>9} "
        f"{'pool KiB':>9}  calls"
    )
    print(head)
    for backend in args.devices:
        for k in args.steps:
            row = measure(backend, k, args.layers, args.batch, args.iters)
            for way in ("merged", "separate"):
                r = row[way]
                print(
                    f"{backend:>6} {k:>3} {way:>9} {r['host_us_per_spec_step']:>9.0f} "
                    f"{r['host_us_per_draft_step']:>8.0f} {r.get('own_us_per_spec_step', float('nan')):>11.0f} "
                    f"{r['capture_s']:>9.3f} {r['pool_bytes'] / 1024:>9.1f}  "
                    f"{r['calls_per_spec_step']}"
                )
            row["spec_loop"] = loop = measure_families(backend, k, args.layers, args.batch)
            for name, f in loop["families"].items():
                print(
                    f"{backend:>6} {k:>3} family {name:>12}: {f['graphs']} graph(s), capture "
                    f"{f['capture_s']:.3f} s, pool {f['pool_bytes'] / 1024:.1f} KiB, {f['replays']} replays, "
                    f"{f['eager_calls']} eager"
                )
            print(
                f"{backend:>6} {k:>3} acceptance rate {loop['acceptance_rate']:.2f} (equal to the eager loop)"
            )
            report["results"][f"{backend}_k{k}"] = row
            partial.row_done(report)
    print(f"wrote {partial.finish(report)}")


if __name__ == "__main__":
    main()
