"""``devgraph demo``: graph the tiny reference paged decoder and compare it with eager.

Builds two identical decoders (same seed), wraps one with ``devgraph.wrap``, runs the same greedy
decode steps through both, and prints per-step latency, the ratio, capture seconds, pool memory and
the largest logit difference. On the CPU reference backend replay re-executes recorded ops, so it
is *slower* than eager: there the demo shows correctness; speed-ups come on cuda and npu.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

import devgraph
from devgraph._contract import Device

__all__ = ["run_demo"]


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
    header = (
        f"{'batch':>5}  {'eager ms/step':>13}  {'devgraph ms/step':>16}  {'speed-up':>8}  {'max |diff|':>10}"
    )
    print(header)
    print("-" * len(header))
    worst = 0.0
    for batch in batch_sizes:
        row = _decode(dev, {"eager": eager, "devgraph": graphed}, batch, steps)
        worst = max(worst, row["max_abs_diff"])
        ratio = row["eager_ms"] / row["devgraph_ms"]
        print(
            f"{batch:>5}  {row['eager_ms']:>13.3f}  {row['devgraph_ms']:>16.3f}  {ratio:>7.2f}x  "
            f"{row['max_abs_diff']:>10.2e}"
        )
    print(f"replays {stats.replays}, eager fallbacks {stats.eager_calls}")
    if dev.name == "cpu":
        print(
            "note: cpu is devgraph's reference simulator: replay re-executes the recorded ops, so it is "
            "slower than eager; it proves correctness. Speed-ups come on cuda and npu."
        )
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


if __name__ == "__main__":
    raise SystemExit(run_demo())
