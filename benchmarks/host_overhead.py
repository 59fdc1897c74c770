"""devgraph's own host time per call, against a hand-written loop, with a replay that does nothing.

Every captured graph's ``replay`` is stubbed on the instance (the graph objects devgraph made;
nothing in torch is patched), so what is timed is devgraph's Python alone: reading the call,
copying it into the static buffers, padding, choosing the bucket, the task-update bookkeeping,
slicing the outputs. The same stub replays in the loops devgraph is compared with, so the numbers
mean the same on any machine (a GPU's own launch time is not in them). On ``cpu`` the graphs'
updatable tasks are also declared to need no re-issue, as on CUDA, where the attention kernel reads
its lengths from a device tensor (the CPU reference would otherwise re-run attention per layer at
every replay: device work, not devgraph's host overhead).

Cases (the reference paged decoder of ``devgraph.testing.models``, hidden 64, called with keyword
arguments as an engine does):

| case | devgraph | compared with |
| --- | --- | --- |
| ``full L=2/32, batch b (bucket s)`` | ``devgraph.wrap(model)(**batch)`` | hand-written loop: copy each tensor input into the first ``b`` rows of a static buffer, replay, slice the output to ``b`` rows |
| ``piecewise L=32, tokens b (size s)`` | ``devgraph.wrap(model, mode="piecewise")(**batch)`` | vLLM-style loop: the same copies, then the same split module where every captured piece is a wrapper doing a dict lookup by size and a replay (vLLM's ``CUDAGraphWrapper`` in PIECEWISE mode), and the same splitting ops in between, then the slice |

The splitting ops (attention) between the pieces are stubbed in both loops alike: each returns what
it returned in one real call (attention is device work, the same whoever drives it; on the CPU
reference it would be most of the time).

Each number is the best of ``--repeats`` runs of ``--iters`` back-to-back calls, in the calling
thread's CPU time (``time.thread_time``, so that other processes on a busy machine do not count;
with the replay stubbed and torch on one thread, all the work is this thread's), per call in
microseconds, devgraph's runs and the loop's interleaved. Targets, recorded in the JSON: full mode within
1.5x of the hand-written loop, piecewise within 2x of the vLLM-style loop.

    python benchmarks/host_overhead.py                 # cpu, a few seconds
    python benchmarks/host_overhead.py --device cuda   # real CUDA graphs, replay stubbed
    python benchmarks/host_overhead.py --quick         # smoke run (fewer iterations)

Writes ``<out>/host_overhead.json`` (``host_overhead_quick.json`` with ``--quick``) after every case
(``"complete": false`` until the end).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import platform
import sys
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from _common import DEFAULT_OUT, PartialReport, logger, report_header

import devgraph
from devgraph.backends.cuda._device import DeviceMetadataGraph
from devgraph.compile._splitting_ops import host_values
from devgraph.testing.models import DecoderConfig, KVBlockManager, make_decoder

NOTE = (
    "host time only: every captured graph's replay is a no-op (stubbed on the instance), so these are "
    "devgraph's Python costs per call, comparable across machines of similar CPU speed"
)
FULL_TARGET = 1.5
PIECEWISE_TARGET = 2.0


def _noop() -> None:
    return None


def _no_reissue(group: Any) -> bool:
    return False


def stub_replay(graphs: Iterator[devgraph.Graph]) -> int:
    """Make each graph's replay do nothing, and its task updates need no re-issue: CUDA's hooks
    (``DeviceMetadataGraph``: ``replay(host_args)`` notes the values, re-issues nothing)."""
    n = 0
    for graph in graphs:
        graph._replay = _noop  # type: ignore[method-assign]
        graph._needs_reissue = _no_reissue  # type: ignore[method-assign]
        for hook in ("_replay_with_host_args", "_note_host_args", "_settle_host_args"):
            setattr(graph, hook, types.MethodType(getattr(DeviceMetadataGraph, hook), graph))
        n += 1
    return n


def per_call_us(
    fns: dict[str, Callable[[], Any]], iters: int, repeats: int, around: dict[str, Any] | None = None
) -> dict[str, float]:
    """Per-call microseconds of each of ``fns``: the best over ``repeats`` runs of ``iters``
    back-to-back calls, in the thread's CPU time (``time.thread_time``: time other processes
    take from a busy machine is not counted), the functions' runs interleaved so that both see
    the same machine state (the best run is the one least disturbed, as ``timeit`` advises).
    ``around[name]`` makes a context each of that function's runs happens in (untimed set-up)."""
    around = around or {}
    best = {name: float("inf") for name in fns}
    for repeat in range(repeats + 1):  # the first round warms up
        for name, fn in fns.items():
            with around.get(name, contextlib.nullcontext)():
                start = time.thread_time()
                for _ in range(iters):
                    fn()
                took = (time.thread_time() - start) * 1e6 / iters
            if repeat:
                best[name] = min(best[name], took)
    return best


def decode_batch(config: DecoderConfig, device: torch.device, rows: int) -> dict[str, Any]:
    manager = KVBlockManager(config, device=device)
    ids = list(range(rows))
    manager.decode_batch(ids, [3] * rows)  # one token of context
    return manager.decode_batch(ids, [7] * rows)


def full_cases(
    dev: devgraph.Device, layers: int, batches: list[int], sizes: list[int], args: Any
) -> Iterator[dict[str, Any]]:
    """One captured model, timed at each batch size of ``batches`` (one case each, as measured)."""
    config = DecoderConfig(num_layers=layers)
    model = make_decoder(config, device=dev.torch_device)
    graphed = devgraph.wrap(
        model, device=dev, frontend="raw", batch_sizes=sizes
    )  # the decoder's host lengths: served by the raw path only
    graphed.capture(**decode_batch(config, dev.torch_device, 1))
    stub_replay(graph for _, graph in graphed.runner.full.graphs.items())
    for rows in batches:
        yield _full_case(graphed, config, layers, rows, sizes, args)


def _full_case(
    graphed: Any, config: DecoderConfig, layers: int, rows: int, sizes: list[int], args: Any
) -> dict[str, Any]:
    dev = graphed.device
    batch = decode_batch(config, dev.torch_device, rows)
    bucket = min(s for s in sizes if s >= rows)

    # The hand-written loop: its own static buffers, one copy per tensor input, replay, slice.
    tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    static = {
        k: torch.zeros((max(sizes), *v.shape[1:]), dtype=v.dtype, device=v.device) for k, v in tensors.items()
    }
    out = torch.zeros(bucket, config.vocab_size, device=dev.torch_device)

    def hand() -> torch.Tensor:
        for name, x in tensors.items():
            static[name][:rows].copy_(x)
        _noop()
        return out[:rows]

    with torch.no_grad():
        us = per_call_us({"devgraph": lambda: graphed(**batch), "hand": hand}, args.iters, args.repeats)
    ours, theirs = us["devgraph"], us["hand"]
    assert graphed.stats.eager_calls == 0, graphed.stats.fallbacks
    return {
        "mode": "full",
        "layers": layers,
        "batch": rows,
        "bucket": bucket,
        "devgraph_us": ours,
        "baseline": "hand-written loop",
        "baseline_us": theirs,
        "ratio": ours / theirs,
        "target": FULL_TARGET,
    }


class _Replayed:
    """A splitting op stubbed to return, per size, what it returned in a real call at that size."""

    def __init__(self, runner: Any, state: Any) -> None:
        self.runner, self.state, self.outputs = runner, state, {}
        self.recording = True

    def __call__(self, *args: Any) -> Any:
        if self.recording:
            self.outputs[self.state.size] = self.runner(*args)
        return self.outputs[self.state.size]


def stub_splitting_ops(split: Any, names: list[str], state: Any, calls: list[Callable[[], Any]]) -> None:
    """Replace each eager splitting op of ``split`` by a stub returning its output from a real run
    of ``calls`` (one per size): attention is device work, the same in devgraph and the loop it is
    compared with."""
    stubs = [_Replayed(split.__dict__[name], state) for name in names]
    split.__dict__.update(zip(names, stubs))
    for call in calls:
        call()
    for stub in stubs:
        stub.recording = False


class _VllmPiece:
    """A piece as vLLM's PIECEWISE graph wrapper runs it: a dict lookup by size, a replay, the output."""

    def __init__(self, graphs: Any, state: Any) -> None:
        self.entries = {size: (graph._replay, graphs.output(size)) for size, graph in graphs.items()}
        self.state = state

    def __call__(self, *args: Any) -> Any:
        replay, output = self.entries[self.state.size]
        replay()
        return output


def piecewise_cases(
    dev: devgraph.Device, layers: int, batches: list[int], sizes: list[int], args: Any
) -> Iterator[dict[str, Any]]:
    """One traced and captured model, timed at each token count of ``batches`` (one case each, as measured)."""
    config = DecoderConfig(num_layers=layers)
    model = make_decoder(config, device=dev.torch_device)
    # Eager pieces everywhere: with the replay stubbed, how a piece was compiled does not matter,
    # and inductor would spend minutes compiling 32 layers on a GPU.
    graphed = devgraph.wrap(model, device=dev, mode="piecewise", capture_sizes=sizes, compile_backend="eager")
    graphed.capture(**decode_batch(config, dev.torch_device, 1))
    module = graphed.runner.pieces.module
    stub_replay(graph for r in module.piece_graphs for _, graph in r.graphs.items())
    step = {rows: decode_batch(config, dev.torch_device, rows) for rows in batches}
    with torch.no_grad():
        stub_splitting_ops(
            module.split.module,
            [p.name for p in module.split.pieces if p.is_splitting_op],
            module.state,
            [lambda b=b: graphed(**b) for b in step.values()],
        )
    for rows in batches:
        yield _piecewise_case(graphed, layers, rows, step[rows], sizes, args)


def _piecewise_case(
    graphed: Any, layers: int, rows: int, batch: dict[str, Any], sizes: list[int], args: Any
) -> dict[str, Any]:
    runner = graphed.runner
    module = runner.pieces.module
    size = min(s for s in sizes if s >= rows)
    split = module.split.module

    # The vLLM-style loop over the same split module: captured pieces swapped for _VllmPiece, the
    # same (stubbed) splitting ops and view-only pieces in between.
    ours_pieces = {r.piece.name: r for r in module.piece_graphs if r.entries}
    theirs_pieces = {name: _VllmPiece(r.graphs, module.state) for name, r in ours_pieces.items()}
    tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    buffers = runner.inputs.buffers
    traced_inputs = runner.pieces.traced.inputs
    pad = runner.config.pad_value("seq_lens_host")
    state = module.state

    # The split module's inputs: weights and the buffers' first rows (built once, as cheap as it gets).
    inputs = [v if kind == "fixed" else buffers[v][:size] for kind, v in traced_inputs]

    def vllm_step() -> Any:
        for name, x in tensors.items():
            buffers[name][:rows].copy_(x)
        host = {"seq_lens_host": batch["seq_lens_host"] + [pad] * (size - rows)}
        state.phase, state.size = "replay", size
        try:
            with host_values(host):
                out = split(*inputs)
        finally:
            state.phase, state.size = "eager", None
        return out[0][:rows] if isinstance(out, (list, tuple)) else out[:rows]

    def swap(pieces: dict[str, Any]) -> None:
        for name, piece in pieces.items():
            split.__dict__[name] = piece

    @contextlib.contextmanager
    def vllm_pieces() -> Iterator[None]:
        swap(theirs_pieces)
        try:
            yield
        finally:
            swap(ours_pieces)

    with torch.no_grad():
        us = per_call_us(
            {"devgraph": lambda: graphed(**batch), "vllm": vllm_step},
            args.iters,
            args.repeats,
            around={"vllm": vllm_pieces},
        )
    ours, theirs = us["devgraph"], us["vllm"]
    assert graphed.stats.eager_calls == 0, graphed.stats.fallbacks
    return {
        "mode": "piecewise",
        "layers": layers,
        "batch": rows,
        "bucket": size,
        "pieces": module.captured_pieces,
        "splitting_ops": runner.stats.splitting_ops,
        "devgraph_us": ours,
        "baseline": "vLLM-style piecewise loop",
        "baseline_us": theirs,
        "ratio": ours / theirs,
        "target": PIECEWISE_TARGET,
    }


def run(
    args: argparse.Namespace, on_row: Callable[[dict[str, Any]], None] = lambda report: None
) -> dict[str, Any]:
    """Every case; ``on_row(report)`` after each (the report so far)."""
    dev = devgraph.device(args.device)
    sizes = [1, 2, 4, 8]
    cases: list[dict[str, Any]] = []
    small, large = (2, 4) if args.quick else (2, 32)
    groups = []
    if "full" in args.modes:
        groups += [full_cases(dev, layers, [1, 3], sizes, args) for layers in (small, large)]
    if "piecewise" in args.modes:
        groups.append(piecewise_cases(dev, large, [1, 3], sizes, args))
    for group in groups:  # generators: each model is built when its first case is asked for
        for case in group:
            cases.append(case)
            on_row(_report(dev, args, cases))
            logger.info("%s done", _label(case))
    return _report(dev, args, cases)


def _report(dev: devgraph.Device, args: argparse.Namespace, cases: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        **report_header(dev, "host_overhead", note=NOTE),
        "note": NOTE,
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": _cores(),
            "system": platform.platform(),
        },
        "command": " ".join(["python", f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]]),
        "iters": args.iters,
        "repeats": args.repeats,
        "timing": "best over repeats of mean per-call microseconds of thread CPU time (time.thread_time), "
        "runs interleaved, replay stubbed",
        "cases": cases,
        "targets_met": {_label(c): c["ratio"] <= c["target"] for c in cases},
    }


def _cores() -> int | None:
    import os

    return os.cpu_count()


def _label(case: dict[str, Any]) -> str:
    return f"{case['mode']} L={case['layers']} batch {case['batch']} (bucket {case['bucket']})"


def render(report: dict[str, Any]) -> str:
    lines = [
        f"host overhead on {report['backend']} ({report['machine']['cpu']}, {report['machine']['cores']} cores), "
        f"torch {report['torch']}; replay stubbed",
        "",
        f"{'case':<38}{'devgraph us':>12}{'baseline us':>13}{'ratio':>8}{'target':>8}  baseline",
    ]
    for c in report["cases"]:
        ok = "ok" if c["ratio"] <= c["target"] else "MISS"
        lines.append(
            f"{_label(c):<38}{c['devgraph_us']:>12.1f}{c['baseline_us']:>13.1f}{c['ratio']:>7.2f}x"
            f"{'<=' + str(c['target']) + 'x':>8}  {c['baseline']} [{ok}]"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="devgraph backend (default cpu: runs anywhere)")
    parser.add_argument("--iters", type=int, default=1000, help="calls per timed run")
    parser.add_argument("--repeats", type=int, default=9, help="timed runs per case (the best is reported)")
    parser.add_argument("--quick", action="store_true", help="smoke run: few iterations")
    parser.add_argument(
        "--modes", default="full,piecewise", type=lambda t: t.split(","), help="which cases (full,piecewise)"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.quick:
        args.iters, args.repeats = 50, 2  # and 4 layers, not 32: a smoke run
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    name = "host_overhead_quick.json" if args.quick else "host_overhead.json"
    partial = PartialReport(args.out / name)
    report = run(args, on_row=partial.row_done)
    print(render(report))
    print(f"\nwrote {partial.finish(report)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
