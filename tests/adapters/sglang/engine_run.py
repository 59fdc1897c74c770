"""Runs a real ``sgl.Engine`` on CPU under the devgraph platform and writes its outputs as JSON.

``python engine_run.py MODEL_DIR OUT.json graphs|eager|unset [--requests N] [--max-new-tokens N]
[--max-running N] [--capture 1,2,3] [--page-size N] [--max-bs N] [--prefill] [--prefill-max-tokens N]``:
the same engine configuration both ways (``SGLANG_PLATFORM=devgraph``, the ``devgraph`` attention
backend, the model's saved weights); ``graphs`` captures decode graphs through devgraph (and, with
``--prefill``, prefill graphs by devgraph's breakable capture: ``cuda_graph_backend_prefill="breakable"``,
token buckets up to ``--prefill-max-tokens``, SGLang's ``cuda_graph_max_bs_prefill``), ``eager`` runs
every step eagerly. On device
``cpu`` SGLang 0.5.23 captures decode graphs only with ``enable_torch_compile``;
``torch_compile_max_bs=0`` compiles no bucket's forward (see the README's SGLang section). The output
JSON holds the output ids per request, the engine start time and the generation time. Run as a
script (SGLang starts its scheduler in subprocesses) by ``test_engine.py``, ``test_engine_npu.py`` and
``benchmarks/sglang_start.py``, under a timeout. With ``DEVGRAPH_SGLANG_NPU_SIM=1`` every process of
the engine runs on devgraph's torch_npu simulator (tests/sim) (devgraph's NPU backend on CPU tensors).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import time

import tiny_model

#: Set to 1 to run every process of the engine on devgraph's torch_npu simulator (tests/sim) (see below).
NPU_SIM_ENV = "DEVGRAPH_SGLANG_NPU_SIM"

if os.environ.get(NPU_SIM_ENV) == "1":
    # SGLang starts its scheduler and detokenizer with multiprocessing's spawn, which runs this
    # module's top level again in each of them (as ``__mp_main__``) before the process's target:
    # every process then holds the simulator in sys.modules (for its whole life, so the block is
    # never left) before SGLang loads the devgraph platform. devgraph.device() is then devgraph's
    # NPU backend on CPU tensors: the engine runs on device "cpu" and captures NPU graphs. Left at
    # exit (a process SGLang ends normally): its queued device work must finish (a hang raises).
    import atexit

    from devgraph_sim.npu import simulated_torch_npu

    _NPU_SIM = simulated_torch_npu()
    _NPU_SIM.__enter__()
    atexit.register(_NPU_SIM.__exit__, None, None, None)

#: Written to stderr once ``sgl.Engine(...)`` has returned (a test tells a refusal at start by its absence).
STARTED = "engine_run: engine started"


def prompts(n: int) -> list[str]:
    """``n`` fixed prompts of 3 to 12 words from the tiny vocabulary."""
    rng = random.Random(0)
    return [" ".join(rng.choices(tiny_model.WORDS, k=rng.randint(3, 12))) for _ in range(n)]


def max_new_tokens(n: int, longest: int) -> list[int]:
    """Output lengths from ``longest // 2`` to ``longest``, so decode batches shrink and refill."""
    return [longest - (i * 37) % (longest // 2 + 1) for i in range(n)]


def engine_kwargs(
    mode: str,
    *,
    max_running: int,
    capture: list[int] | None,
    page_size: int = 1,
    max_bs: int | None = None,
    prefill: bool = False,
    prefill_max_tokens: int | None = None,
    compile_max_bs: int = 0,
) -> dict:
    """The ``sgl.Engine`` arguments of one mode (the graph settings are the only difference).

    ``unset``: no graph setting at all (SGLang's defaults: on ``cpu`` no decode graph, and devgraph
    warns at start). ``max_bs``: ``cuda_graph_max_bs_decode``. ``prefill`` (``graphs`` only): prefill
    graphs too, by breakable capture, up to ``prefill_max_tokens`` tokens (None: SGLang's default).
    """
    kwargs = dict(
        device="cpu",
        page_size=page_size,
        attention_backend="devgraph",
        mem_fraction_static=0.05,
        max_total_tokens=8192,
        max_running_requests=max_running,
        context_length=256,
        random_seed=0,
        skip_server_warmup=True,
        log_level="warning",
    )
    if max_bs is not None:
        kwargs["cuda_graph_max_bs_decode"] = max_bs
    if mode == "graphs":
        kwargs.update(enable_torch_compile=True, torch_compile_max_bs=compile_max_bs)
        if capture is not None:
            kwargs["cuda_graph_bs_decode"] = capture
        if prefill:
            kwargs["cuda_graph_backend_prefill"] = "breakable"
            if prefill_max_tokens is not None:
                kwargs["cuda_graph_max_bs_prefill"] = prefill_max_tokens
    elif mode == "eager":
        kwargs.update(disable_cuda_graph=True)
    elif mode != "unset":
        raise SystemExit(f"mode must be graphs, eager or unset, not {mode!r}")
    return kwargs


def _top2(output: dict) -> list[list[float]]:
    """Each generated token's two highest log-probabilities (SGLang's ``output_top_logprobs``)."""
    return [[lp for lp, _id, *_ in top[:2]] for top in output["meta_info"]["output_top_logprobs"]]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("out")
    parser.add_argument("mode", choices=["graphs", "eager", "unset"])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=150)
    parser.add_argument("--max-running", type=int, default=16)
    parser.add_argument(
        "--capture", default=None, help="decode capture sizes, e.g. 1,2,4 (default: SGLang's)"
    )
    parser.add_argument("--page-size", type=int, default=1, help="KV cache page (block) size")
    parser.add_argument("--max-bs", type=int, default=None, help="cuda_graph_max_bs_decode")
    parser.add_argument("--prefill", action="store_true", help="graphs mode: prefill graphs too (breakable)")
    parser.add_argument("--prefill-max-tokens", type=int, default=None, help="cuda_graph_max_bs_prefill")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="graphs mode: keep SGLang's torch.compile of every captured size (DEVGRAPH_SGLANG_COMPILE=1)",
    )
    parser.add_argument(
        "--logprobs", action="store_true", help="also save each token's top-2 log-probabilities"
    )
    args = parser.parse_args()
    if os.environ.get("SGLANG_PLATFORM") != "devgraph":
        raise SystemExit("run with SGLANG_PLATFORM=devgraph")
    import sglang as sgl

    capture = [int(s) for s in args.capture.split(",")] if args.capture else None
    compile_max_bs = 0
    if args.compile:
        if args.mode != "graphs":
            raise SystemExit("--compile applies to graphs mode")
        os.environ["DEVGRAPH_SGLANG_COMPILE"] = "1"  # read by the scheduler process devgraph's runner runs in
        compile_max_bs = max(capture) if capture else args.max_running
    start = time.perf_counter()
    engine = sgl.Engine(
        model_path=args.model_dir,
        **engine_kwargs(
            args.mode,
            max_running=args.max_running,
            capture=capture,
            page_size=args.page_size,
            max_bs=args.max_bs,
            prefill=args.prefill,
            prefill_max_tokens=args.prefill_max_tokens,
            compile_max_bs=compile_max_bs,
        ),
    )
    started = time.perf_counter() - start
    print(STARTED, file=sys.stderr, flush=True)
    try:
        start = time.perf_counter()
        outputs = engine.generate(
            prompts(args.requests),
            [
                {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
                for n in max_new_tokens(args.requests, args.max_new_tokens)
            ],
            **({"return_logprob": True, "top_logprobs_num": 2} if args.logprobs else {}),
        )
        generated = time.perf_counter() - start
    finally:
        engine.shutdown()
    with open(args.out, "w") as f:
        json.dump(
            {
                "output_ids": [o["output_ids"] for o in outputs],
                "start_s": started,
                "generate_s": generated,
                **({"top2": [_top2(o) for o in outputs]} if args.logprobs else {}),
            },
            f,
        )


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    main()
