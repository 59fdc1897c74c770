"""What the benchmark scripts share: timing, summaries, the report header, partial JSON, plots, a CUDA graph.

The scripts run as ``python benchmarks/<name>.py``, so this folder is on ``sys.path`` and they
``from _common import ...`` first: that import also lets them ``import devgraph`` from a source
checkout that was never pip-installed. Every JSON a script writes (``write_json``) records the
commit it was measured on and whether the tree was clean (``checkout``: ``tools/_provenance.py``).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

try:
    import devgraph
except ImportError:  # a source checkout that was never pip-installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import devgraph

logger = logging.getLogger("devgraph.benchmarks")

ROOT = Path(__file__).resolve().parent.parent


def _provenance() -> Any:
    """``tools/_provenance.py``, the one reader of the commit and the tree's state (the GPU
    one-shot's summary uses it too), loaded by path: ``tools/`` is no package."""
    module = sys.modules.get("_provenance")
    if module is None:
        spec = importlib.util.spec_from_file_location("_provenance", ROOT / "tools" / "_provenance.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["_provenance"] = module
        spec.loader.exec_module(module)
    return module


def checkout() -> dict[str, Any]:
    """The commit this checkout is at and whether its tree was clean (git, or on a copy of the tree
    without ``.git`` a matching stamp: ``tools/_provenance.py``), read once per process."""
    return dict(_provenance().checkout(ROOT))


DEFAULT_OUT = Path(__file__).resolve().parent / "results"
CPU_NOTE = "cpu reference simulator: correctness backend, not a speed path"


def time_calls(
    dev: devgraph.Device,
    call: Callable[[], Any],
    iters: int,
    warmup: int,
    prepare: Callable[[], Any] | None = None,
) -> list[float]:
    """Per-call latency samples in ms between two device timing events (start, call, end, wait for
    end), after ``warmup`` untimed calls; ``prepare`` runs before every call, outside the events."""
    prepare = prepare or (lambda: None)
    for _ in range(warmup):
        prepare()
        call()
    dev.synchronize()
    start, end = dev.event(enable_timing=True), dev.event(enable_timing=True)
    samples = []
    for _ in range(iters):
        prepare()
        start.record()
        call()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return samples


def time_interleaved(
    dev: devgraph.Device,
    calls: dict[str, Callable[[], Any]],
    iters: int,
    warmup: int,
    prepare: Callable[[], Any] | None = None,
) -> dict[str, dict[str, list[float]]]:
    """``time_calls`` for several ways of doing the same call, interleaved: each round runs every one
    once, the order rotating from round to round, so that all of them see the same machine state
    (clocks, other processes, the allocator) and none always follows the same neighbour.

    Returns, per name, ``"device_ms"`` (between the device timing events around the call) and
    ``"host_us"`` (the calling thread's wall time inside the call: launches, Python; the device is
    waited for only after). ``prepare`` runs before every call, outside both.
    """
    prepare = prepare or (lambda: None)
    names = list(calls)
    for _ in range(warmup):
        for name in names:
            prepare()
            calls[name]()
    dev.synchronize()
    start, end = dev.event(enable_timing=True), dev.event(enable_timing=True)
    out: dict[str, dict[str, list[float]]] = {n: {"device_ms": [], "host_us": []} for n in names}
    for i in range(iters):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            call = calls[name]
            prepare()
            start.record()
            t0 = time.perf_counter_ns()
            call()
            t1 = time.perf_counter_ns()
            end.record()
            end.synchronize()
            out[name]["device_ms"].append(start.elapsed_time(end))
            out[name]["host_us"].append((t1 - t0) / 1e3)
    return out


def summarise(samples: list[float], unit: str = "ms") -> dict[str, float]:
    """Median, p10, p90, mean and min of ``samples``; ``unit`` (theirs) suffixes the keys."""
    ordered = sorted(samples)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    stats = {"median": statistics.median(ordered), "p10": pick(0.10), "p90": pick(0.90)}
    stats.update(mean=statistics.fmean(ordered), min=ordered[0])
    return {**{f"{k}_{unit}": v for k, v in stats.items()}, "samples": len(ordered)}


def device_name(dev: devgraph.Device) -> str:
    """A human name of the hardware (GPU model, or the host CPU for the reference backend)."""
    if dev.name == "cpu":
        return platform.processor() or platform.machine() or "cpu"
    module = getattr(torch, dev.torch_device.type, None)  # torch.cuda, torch.npu, ...
    getter = getattr(module, "get_device_name", None)
    return str(getter(dev.index)) if getter else str(dev)


def report_header(dev: devgraph.Device, benchmark: str, note: str = CPU_NOTE) -> dict[str, Any]:
    """The keys every report starts with; ``note`` (what the numbers mean) is recorded on cpu only."""
    return {
        "benchmark": benchmark,
        "backend": dev.name,
        "device": str(dev),
        "device_name": device_name(dev),
        "note": note if dev.name == "cpu" else "",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "devgraph": devgraph.__version__,
        "python": platform.python_version(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def start(device: str, benchmark: str, note: str = CPU_NOTE) -> tuple[devgraph.Device, dict[str, Any]]:
    """What a benchmark's ``main`` does first: log its lines, find ``device`` (one torch thread on the
    CPU: tiny matmuls, where threads only add barrier stalls on a busy machine), and the report's
    header with the command that ran it."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dev = devgraph.device(device)
    if dev.name == "cpu":
        torch.set_num_threads(1)
    header = {
        **report_header(dev, benchmark, note=note),
        "command": " ".join(["python", f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]]),
    }
    return dev, header


def write_json(report: dict[str, Any], path: Path, indent: int = 2) -> Path:
    """``report`` as indented JSON at ``path`` (its folder created), with ``"checkout"``: the commit
    and whether the tree was clean (``checkout()``); returns ``path``.

    The file is replaced whole (written beside it, then renamed): a run killed while writing leaves
    the previous version, never half a file.
    """
    report = {**report, "checkout": report.get("checkout") or checkout()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial")
    tmp.write_text(json.dumps(report, indent=indent) + "\n")
    os.replace(tmp, path)
    return path


class PartialReport:
    """A benchmark's JSON report, rewritten after every row, so a run cut short keeps what it measured.

    ``row_done(report)`` writes the report so far with ``"complete": false``; ``finish(report)`` writes it
    with ``"complete": true``. A reader (the GPU one-shot's summary, a person) finds every finished row of
    a run that was killed or ran out of time, and knows from ``complete`` whether the run ended.
    """

    def __init__(self, path: Path) -> None:
        self.path = path

    def row_done(self, report: dict[str, Any]) -> None:
        write_json({**report, "complete": False}, self.path)

    def finish(self, report: dict[str, Any]) -> Path:
        return write_json({**report, "complete": True}, self.path)


@functools.cache
def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or None (warned about once) when it is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not importable: no plot (pip install matplotlib)")
        return None
    return plt


def cuda_graph_capture(
    fn: Callable[[], Any], before: Callable[[], Any] | None = None
) -> tuple[torch.cuda.CUDAGraph, Any, float]:
    """``fn`` captured by hand with ``torch.cuda.graph`` after three warm-up calls on the capture
    stream (as torch's docs do; ``before`` runs ahead of each, never captured): the graph, the output
    ``fn`` returned in capture (each replay overwrites it) and the capture's seconds, warm-up excluded."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            if before is not None:
                before()
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    start = time.perf_counter()
    with torch.cuda.graph(graph, stream=stream):
        out = fn()
    torch.cuda.synchronize()
    return graph, out, time.perf_counter() - start
