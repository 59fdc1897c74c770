"""``devgraph demo``: graph the tiny reference paged decoder and compare it with eager.

Builds two identical decoders (same seed), wraps one with ``devgraph.wrap``, runs the same greedy
decode steps through both, and prints per-step latency, the ratio, capture seconds, pool memory and
the largest logit difference. On the CPU reference backend replay re-executes recorded ops, so it
is *slower* than eager: there the demo shows correctness, and its ratio column is devgraph's time
over eager's ("time vs eager", not a speed-up); on cuda and npu it is the speed-up (eager's time over
devgraph's).
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

import devgraph
from devgraph._errors import DevgraphError
from devgraph.graph import Device

__all__ = ["bisect_case", "run_demo", "run_tp_demo"]


def _timed(device: Device, fn: Callable[[], Any]) -> tuple[Any, float]:
    """Run ``fn`` and return (result, milliseconds), timed with device events where they time."""
    start, end = device.event(enable_timing=True), device.event(enable_timing=True)
    device.synchronize()
    t0 = time.perf_counter()
    start.record()
    out = fn()
    end.record()
    end.synchronize()
    wall = (time.perf_counter() - t0) * 1e3
    return out, (start.elapsed_time(end) if device.name != "cpu" else wall)


def _decode(device: Device, models: dict[str, Any], batch: int, steps: int) -> dict[str, Any]:
    from devgraph.testing.models import KVBlockManager

    config = models["eager"].config
    managers = {k: KVBlockManager(config, device=device.torch_device) for k in models}
    tokens = [(7 * i + 3) % config.vocab_size for i in range(batch)]
    times: dict[str, list[float]] = {k: [] for k in models}
    max_diff = 0.0
    for step in range(steps + 2):
        logits: dict[str, Any] = {}
        for name, model in models.items():
            kwargs = managers[name].decode_batch(list(range(batch)), tokens)
            logits[name], ms = _timed(device, functools.partial(model, **kwargs))
            logits[name] = logits[name].clone()
            if step >= 2:  # the first steps include lazy initialisation and capture
                times[name].append(ms)
        max_diff = max(max_diff, (logits["eager"].float() - logits["devgraph"].float()).abs().max().item())
        tokens = logits["eager"].argmax(-1).tolist()
    return {
        "eager_ms": statistics.median(times["eager"]),
        "devgraph_ms": statistics.median(times["devgraph"]),
        "max_abs_diff": max_diff,
    }


def run_demo(device: str | None = None, steps: int = 16, batch_sizes: Sequence[int] = (1, 4, 8)) -> int:
    """Print the demo table; return 0 when graphed logits match eager, 1 otherwise."""
    from devgraph.testing.models import make_decoder

    dev = devgraph.device(device)
    config = _config_for(dev)
    eager = make_decoder(config, seed=0, device=dev.torch_device)
    graphed_model = make_decoder(config, seed=0, device=dev.torch_device)
    graphed = devgraph.wrap(graphed_model, device=dev, max_batch_size=max(batch_sizes))
    graphed.capture(**graphed_model.dummy_inputs(1))
    stats = graphed.stats
    print(
        f"devgraph demo on {dev} ({type(dev).__name__}); tiny paged decoder: {eager.config.num_layers} layers, "
        f"hidden {eager.config.hidden_size}, {eager.config.dtype}"
    )
    print(
        f"captured batch sizes {list(stats.captured_sizes)} in {stats.capture_seconds:.2f} s, "
        f"pool {stats.pool_bytes / 2**20:.2f} MiB"
    )
    # On the reference simulator a replay re-executes the recorded ops: its time over eager's is the
    # simulator's cost, not a speed-up, and the column says so.
    reference = dev.name == "cpu"
    ratio_name = "time vs eager" if reference else "speed-up"
    header = (
        f"{'batch':>5}  {'eager ms/step':>13}  {'devgraph ms/step':>16}  {ratio_name:>{len(ratio_name)}}  "
        f"{'max |diff|':>10}"
    )
    if reference:
        print(
            "cpu is devgraph's reference simulator: a replay re-executes the recorded ops, so it is slower "
            "than eager; it proves correctness (max |diff|). 'time vs eager' is devgraph's ms/step over "
            "eager's (above 1: slower). Speed-ups come on cuda and npu."
        )
    print(header)
    print("-" * len(header))
    worst = 0.0
    for batch in batch_sizes:
        row = _decode(dev, {"eager": eager, "devgraph": graphed}, batch, steps)
        worst = max(worst, row["max_abs_diff"])
        ratio = row["devgraph_ms"] / row["eager_ms"] if reference else row["eager_ms"] / row["devgraph_ms"]
        print(
            f"{batch:>5}  {row['eager_ms']:>13.3f}  {row['devgraph_ms']:>16.3f}  "
            f"{f'{ratio:.2f}x':>{len(ratio_name)}}  {row['max_abs_diff']:>10.2e}"
        )
    print(f"replays {stats.replays}, eager fallbacks {stats.eager_calls}")
    tolerance = _TOLERANCE[eager.config.dtype]
    ok = worst <= tolerance
    print("graphed logits match eager" if ok else f"MISMATCH: max |diff| {worst:.3e} > {tolerance:g}")
    return 0 if ok else 1


#: Largest |graphed - eager| logit difference accepted, per model dtype.
_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 5e-2}


def _config_for(dev: Device) -> Any:
    """The demo model's config: bfloat16 on npu, whose fused attention refuses float32 (float32
    elsewhere)."""
    from devgraph.testing.models import DecoderConfig

    return DecoderConfig(dtype=torch.bfloat16) if dev.name == "npu" else DecoderConfig()


# -- tensor parallel: devgraph demo --tp N ------------------------------------------------------


def run_tp_demo(
    world_size: int, steps: int = 8, batch_sizes: Sequence[int] = (1, 3, 4), timeout: float = 300.0
) -> int:
    """Graph a tensor-parallel shard of the tiny decoder on each of ``world_size`` CPU ranks (gloo).

    Spawns the ranks (``devgraph.testing.distributed.run_ranks``), and on each one wraps its shard
    with ``devgraph.wrap(shard, device="cpu")``, runs greedy decode steps at every batch size through
    the graphed shard, an eager twin and the single-process model, and prints one row per rank.
    Returns 0 when every rank's graphed logits are within the demo's float32 tolerance of its eager
    shard's and of the single-process model's, 1 otherwise (or when a rank failed or the run took over ``timeout``
    seconds, with the reason on stderr).
    """
    import sys

    from devgraph.testing.distributed import RanksFailed, RanksTimedOut, run_ranks

    if world_size < 1:
        raise DevgraphError(f"--tp needs at least 1 rank, got {world_size}")
    print(
        f"devgraph demo: tensor-parallel tiny decoder on {world_size} CPU ranks (gloo), "
        f"batch sizes {list(batch_sizes)}, {steps} steps each"
    )
    try:
        rows = run_ranks(_tp_rank, world_size, args=(steps, tuple(batch_sizes)), timeout=timeout)
    except (RanksFailed, RanksTimedOut) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    tolerance = _TOLERANCE[torch.float32]
    header = (
        f"{'rank':>4}  {'replays':>7}  {'eager calls':>11}  {'|graphed - eager|':>17}  "
        f"{'|graphed - 1 process|':>21}  result"
    )
    print(header)
    print("-" * len(header))
    ok = True
    for rank, row in enumerate(rows):
        agree = max(row["vs_eager"], row["vs_single"]) <= tolerance
        ok = ok and agree
        print(
            f"{rank:>4}  {row['replays']:>7}  {row['eager_calls']:>11}  {row['vs_eager']:>17.2e}  "
            f"{row['vs_single']:>21.2e}  {'ok' if agree else 'MISMATCH'}"
        )
    print(
        "graphed logits match eager on every rank"
        if ok
        else f"MISMATCH: graphed logits differ from eager or one process by more than {tolerance:g}"
    )
    return 0 if ok else 1


def _tp_rank(rank: int, world_size: int, steps: int, batch_sizes: tuple[int, ...]) -> dict[str, Any]:
    """One rank of ``run_tp_demo``: the largest |difference| of graphed logits from eager and one process."""
    from devgraph.testing.models import DecoderConfig, KVBlockManager, TensorParallel, make_decoder

    config = DecoderConfig(num_heads=8, num_kv_heads=4)  # shareable by 1, 2, 4 and 8 ranks
    parallel = TensorParallel.of()
    graphed = devgraph.wrap(
        make_decoder(config, parallel=parallel), device="cpu", max_batch_size=max(batch_sizes)
    )
    models: dict[str, Callable[..., Any]] = {
        "devgraph": graphed,
        "eager": make_decoder(config, parallel=parallel),
        "single": make_decoder(config),
    }
    vs_eager = vs_single = 0.0
    for batch in batch_sizes:
        managers = {name: KVBlockManager(config) for name in models}
        tokens = [(7 * i + 3) % config.vocab_size for i in range(batch)]
        for _ in range(steps):
            with torch.no_grad():
                logits = {
                    name: model(**managers[name].decode_batch(list(range(batch)), tokens)).clone()
                    for name, model in models.items()
                }
            vs_eager = max(vs_eager, (logits["devgraph"] - logits["eager"]).abs().max().item())
            vs_single = max(vs_single, (logits["devgraph"] - logits["single"]).abs().max().item())
            tokens = logits["single"].argmax(-1).tolist()
    stats = graphed.stats
    return {
        "replays": stats.replays,
        "eager_calls": stats.eager_calls,
        "vs_eager": vs_eager,
        "vs_single": vs_single,
    }


def bisect_case(
    device: str | None, batch: int, bucket: int | None
) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """``devgraph bisect demo``: the wrapped tiny decoder and a decode step of ``batch`` rows served by
    the graph of ``bucket`` (default ``batch + 1``: a padded bucket), after a few steps of history."""
    from devgraph.testing.models import KVBlockManager, make_decoder

    if batch < 1:
        raise DevgraphError(f"--batch must be a positive integer, got {batch}")
    bucket = batch + 1 if bucket is None else bucket
    if bucket < batch:
        raise DevgraphError(
            f"--bucket {bucket} is smaller than --batch {batch}: the bucket serving a call holds it"
        )
    dev = devgraph.device(device)
    model = make_decoder(device=dev.torch_device)
    graphed = devgraph.wrap(model, device=dev, batch_sizes=[bucket])
    manager = KVBlockManager(model.config, device=dev.torch_device)
    tokens = [(7 * i + 3) % model.config.vocab_size for i in range(batch)]
    for _ in range(3):  # a few steps of history, so attention reads more than one token
        kwargs = manager.decode_batch(list(range(batch)), tokens)
        tokens = graphed(**kwargs).argmax(-1).tolist()
    return graphed, (), manager.decode_batch(list(range(batch)), tokens)


if __name__ == "__main__":
    raise SystemExit(run_demo())
