"""Host time of ``replay(host_args)`` per attention layer, overlapped vs serial task update (NPU).

A graph of ``--layers`` paged-attention calls (bfloat16) is captured with its attention as
updatable tasks; each timed call is ``graph.replay(host_args={"seq_lens_host": ...})`` with new
lengths, in each ``NpuDevice.update_order``. Only the host call is timed: the device work is
synchronised after it, untimed. Also counts the torch_npu stream/event calls each order makes per
replay (machine independent).

Without Ascend hardware this runs on devgraph's torch_npu simulator (tests/sim) in lazy mode (streams
run only at the untimed sync; a re-issued attention call is checked, not run), so the time is
devgraph's host work plus the simulator's recording of each re-issue -- compare the two orders with
each other, not with hardware.

    python benchmarks/npu_update_order.py --layers 32 --iters 50

Writes ``<out>/npu_update_order.json`` after every order (``"complete": false`` until the end).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections import Counter
from pathlib import Path

import torch
from _common import DEFAULT_OUT, PartialReport, report_header

import devgraph
import devgraph.ops as ops

OP = "devgraph::paged_decode_attention"
COUNTED = ("Stream.wait_stream", "record", "graph_task_update_begin", "NPUGraph.replay")


def _capture(device, layers: int):
    g = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, dim, block, blocks = 4, 8, 2, 64, 16, 16
    k = torch.randn(blocks, block, kv_heads, dim, generator=g).to(torch.bfloat16)
    v = torch.randn(blocks, block, kv_heads, dim, generator=g).to(torch.bfloat16)
    table = torch.arange(batch * 4, dtype=torch.int32).view(batch, 4)
    qs = [torch.randn(batch, heads, dim, generator=g).to(torch.bfloat16) for _ in range(layers)]
    lens = [40] * batch
    seq = torch.tensor(lens, dtype=torch.int32)
    graph = device.graph()
    with graph.capture(auto_update_ops=[OP]):
        for q in qs:
            ops.paged_decode_attention(q, k, v, table, seq, lens, 0.125)
    return graph, batch, (k, v, table, seq, qs)  # a graph's inputs must outlive it (as on hardware)


#: torch_npu.npu classes and the methods of them ``instrument`` wraps (calls a caller makes).
METHODS = {
    "Stream": ("wait_stream", "wait_event", "synchronize"),
    "Event": ("record", "wait", "synchronize"),
    "ExternalEvent": ("record", "wait", "reset"),
    "NPUGraph": ("replay",),
}
#: torch_npu.npu functions ``instrument`` wraps.
FUNCTIONS = (
    "synchronize",
    "stream",
    "set_stream",
    "current_stream",
    "graph_task_update_begin",
    "graph_task_update_end",
)


class Instrument:
    """Counts the torch_npu calls a caller makes, and the host seconds spent inside them.

    Only outermost calls count (a ``wait_stream`` that records an event inside is one call), per
    ``"<Class>.<method>"`` or function name. ``seconds`` is the time spent inside those calls and
    inside the simulator's recording of re-issued ops (its dispatch mode; a ``devgraph::`` op it
    only forwards to devgraph's kernel is not the simulator's time, the torch_npu ops that kernel
    launches are): the simulator's own cost, to tell apart from the caller's.
    """

    def __init__(self, clock=time.perf_counter) -> None:
        self.clock = clock
        self.counts: Counter = Counter()
        self.seconds = 0.0
        self._depth = 0

    def call(self, name: str, fn, *args, **kwargs):
        if self._depth:
            return fn(*args, **kwargs)
        self.counts[name] += 1
        return self.timed(fn, *args, **kwargs)

    def timed(self, fn, *args, **kwargs):
        if self._depth:
            return fn(*args, **kwargs)
        self._depth += 1
        start = self.clock()
        try:
            return fn(*args, **kwargs)
        finally:
            self.seconds += self.clock() - start
            self._depth -= 1


@contextlib.contextmanager
def instrument(sim, clock=time.perf_counter):
    """Wrap the simulator's torch_npu calls for the block (one thread); yield an ``Instrument``
    timing them with ``clock``."""
    from devgraph_sim.npu import _runtime

    npu, probe = sim.npu, Instrument(clock)
    stack = contextlib.ExitStack()

    def wrap(owner, attr: str, name: str, method: bool) -> None:
        real = getattr(owner, attr)
        if method:
            spy = lambda self, *a, _r=real, **k: probe.call(name, _r, self, *a, **k)  # noqa: E731
        else:
            spy = lambda *a, _r=real, **k: probe.call(name, _r, *a, **k)  # noqa: E731
        setattr(owner, attr, spy)
        stack.callback(setattr, owner, attr, real)

    for cls_name, methods in METHODS.items():
        for attr in methods:
            wrap(getattr(npu, cls_name), attr, f"{cls_name}.{attr}", True)
    for attr in FUNCTIONS:
        wrap(npu, attr, attr, False)
    recorder = _runtime._SimRecorder
    real_dispatch = recorder.__torch_dispatch__

    def dispatch(self, func, types, args=(), kwargs=None):
        if func.namespace == "devgraph":  # devgraph's own kernel runs inside: not the simulator's time
            return real_dispatch(self, func, types, args, kwargs)
        return probe.timed(real_dispatch, self, func, types, args, kwargs)

    recorder.__torch_dispatch__ = dispatch
    stack.callback(setattr, recorder, "__torch_dispatch__", real_dispatch)
    with stack:
        yield probe


def measure(layers: int, iters: int, order: str) -> tuple[float, dict[str, float]]:
    """(median host microseconds per layer, torch_npu calls per replay) for one update order."""
    from devgraph_sim.npu import simulated_torch_npu

    with simulated_torch_npu(streams="lazy") as sim:
        device = devgraph.device("npu")
        device.update_order = order
        graph, batch, _inputs = _capture(device, layers)
        samples, counts = [], Counter()
        for i in range(iters + 3):
            lens = [1 + (7 * i + b) % 64 for b in range(batch)]
            with instrument(sim) as probe:
                start = time.perf_counter()
                graph.replay(host_args={"seq_lens_host": lens})
                elapsed = time.perf_counter() - start
            counts = probe.counts
            device.synchronize()  # the device work, untimed
            if i >= 3:
                samples.append(elapsed)
        records = counts["Event.record"] + counts["ExternalEvent.record"]
        per_replay = {name: records if name == "record" else counts[name] for name in COUNTED}
    return statistics.median(samples) / layers * 1e6, per_replay


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for the JSON result")
    args = parser.parse_args()
    # One intra-op thread: on a loaded small machine OpenMP's spin-waits make every small op slow.
    torch.set_num_threads(1)
    print(f"replay(host_args) host time per layer, {args.layers} layers, median of {args.iters} (simulator)")
    print(f"{'order':>8}  {'us/layer':>9}  " + "  ".join(f"{c:>23}" for c in COUNTED))
    rows: dict[str, dict[str, float]] = {}
    report = {
        **report_header(devgraph.device("cpu"), "npu_update_order", note=""),
        "backend": "npu",
        "device": "npu:0 (simulated)",
        "device_name": "torch_npu simulator (lazy streams) on the host CPU",
        "note": "host time of devgraph plus the simulator's recording of each re-issue: compare the orders",
        "layers": args.layers,
        "iters": args.iters,
        "timing": "median host microseconds of graph.replay(host_args) per layer; device work synchronised, untimed",
        "results": rows,
    }
    partial = PartialReport(args.out / "npu_update_order.json")
    for order in ("overlap", "serial"):
        us, calls = measure(args.layers, args.iters, order)
        print(f"{order:>8}  {us:>9.1f}  " + "  ".join(f"{calls[c]:>23}" for c in COUNTED))
        rows[order] = {"host_us_per_layer": us, "calls_per_replay": calls}
        partial.row_done(report)
    print(f"wrote {partial.finish(report)}")


if __name__ == "__main__":
    main()
