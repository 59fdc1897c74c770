"""Graphed Hugging Face ``generate()`` against eager, on six architectures, and its decode speed (issue 43).

Per architecture (``--archs``, default llama, qwen2, qwen3, mistral, phi3, gemma: transformers models
built in code with random weights by ``_decode_workloads.hf_causal_lm``, nothing downloaded), a tiny
model (``--shape tiny``: hidden 64, 2 layers, vocab 128):

* fp32, greedy, ``devgraph.wrap(model, device, batch_sizes=[1, 4], max_cache_len=...)``: its
  ``generate()`` against ``model.generate()`` with the same arguments, at batch 1 and at 3 rows (the
  first left-padded) in the bucket of 4: tokens identical or not, the logits' largest difference;
* the seconds of ``wrap`` and of the first ``generate`` (which captures both buckets);
* the device allocator's peak bytes during the eager and the first graphed ``generate`` (CUDA; the
  reference backend does not see torch's CPU allocator: null);
* decode tokens per second at batch 1, graphed and eager, from each step's time (a streamer that
  waits for the device at every token; the median step after the prefill), and their ratio;
* bf16: the same comparison on a bf16 model, differences reported (bf16 kernels may round a row
  differently at another batch shape: reported, not required);
* a model devgraph refuses (at ``wrap`` or at its first capture) is reported with the refusal.

Then the speed case (``--speed-arch``, default llama): a small bf16 model (on cuda decode_step's shape:
hidden 1024, 8 layers, vocab 32000; ``--quick``: tiny), batch 1, ``--speed-tokens`` new tokens: decode
tokens per second graphed and eager, the speed-up (goal: at least 1.54x on cuda), and the graphed step
as a fraction of the memory-bandwidth floor: the bytes a decode step reads (the weights, all but the
input embedding's unread rows, plus the ``max_cache_len`` key/value slots the static cache's attention
reads) over the device's measured copy bandwidth (a large device-to-device ``copy_``, read and write
counted). On ``cpu`` the graphed column is the reference simulator (correctness, not speed): the speed
numbers are recorded, the speed goal reads n/a.

    python benchmarks/hf_generate.py --device cuda       # six architectures and the speed case (about a minute)
    python benchmarks/hf_generate.py --device cpu --quick

Writes ``<out>/hf_generate_<backend>.json`` after every architecture (``"complete": false`` until the
end; ``_quick`` appended under ``--quick``). Exits 1 when an architecture's fp32 tokens differ from
eager's or a run fails (a refusal is reported, not a failure).
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _common import DEFAULT_OUT, PartialReport, logger, start, summarise, time_calls
from _decode_workloads import FULL_SHAPE, HF_ARCHITECTURES, QUICK_SHAPE, Skip, hf_causal_lm, release_memory

import devgraph

TINY_SHAPE = dict(QUICK_SHAPE, vocab=128)
SPEED_GOAL = 1.54
CPU_NOTE = "cpu backend: the graphed side is the reference simulator (correctness, not speed)"


# -- measuring ---------------------------------------------------------------------------------------


class StepClock:
    """A ``generate`` streamer recording when each token is done (after waiting for the device).

    transformers calls ``put`` with the prompt, then with every new token: ``times[1] - times[0]`` is
    the prefill, the later intervals the decode steps.
    """

    def __init__(self, dev: devgraph.Device) -> None:
        self.dev = dev
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.dev.synchronize()
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass

    def decode_steps_s(self) -> list[float]:
        return [b - a for a, b in zip(self.times[1:], self.times[2:])]


def peak_bytes(dev: devgraph.Device, fn: Callable[[], Any]) -> tuple[Any, int | None]:
    """``fn()`` and the device allocator's peak bytes while it ran (None where torch's allocator for
    the device is not one devgraph reads: the CPU)."""
    if dev.name != "cuda":
        return fn(), None
    dev.synchronize()
    torch.cuda.reset_peak_memory_stats(dev.torch_device)
    out = fn()
    dev.synchronize()
    return out, int(torch.cuda.max_memory_allocated(dev.torch_device))


def prompts(batch: int, length: int, vocab: int, device: Any, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompt ids (3 and up: no special token) and their mask; with 3 rows or more the first row
    is left-padded by two tokens."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, length), generator=gen)
    mask = torch.ones_like(ids)
    if batch >= 3:
        mask[0, :2] = 0
    return ids.to(device), mask.to(device)


def compare(graphed: Any, eager: Any) -> dict[str, Any]:
    """Tokens and logits of two ``generate(..., return_dict_in_generate=True, output_logits=True)``."""
    same = bool(torch.equal(graphed.sequences, eager.sequences))
    steps = [float((g.float() - e.float()).abs().max()) for g, e in zip(graphed.logits, eager.logits)]
    row: dict[str, Any] = {
        "tokens_identical": same,
        "new_tokens": len(graphed.logits),
        "logits_max_abs_diff": max(steps) if steps else None,
        "logits_max_abs_diff_first_step": steps[0] if steps else None,
    }
    if not same:
        differ = (graphed.sequences != eager.sequences).any(dim=0).nonzero()
        row["first_differing_position"] = int(differ[0]) if len(differ) else None
        row["rows_differing"] = int((graphed.sequences != eager.sequences).any(dim=1).sum())
    return row


def decode_rate(
    dev: devgraph.Device, generate: Callable[..., Any], ids: Any, mask: Any, tokens: int
) -> dict[str, Any]:
    """Batch-1 decode: per-step seconds (streamer), tokens per second of the median step, and the
    whole ``generate``'s seconds."""
    clock = StepClock(dev)
    dev.synchronize()
    start = time.perf_counter()
    generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=tokens, streamer=clock)
    dev.synchronize()
    total = time.perf_counter() - start
    steps = clock.decode_steps_s()
    row: dict[str, Any] = {"generate_s": total, "new_tokens": tokens}
    if steps:
        stats = summarise([s * 1e3 for s in steps])
        row.update(step=stats, tokens_per_s=1e3 / stats["median_ms"] * ids.shape[0])
    return row


def run_generate(graphed: Any, model: Any, ids: Any, mask: Any, tokens: int) -> tuple[Any, Any]:
    """Greedy ``generate`` with the logits, graphed and eager, on the same arguments."""
    call = dict(
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=tokens,
        return_dict_in_generate=True,
        output_logits=True,
    )
    return graphed.generate(ids, **call), model.generate(ids, **call)


# -- one architecture --------------------------------------------------------------------------------


def measure_arch(dev: devgraph.Device, arch: str, args: argparse.Namespace) -> dict[str, Any]:
    """Everything measured of one architecture (refused, skipped and failed included, with why)."""
    result: dict[str, Any] = {"arch": arch, "model_class": HF_ARCHITECTURES[arch][1]}
    tdev = dev.torch_device
    try:
        model = hf_causal_lm(arch, args.shape, torch.float32, tdev, args.seed)
        result["params"] = sum(p.numel() for p in model.parameters())
        start = time.perf_counter()
        try:
            graphed = devgraph.wrap(model, dev, batch_sizes=[1, 4], max_cache_len=args.cache_len)
        except devgraph.DevgraphError as exc:
            result["refused"] = f"at wrap: {exc}"
            return result
        result["wrap_s"] = time.perf_counter() - start
        vocab = args.shape["vocab"]
        ids1, mask1 = prompts(1, args.prompt, vocab, tdev, args.seed + 1)
        ids3, mask3 = prompts(3, args.prompt, vocab, tdev, args.seed + 2)

        compared = dict(
            attention_mask=mask1,
            do_sample=False,
            max_new_tokens=args.tokens,
            return_dict_in_generate=True,
            output_logits=True,
        )
        start = time.perf_counter()
        try:
            out, result["peak_bytes_graphed_first_generate"] = peak_bytes(
                dev, lambda: graphed.generate(ids1, **compared)
            )
        except devgraph.CaptureError as exc:
            result["refused"] = f"at the first capture: {exc}"
            return result
        result["first_generate_s"] = time.perf_counter() - start  # both buckets captured in it
        eager, result["peak_bytes_eager"] = peak_bytes(dev, lambda: model.generate(ids1, **compared))
        fp32 = {"batch1": compare(out, eager)}
        fp32["batch3_in_bucket4"] = compare(*run_generate(graphed, model, ids3, mask3, args.tokens))
        result["fp32"] = fp32
        result["fp32_tokens_identical"] = all(r["tokens_identical"] for r in fp32.values())

        graphed_rate = decode_rate(dev, graphed.generate, ids1, mask1, args.rate_tokens)
        eager_rate = decode_rate(dev, model.generate, ids1, mask1, args.rate_tokens)
        result["decode_batch1"] = {
            "graphed": graphed_rate,
            "eager": eager_rate,
            "speedup": _ratio(graphed_rate.get("tokens_per_s"), eager_rate.get("tokens_per_s")),
        }
        result["stats"] = {"replays": graphed.stats.replays, "fallbacks": dict(graphed.stats.fallbacks)}
        result["bf16"] = measure_bf16(dev, arch, args, (ids1, mask1), (ids3, mask3))
    except Skip as why:
        result["skipped"] = str(why)
    except Exception as exc:
        logger.error("%s failed:\n%s", arch, traceback.format_exc())
        result["error"] = f"{type(exc).__name__}: {exc}"[:1000]
    finally:
        release_memory(dev)
    return result


def measure_bf16(
    dev: devgraph.Device, arch: str, args: argparse.Namespace, *batches: tuple[Any, Any]
) -> dict[str, Any]:
    """The fp32 comparison on a bf16 model: differences reported (not required)."""
    model = hf_causal_lm(arch, args.shape, torch.bfloat16, dev.torch_device, args.seed)
    try:
        graphed = devgraph.wrap(model, dev, batch_sizes=[1, 4], max_cache_len=args.cache_len)
    except devgraph.DevgraphError as exc:
        return {"refused": f"at wrap: {exc}"}
    rows = {}
    for name, (ids, mask) in zip(("batch1", "batch3_in_bucket4"), batches):
        rows[name] = compare(*run_generate(graphed, model, ids, mask, args.tokens))
    return rows


# -- the speed case ----------------------------------------------------------------------------------


def copy_bandwidth(dev: devgraph.Device, nbytes: int) -> dict[str, Any]:
    """Bytes per second of a device-to-device ``copy_`` of ``nbytes`` (read and write counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev.torch_device)
    dst = torch.empty_like(src)
    samples = time_calls(dev, lambda: dst.copy_(src), iters=10, warmup=2)
    stats = summarise(samples)
    return {"bytes": nbytes, "copy": stats, "bytes_per_s": 2 * nbytes / (stats["median_ms"] / 1e3)}


def bytes_per_token(model: Any, cache_len: int) -> dict[str, int]:
    """What a batch-1 decode step reads: every weight but the input embedding (one row of it), and
    the key/value slots of the static cache (its attention reads all ``cache_len`` of them)."""
    embedding = model.get_input_embeddings().weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if p is not embedding)
    weights += embedding.shape[1] * embedding.element_size()
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv = (
        2
        * config.num_hidden_layers
        * config.num_key_value_heads
        * head_dim
        * cache_len
        * embedding.element_size()
    )
    return {"weights": weights, "kv_cache": kv, "total": weights + kv}


def measure_speed(dev: devgraph.Device, args: argparse.Namespace) -> dict[str, Any]:
    """The small bf16 model's batch-1 decode, graphed and eager, against the bandwidth floor."""
    result: dict[str, Any] = {"arch": args.speed_arch, "shape": args.speed_shape, "dtype": "bfloat16"}
    try:
        cache_len = args.speed_prompt + args.speed_tokens + 8
        model = hf_causal_lm(args.speed_arch, args.speed_shape, torch.bfloat16, dev.torch_device, args.seed)
        result["params"] = sum(p.numel() for p in model.parameters())
        start = time.perf_counter()
        graphed = devgraph.wrap(model, dev, batch_sizes=[1], max_cache_len=cache_len)
        graphed.capture()
        result["wrap_and_capture_s"] = time.perf_counter() - start
        ids, mask = prompts(1, args.speed_prompt, args.speed_shape["vocab"], dev.torch_device, args.seed + 3)
        for fn in (graphed.generate, model.generate):  # warm both (caches, kernels' first use)
            fn(ids, attention_mask=mask, do_sample=False, max_new_tokens=4)
        graphed_rate = decode_rate(dev, graphed.generate, ids, mask, args.speed_tokens)
        eager_rate = decode_rate(dev, model.generate, ids, mask, args.speed_tokens)
        speedup = _ratio(graphed_rate.get("tokens_per_s"), eager_rate.get("tokens_per_s"))
        floor = bytes_per_token(model, cache_len)
        bandwidth = copy_bandwidth(dev, args.copy_bytes)
        floor_s = floor["total"] / bandwidth["bytes_per_s"]
        step_s = graphed_rate["step"]["median_ms"] / 1e3 if "step" in graphed_rate else None
        result.update(
            cache_len=cache_len,
            graphed=graphed_rate,
            eager=eager_rate,
            speedup=speedup,
            bytes_per_token=floor,
            copy_bandwidth=bandwidth,
            floor_s_per_token=floor_s,
            graphed_fraction_of_floor=floor_s / step_s if step_s else None,
            eager_fraction_of_floor=(
                floor_s / (eager_rate["step"]["median_ms"] / 1e3) if "step" in eager_rate else None
            ),
            stats={"replays": graphed.stats.replays, "fallbacks": dict(graphed.stats.fallbacks)},
        )
    except Skip as why:
        result["skipped"] = str(why)
    except Exception as exc:
        logger.error("speed case failed:\n%s", traceback.format_exc())
        result["error"] = f"{type(exc).__name__}: {exc}"[:1000]
    finally:
        release_memory(dev)
    return result


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# -- report ------------------------------------------------------------------------------------------


def goals(report: dict[str, Any]) -> list[dict[str, Any]]:
    archs = report["archs"]
    tried = [r for r in archs.values() if "fp32" in r]
    refused = {a: r["refused"] for a, r in archs.items() if "refused" in r}
    identical = all(r["fp32_tokens_identical"] for r in tried) and len(tried) + len(refused) == len(archs)
    speed = report.get("speed", {})
    on_cuda = report["backend"] == "cuda"
    return [
        {
            "goal": "fp32 generate token-identical to eager on every architecture tried (or refused by name)",
            "passed": identical if archs else None,
            "tried": len(tried),
            "refused": refused,
        },
        {
            "goal": f"graphed decode at batch 1 at least {SPEED_GOAL}x eager ({speed.get('arch')}, bf16)",
            "value": speed.get("speedup"),
            "passed": (speed["speedup"] >= SPEED_GOAL) if on_cuda and speed.get("speedup") else None,
            "reason": None if on_cuda else f"the speed goal applies to CUDA; device is {report['backend']}",
        },
    ]


def render(report: dict[str, Any]) -> str:
    lines = [
        f"hf_generate on {report['backend']} ({report['device_name']}), torch {report['torch']}, "
        f"transformers {report.get('transformers')}",
        f"{'arch':<9}{'fp32 b1':>9}{'fp32 b3/4':>11}{'max|dlogit|':>13}{'bf16 b1':>9}{'bf16 b3/4':>11}"
        f"{'wrap s':>8}{'1st gen s':>10}{'tok/s graphed':>15}{'eager':>9}{'x':>7}",
    ]

    def same(row: dict[str, Any] | None) -> str:
        if not row:
            return "-"
        return "same" if row["tokens_identical"] else f"DIFF@{row.get('first_differing_position')}"

    for arch, r in report["archs"].items():
        if "fp32" not in r:
            why = r.get("refused") or r.get("skipped") or r.get("error")
            lines.append(f"{arch:<9}{('refused: ' if 'refused' in r else '') + str(why)[:150]}")
            continue
        bf16 = r.get("bf16", {})
        rate = r["decode_batch1"]
        diff = max(v["logits_max_abs_diff"] or 0.0 for v in r["fp32"].values())
        lines.append(
            f"{arch:<9}{same(r['fp32']['batch1']):>9}{same(r['fp32']['batch3_in_bucket4']):>11}{diff:>13.2e}"
            f"{same(bf16.get('batch1')):>9}{same(bf16.get('batch3_in_bucket4')):>11}{r['wrap_s']:>8.2f}"
            f"{r['first_generate_s']:>10.2f}{rate['graphed'].get('tokens_per_s', 0):>15.1f}"
            f"{rate['eager'].get('tokens_per_s', 0):>9.1f}{rate['speedup'] or 0:>6.2f}x"
        )
    s = report.get("speed", {})
    if "speedup" in s:
        lines.append(
            f"speed ({s['arch']} bf16, {s['params'] / 1e6:.1f}M params, batch 1): graphed "
            f"{s['graphed']['tokens_per_s']:.1f} tok/s, eager {s['eager']['tokens_per_s']:.1f} tok/s, "
            f"{s['speedup']:.2f}x; floor {s['floor_s_per_token'] * 1e6:.1f} us/token "
            f"({s['bytes_per_token']['total'] / 1e6:.1f} MB at {s['copy_bandwidth']['bytes_per_s'] / 1e9:.0f} GB/s): "
            f"graphed at {s['graphed_fraction_of_floor']:.1%} of it"
        )
    elif s:
        lines.append(f"speed case: {s.get('skipped') or s.get('error')}")
    for g in report["goals"]:
        state = {True: "PASS", False: "MISS", None: "n/a "}[g["passed"]]
        lines.append(f"{state} {g['goal']}" + (f": {g['value']:.2f}x" if g.get("value") else ""))
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="devgraph backend (default: best available)")
    parser.add_argument(
        "--archs", nargs="+", choices=sorted(HF_ARCHITECTURES), default=list(HF_ARCHITECTURES)
    )
    parser.add_argument("--tokens", type=int, default=None, help="new tokens of each compared generate (16)")
    parser.add_argument(
        "--rate-tokens", type=int, default=None, help="new tokens of each timed generate (32)"
    )
    parser.add_argument("--prompt", type=int, default=8, help="prompt length")
    parser.add_argument("--speed-arch", choices=sorted(HF_ARCHITECTURES), default="llama")
    parser.add_argument("--speed-tokens", type=int, default=None, help="new tokens of the speed case (128)")
    parser.add_argument("--speed-prompt", type=int, default=32)
    parser.add_argument("--no-speed", action="store_true", help="skip the speed case")
    parser.add_argument("--quick", action="store_true", help="tiny everything, few tokens (a smoke run)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    quick = args.quick
    args.shape = dict(TINY_SHAPE)
    args.tokens = args.tokens or (3 if quick else 16)
    args.rate_tokens = args.rate_tokens or (4 if quick else 32)
    args.cache_len = args.prompt + max(args.tokens, args.rate_tokens) + 8
    args.speed_tokens = args.speed_tokens or (4 if quick else 128)
    args.speed_shape = dict(QUICK_SHAPE if quick else FULL_SHAPE)
    args.copy_bytes = 2**24 if quick else 2**30
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dev, header = start(args.device, "hf_generate")
    try:
        import transformers

        version = transformers.__version__
    except ImportError:
        version = None
    report: dict[str, Any] = {
        **header,
        "transformers": version,
        "config": {
            "archs": args.archs,
            "shape": args.shape,
            "prompt": args.prompt,
            "tokens": args.tokens,
            "rate_tokens": args.rate_tokens,
            "cache_len": args.cache_len,
            "buckets": [1, 4],
            "speed_arch": None if args.no_speed else args.speed_arch,
            "speed_shape": args.speed_shape,
            "speed_tokens": args.speed_tokens,
            "quick": args.quick,
            "seed": args.seed,
        },
        "archs": {},
        "goals": [],
    }
    partial = PartialReport(
        args.out / (f"hf_generate_{dev.name}" + ("_quick" if args.quick else "") + ".json")
    )
    for arch in args.archs:
        logger.info("== %s", arch)
        report["archs"][arch] = measure_arch(dev, arch, args)
        report["goals"] = goals(report)
        partial.row_done(report)
    if not args.no_speed:
        logger.info("== speed case: %s", args.speed_arch)
        report["speed"] = measure_speed(dev, args)
    report["goals"] = goals(report)
    path = partial.finish(report)
    print(render(report))
    print(f"wrote {path}")
    failed = [
        a for a, r in report["archs"].items() if "error" in r or r.get("fp32_tokens_identical") is False
    ]
    failed += ["speed"] if "error" in report.get("speed", {}) else []
    if failed:
        logger.error("failed: %s", ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
