"""The Dynamo front end's cost: host time per call with the replay stubbed, and wrap plus first call.

Two front ends serve the same model in ``mode="full"``: ``frontend="raw"`` (the forward captured as it
runs) and ``frontend="dynamo"`` (Dynamo traces, devgraph captures each graph). Measured side by side
in one run, on the reference paged decoder of ``devgraph.testing.models`` (hidden 64, called with
keyword arguments as an engine does) and on a small MLP:

* host time per call, every captured graph's replay stubbed (``host_overhead.stub_replay``: what is
  timed is Python alone), against the hand-written loop of ``host_overhead.py`` (copy the inputs
  into static buffers, replay, slice). The Dynamo front end's time is split: the runner of the
  graph Dynamo handed over called directly (the same runner, no Dynamo), and the rest (Dynamo's
  guard evaluation and frame, devgraph's marking of dynamic dimensions, splitting Dynamo's arguments,
  assembling the outputs): its share is reported. Targets recorded: 1.5x the hand-written loop.
* wrap plus first call (trace, capture of every bucket, the call), wall-clock seconds, both front
  ends; a tiny Hugging Face Llama too (``generate`` of 4 new tokens: its decode steps traced by
  Dynamo, or captured as they run).

The paged decoder takes a Python list (``seq_lens_host``, one value per row): Dynamo specialises on a
list, so with ``frontend="dynamo"`` each batch size is its own graph, captured at that size alone.

    python benchmarks/dynamo_frontend.py            # cpu, about a minute
    python benchmarks/dynamo_frontend.py --quick    # smoke run

Writes ``<out>/dynamo_frontend.json`` (``dynamo_frontend_quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _common import DEFAULT_OUT, PartialReport, logger, report_header
from host_overhead import FULL_TARGET, decode_batch, per_call_us, stub_replay

import devgraph
from devgraph.testing.models import DecoderConfig, make_decoder

NOTE = (
    "host time only: every captured graph's replay is a no-op; 'dynamo_share' is the part of the Dynamo "
    "front end's time spent outside the graph's runner (guards, frame, argument marking and splitting)"
)


def _mlp(width: int = 256) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
    ).eval()


def _hand_loop(tensors: dict[str, torch.Tensor], rows: int, bucket: int, out_width: int) -> Callable[[], Any]:
    """Copy each tensor input into the first ``rows`` rows of a static buffer, (no) replay, slice."""
    static = {
        k: torch.zeros((bucket, *v.shape[1:]), dtype=v.dtype, device=v.device) for k, v in tensors.items()
    }
    out = torch.zeros(bucket, out_width)

    def hand() -> torch.Tensor:
        for name, x in tensors.items():
            static[name][:rows].copy_(x)
        return out[:rows]

    return hand


def _host_case(
    name: str, model: torch.nn.Module, batch: dict[str, Any], sizes: list[int], out_width: int, args: Any
) -> dict[str, Any]:
    rows = next(v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor))
    bucket = min(s for s in sizes if s >= rows)
    raw = devgraph.wrap(model, device="cpu", frontend="raw", batch_sizes=sizes)
    # host_args=(): the model's devgraph_options name its host lengths, which the Dynamo front end
    # refuses; through Dynamo the list is a constant of the trace (the same batch every call here)
    dyn = devgraph.wrap(model, device="cpu", frontend="dynamo", batch_sizes=sizes, host_args=())
    with torch.no_grad():
        raw(**batch)
        dyn(**batch)
        dyn(**batch)
    stub_replay(graph for _, graph in raw.runner.full.graphs.items())
    for runner in dyn.graphs.runners:
        if runner.full is not None and runner.full.buckets is not None:
            stub_replay(graph for _, graph in runner.full.graphs.items())
    with dyn.graphs.recording() as log, torch.no_grad():
        dyn(**batch)
    (served,) = log  # one graph serves this call
    runner, arguments = served.runner, served.arguments
    tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    fns = {
        "raw": lambda: raw(**batch),
        "dynamo": lambda: dyn(**batch),
        "dynamo_runner": lambda: runner(*arguments),
        "hand": _hand_loop(tensors, rows, bucket, out_width),
    }
    with torch.no_grad():
        us = per_call_us(fns, args.iters, args.repeats)
    assert raw.stats.eager_calls == 0 and dyn.stats.eager_calls == 0, (raw.stats, dyn.stats)
    case = {
        "model": name,
        "batch": rows,
        "bucket": bucket if dyn.stats.captured_sizes != (rows,) else rows,
        "raw_us": us["raw"],
        "dynamo_us": us["dynamo"],
        "dynamo_runner_us": us["dynamo_runner"],
        "hand_us": us["hand"],
        "raw_ratio": us["raw"] / us["hand"],
        "dynamo_ratio": us["dynamo"] / us["hand"],
        "dynamo_share": max(0.0, us["dynamo"] - us["dynamo_runner"]) / us["dynamo"],
        "target": FULL_TARGET,
        "dynamo_graphs": dyn.stats.graphs,
        "dynamo_captured_sizes": list(dyn.stats.captured_sizes),
    }
    case["dynamo_passed"] = case["dynamo_ratio"] <= FULL_TARGET
    logger.info(
        "%s batch %d: hand %.1f us, raw %.1f us (%.2fx), dynamo %.1f us (%.2fx; its runner %.1f us, Dynamo's "
        "share %.0f%%)",
        name, rows, us["hand"], us["raw"], case["raw_ratio"], us["dynamo"], case["dynamo_ratio"],
        us["dynamo_runner"], 100 * case["dynamo_share"],
    )  # fmt: skip
    return case


def _first_call(
    name: str, build: Callable[[], tuple[Any, Callable[[Any], Any]]], frontend: str
) -> dict[str, Any]:
    torch._dynamo.reset()
    start = time.perf_counter()
    try:
        model, call = build()
        # the decoder's devgraph_options name its host lengths (served by the raw front end); through
        # Dynamo the list is a constant of each trace
        extra = {"host_args": ()} if frontend == "dynamo" and hasattr(model, "devgraph_options") else {}
        graphed = devgraph.wrap(model, device="cpu", frontend=frontend, max_batch_size=8, **extra)
        with torch.no_grad():
            call(graphed)
    except devgraph.DevgraphError as e:
        return {"model": name, "frontend": frontend, "refused": str(e)}
    seconds = time.perf_counter() - start
    logger.info("%s, frontend=%s: wrap + first call %.2f s", name, frontend, seconds)
    return {"model": name, "frontend": frontend, "seconds": seconds}


def _decoder() -> tuple[Any, Callable[[Any], Any]]:
    config = DecoderConfig(num_layers=4)
    batch = decode_batch(config, torch.device("cpu"), 3)
    return make_decoder(config), lambda graphed: graphed(**batch)


def _hf_llama() -> tuple[Any, Callable[[Any], Any]]:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 128, (2, 6))
    return model, lambda graphed: graphed.generate(ids, max_new_tokens=4, do_sample=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=1000, help="calls per timed run")
    parser.add_argument("--repeats", type=int, default=9, help="timed runs per case (the best is reported)")
    parser.add_argument("--quick", action="store_true", help="smoke run: few iterations")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.quick:
        args.iters, args.repeats = 50, 2
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    torch.set_num_threads(1)
    name = "dynamo_frontend_quick.json" if args.quick else "dynamo_frontend.json"
    partial = PartialReport(args.out / name)
    dev = devgraph.device("cpu")
    report: dict[str, Any] = {
        **report_header(dev, "dynamo_frontend", note=NOTE),
        "host": [],
        "first_call": [],
    }
    sizes = [1, 2, 4, 8]
    config = DecoderConfig(num_layers=2)
    for rows in (1, 3):
        report["host"].append(
            _host_case("paged decoder L=2", make_decoder(config), decode_batch(config, torch.device("cpu"), rows), sizes, config.vocab_size, args)
        )  # fmt: skip
        partial.row_done(report)
    for rows in (1, 3):
        report["host"].append(
            _host_case("MLP 256", _mlp(), {"input": torch.randn(rows, 256)}, sizes, 256, args)
        )
        partial.row_done(report)
    for label, build in (("paged decoder L=4", _decoder), ("HF Llama 2 layers", _hf_llama)):
        for frontend in ("raw", "dynamo"):
            report["first_call"].append(_first_call(label, build, frontend))
            partial.row_done(report)
    path = partial.finish(report)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
