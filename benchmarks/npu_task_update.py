"""One decode step's task update on NPU: devgraph's ``replay(host_args)`` against vllm-ascend's loop (issue 37).

One graph of ``L`` paged-attention layers (``devgraph::paged_decode_attention``, bfloat16, L = 8, 28,
61) is captured once with devgraph; then every step gives it new sequence lengths two ways, on the
same graph (the same task-group handles and events) and the same simulator:

* ``devgraph``: ``graph.replay(host_args={"seq_lens_host": lens})`` (the NPU backend's default,
  overlapped order).
* ``loop``: what vllm-ascend's FULL-graph step does today, written by hand from its sources
  (``ACLGraphWrapper.__call__`` in ``vllm_ascend/compilation/acl_graph.py``: a synchronize of the
  current stream before every FULL replay, then the replay; the model runner's
  ``_update_full_graph_params_if_needed`` after the forward: ``update_graph_params`` in
  ``vllm_ascend/attention/attention_v1.py``: inside ``torch.npu.stream(update_stream)``, per layer
  ``graph_task_update_begin(update_stream, handle)``, the attention op re-issued with the new
  lengths over the parameters kept at capture, ``graph_task_update_end(update_stream)``,
  ``event.record(update_stream)``). The parameters it re-issues are those the attention launched at
  capture (kept then, as vllm-ascend's attention keeps its ``attn_params``).

Per step it reports the torch_npu calls each makes (outermost calls only: host syncs, stream and
event calls, task-update begin/end, replays; counted, not timed) and the host time per layer: the
calling thread's CPU time (``time.thread_time``: other processes on this shared machine do not
count), median over ``--iters`` steps, devgraph's and the loop's steps interleaved. Only the host
calls are timed: the simulator runs in lazy mode, so the device work (replays, rewrites) runs at an
untimed ``device.synchronize()`` after each step, and the loop's synchronize finds nothing queued
(on hardware it waits for the previous step, about 250 us in vllm-ascend #5761: not in these figures).

**What is the simulator's.** Every torch_npu call lands in devgraph's torch_npu simulator
(``tests/sim``), which records each re-issued op through a Python dispatch mode: far slower than
torch_npu's C++ calls. A second, instrumented pass times the host seconds spent inside the simulator
(every wrapped torch_npu call and the recording of every re-issued torch_npu op); ``own`` is the
rest, the caller's Python (devgraph's, or the loop's). A third pass makes every torch_npu call both
ways make a no-op (the stream, event, update and replay calls, and the re-issued attention op):
what is left, ``python_us_per_layer``, is each caller's own Python with a runtime that costs
nothing (the best of ``--iters`` samples of 20 steps: the code is deterministic, the machine is not).
The host ratio is the median over interleaved step pairs of devgraph's time over the loop's. Compare devgraph with the loop, ``own`` with ``own``; no figure here is an Ascend figure.

    python benchmarks/npu_task_update.py                       # L = 8, 28, 61 (a few minutes)
    python benchmarks/npu_task_update.py --layers 8 --iters 5  # smoke run

Writes ``<out>/npu_task_update<tag>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from _common import DEFAULT_OUT, logger, pyplot, report_header, write_json
from npu_update_order import _capture, instrument

import devgraph

NOTE = (
    "simulator host-side figures on a shared 2-core CPU machine, not Ascend hardware: torch_npu is "
    "devgraph's CPU simulator (tests/sim); 'sim' is the time spent inside it, 'own' the caller's Python"
)
#: Host syncs: calls that make the host wait for the device.
SYNCS = ("synchronize", "Stream.synchronize", "Event.synchronize")
#: Stream and event calls (the update's ordering).
STREAM_EVENT = (
    "Stream.wait_stream",
    "Stream.wait_event",
    "Event.record",
    "Event.wait",
    "ExternalEvent.record",
    "ExternalEvent.wait",
    "ExternalEvent.reset",
    "stream",
    "set_stream",
    "current_stream",
)
UPDATES = ("graph_task_update_begin", "graph_task_update_end")
#: Steps per sample of the no-op-runtime pass (each step takes microseconds: one timer read per step
#: would weigh in).
PYTHON_RUNS = 20


@contextlib.contextmanager
def _kept_launches(sim: Any) -> Iterator[list[tuple[Any, tuple[Any, ...], dict[str, Any]]]]:
    """Keep every ``npu_fused_infer_attention_score.out`` launch of the block (op, args, kwargs), as
    vllm-ascend's attention keeps its parameters while a graph is captured.

    A dispatch mode under the capture's own sees each launch as the simulator issues it; the kernel
    and devgraph keep the op itself (nothing of this benchmark stays in devgraph's launches).
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    target = sim.npu_fused_infer_attention_score.out
    kept: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []

    class Keeper(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = kwargs or {}
            if func is target:
                kept.append((func, tuple(args), dict(kwargs)))
            return func(*args, **kwargs)

    with Keeper():
        yield kept


class VllmAscendLoop:
    """The update path of vllm-ascend's FULL-graph step, by hand, over a devgraph-captured graph."""

    def __init__(self, sim: Any, graph: devgraph.Graph, launches: list[Any]) -> None:
        self.npu = sim.npu
        self.native = graph.native  # type: ignore[attr-defined]
        self.update_stream = self.npu.Stream()  # the model runner's own update stream
        tasks = graph.tasks
        if len(tasks) != len(launches):
            raise RuntimeError(f"{len(tasks)} task groups but {len(launches)} attention launches kept")
        self.layers = [(task.handle[0], task.handle[1], *launch) for task, launch in zip(tasks, launches)]

    def step(self, seq_lens: list[int]) -> None:
        npu, update_stream = self.npu, self.update_stream
        npu.current_stream().synchronize()  # before every FULL replay
        self.native.replay()
        with npu.stream(update_stream):
            for handle, event, op, args, kwargs in self.layers:
                npu.graph_task_update_begin(update_stream, handle)
                op(*args, **{**kwargs, "actual_seq_lengths_kv": seq_lens})
                npu.graph_task_update_end(update_stream)
                event.record(update_stream)


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


@contextlib.contextmanager
def free_runtime(sim: Any, op: Any) -> Iterator[None]:
    """Make every torch_npu call of a step (and the re-issued attention ``op``, both ways' same
    overload) a no-op for the block: what a step still costs is its caller's own Python."""
    npu = sim.npu
    fixed = npu.current_stream()
    stubs = [
        (npu, "graph_task_update_begin", _noop),
        (npu, "graph_task_update_end", _noop),
        (npu, "stream", lambda stream: contextlib.nullcontext()),
        (npu, "current_stream", lambda device=None: fixed),
        (npu.Stream, "wait_stream", _noop),
        (npu.Stream, "synchronize", _noop),
        (npu.ExternalEvent, "record", _noop),
        (npu.NPUGraph, "replay", _noop),
        (op, "_op", _noop),
    ]
    with contextlib.ExitStack() as stack:
        for owner, attr, stub in stubs:
            stack.callback(setattr, owner, attr, getattr(owner, attr))
            setattr(owner, attr, stub)
        yield


def _lengths(step: int, batch: int) -> list[int]:
    return [1 + (7 * step + b) % 64 for b in range(batch)]


def _cpu_us(call: Callable[[], None]) -> float:
    start = time.thread_time()
    call()
    return (time.thread_time() - start) * 1e6


def _per_step(counts: dict[str, int]) -> dict[str, Any]:
    return {
        "host_syncs": sum(counts.get(name, 0) for name in SYNCS),
        "device_wide_syncs": counts.get("synchronize", 0),
        "stream_event_calls": sum(counts.get(name, 0) for name in STREAM_EVENT),
        "update_begin": counts.get("graph_task_update_begin", 0),
        "update_end": counts.get("graph_task_update_end", 0),
        "replays": counts.get("NPUGraph.replay", 0),
        "calls": dict(sorted(counts.items())),
    }


def measure(layers: int, iters: int, probe_iters: int) -> dict[str, Any]:
    """Both ways on one L-layer graph: host microseconds per layer (plain and split) and call counts."""
    from devgraph_sim.npu import simulated_torch_npu

    with simulated_torch_npu(streams="lazy", hang_timeout=10.0) as sim:
        device = devgraph.device("npu")
        with _kept_launches(sim) as launches:
            graph, batch, _inputs = _capture(device, layers)
        loop = VllmAscendLoop(sim, graph, launches)
        ways: dict[str, Callable[[list[int]], None]] = {
            "devgraph": lambda lens: graph.replay(host_args={"seq_lens_host": lens}),
            "loop": loop.step,
        }
        samples: dict[str, list[float]] = {name: [] for name in ways}
        for i in range(iters + 3):
            order = list(ways) if i % 2 == 0 else list(reversed(ways))
            for name in order:
                lens = _lengths(i, batch)
                us = _cpu_us(lambda way=ways[name], lens=lens: way(lens))
                device.synchronize()  # the device work, untimed
                if i >= 3:
                    samples[name].append(us / layers)
        result: dict[str, Any] = {"layers": layers, "batch": batch}
        for name, step in ways.items():
            split, counts = [], []
            for i in range(probe_iters):
                lens = _lengths(1000 + i, batch)
                with instrument(sim, time.thread_time) as probe:
                    total = _cpu_us(lambda step=step, lens=lens: step(lens))
                device.synchronize()
                split.append((total / layers, probe.seconds * 1e6 / layers))
                counts.append(dict(probe.counts))
            if any(c != counts[0] for c in counts):
                raise RuntimeError(f"{name}: torch_npu calls differ between steps: {counts}")
            sim_us = statistics.median(s for _, s in split)
            host_probed = statistics.median(h for h, _ in split)
            result[name] = {
                "host_us_per_layer": statistics.median(samples[name]),
                "host_us_per_layer_p10_p90": _p10_p90(samples[name]),
                "instrumented_host_us_per_layer": host_probed,
                "sim_us_per_layer": sim_us,
                "own_us_per_layer": host_probed - sim_us,
                "per_step": _per_step(counts[0]),
            }
        python: dict[str, list[float]] = {name: [] for name in ways}
        with free_runtime(sim, launches[0][0]):
            for i in range(iters):
                for name, step in ways.items():
                    lens = _lengths(i, batch)
                    runs = lambda step=step, lens=lens: [step(lens) for _ in range(PYTHON_RUNS)]  # noqa: E731
                    python[name].append(_cpu_us(runs) / PYTHON_RUNS / layers)
        for name in ways:
            result[name]["python_us_per_layer"] = min(python[name])
            result[name]["python_us_per_layer_median"] = statistics.median(python[name])
        dg, lp = result["devgraph"], result["loop"]
        paired = [d / loop_us for d, loop_us in zip(samples["devgraph"], samples["loop"])]
        result["ratio_host_devgraph_over_loop"] = statistics.median(paired)
        result["ratio_of_median_host_devgraph_over_loop"] = dg["host_us_per_layer"] / lp["host_us_per_layer"]
        result["ratio_own_devgraph_over_loop"] = dg["own_us_per_layer"] / lp["own_us_per_layer"]
        result["ratio_python_devgraph_over_loop"] = dg["python_us_per_layer"] / lp["python_us_per_layer"]
    return result


def _p10_p90(values: list[float]) -> list[float]:
    ordered = sorted(values)
    return [ordered[int(0.1 * (len(ordered) - 1))], ordered[int(0.9 * (len(ordered) - 1))]]


def plot(cases: list[dict[str, Any]], path: Path) -> Path | None:
    """Bars per L: host microseconds per layer, devgraph and loop, split into simulator and own time."""
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.38
    for k, (name, colour) in enumerate((("devgraph", "tab:blue"), ("loop", "tab:orange"))):
        xs = [i + (k - 0.5) * width for i in range(len(cases))]
        sim = [c[name]["sim_us_per_layer"] for c in cases]
        own = [c[name]["own_us_per_layer"] for c in cases]
        ax.bar(xs, own, width, color=colour, label=f"{name}: own Python")
        ax.bar(xs, sim, width, bottom=own, color=colour, alpha=0.35, hatch="//", label=f"{name}: simulator")
    ax.set_xticks(range(len(cases)), [f"L = {c['layers']}" for c in cases])
    ax.set_ylabel("host us per layer per step (instrumented)")
    ax.set_title("Task update per step, torch_npu simulator (not Ascend hardware)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 28, 61])
    parser.add_argument("--iters", type=int, default=30, help="timed steps per way and L")
    parser.add_argument("--probe-iters", type=int, default=5, help="instrumented steps per way and L")
    parser.add_argument("--tag", default="", help="suffix of the output files (e.g. _before)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    logging_setup()
    # One intra-op thread: on a loaded 2-core machine OpenMP's spin-waits make every small op of the
    # simulator's reference kernels cost milliseconds (device work, untimed, but it stalls the run).
    torch.set_num_threads(1)
    cases = [measure(layers, args.iters, args.probe_iters) for layers in args.layers]
    from devgraph_sim.npu import simulated_torch_npu

    with simulated_torch_npu():
        header = report_header(devgraph.device("npu"), "npu_task_update")
    report = {
        **header,
        "device_name": "devgraph torch_npu simulator (CPU)",
        "note": NOTE,
        "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()},
        "command": " ".join(["python", *sys.argv]),
        "timing": "median over steps of the calling thread's CPU time per step / L; device work untimed",
        "goals": {"devgraph_device_wide_syncs_per_step": 0, "devgraph_host_us_per_layer": "<= loop's"},
        "cases": cases,
    }
    path = write_json(report, args.out / f"npu_task_update{args.tag}.json")
    png = plot(cases, args.out / f"npu_task_update{args.tag}.png")
    head = (
        f"{'L':>3} {'way':>9} {'us/layer':>9} {'sim':>8} {'own':>8} {'python':>7} {'syncs':>6} {'strm/ev':>8} "
        f"{'begin':>6} {'end':>5}"
    )
    print("task update per step on the torch_npu simulator (host side, not Ascend hardware)")
    print(head)
    for case in cases:
        for name in ("devgraph", "loop"):
            c, s = case[name], case[name]["per_step"]
            print(
                f"{case['layers']:>3} {name:>9} {c['host_us_per_layer']:>9.1f} {c['sim_us_per_layer']:>8.1f} "
                f"{c['own_us_per_layer']:>8.1f} {c['python_us_per_layer']:>7.2f} {s['host_syncs']:>6} "
                f"{s['stream_event_calls']:>8} "
                f"{s['update_begin']:>6} {s['update_end']:>5}"
            )
        print(
            f"{'':>3} {'ratio':>9} {case['ratio_host_devgraph_over_loop']:>9.2f} {'':>8} "
            f"{case['ratio_own_devgraph_over_loop']:>8.2f} {case['ratio_python_devgraph_over_loop']:>7.2f}"
        )
    print(f"wrote {path}" + (f" and {png}" if png else ""))


def logging_setup() -> None:
    import logging

    logging.basicConfig(level=logging.WARNING)
    logger.setLevel(logging.INFO)


if __name__ == "__main__":
    main()
