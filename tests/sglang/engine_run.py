"""Runs a real ``sgl.Engine`` on CPU under the devgraph platform and writes its outputs as JSON.

``python engine_run.py MODEL_DIR OUT.json graphs|eager [--requests N] [--max-new-tokens N]
[--max-running N] [--capture 1,2,3]``: the same engine configuration both ways
(``SGLANG_PLATFORM=devgraph``, the ``devgraph`` attention backend, the model's saved weights);
``graphs`` captures decode graphs through devgraph, ``eager`` runs every step eagerly. On device
``cpu`` SGLang 0.5.23 captures decode graphs only with ``enable_torch_compile``;
``torch_compile_max_bs=0`` compiles no bucket's forward (see the README's SGLang section). The output
JSON holds the output ids per request, the engine start time and the generation time. Run as a
script (SGLang starts its scheduler in subprocesses) by ``test_engine.py`` and
``benchmarks/sglang_start.py``, under a timeout.
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

#: Written to stderr once ``sgl.Engine(...)`` has returned (a test tells a refusal at start by its absence).
STARTED = "engine_run: engine started"


def prompts(n: int) -> list[str]:
    """``n`` fixed prompts of 3 to 12 words from the tiny vocabulary."""
    rng = random.Random(0)
    return [" ".join(rng.choices(tiny_model.WORDS, k=rng.randint(3, 12))) for _ in range(n)]


def max_new_tokens(n: int, longest: int) -> list[int]:
    """Output lengths from ``longest // 2`` to ``longest``, so decode batches shrink and refill."""
    return [longest - (i * 37) % (longest // 2 + 1) for i in range(n)]


def engine_kwargs(mode: str, *, max_running: int, capture: list[int] | None) -> dict:
    """The ``sgl.Engine`` arguments of one mode (the graph settings are the only difference)."""
    kwargs = dict(
        device="cpu",
        attention_backend="devgraph",
        mem_fraction_static=0.05,
        max_total_tokens=8192,
        max_running_requests=max_running,
        context_length=256,
        random_seed=0,
        skip_server_warmup=True,
        log_level="warning",
    )
    if mode == "graphs":
        kwargs.update(enable_torch_compile=True, torch_compile_max_bs=0)
        if capture is not None:
            kwargs["cuda_graph_bs_decode"] = capture
    elif mode == "eager":
        kwargs.update(disable_cuda_graph=True)
    else:
        raise SystemExit(f"mode must be graphs or eager, not {mode!r}")
    return kwargs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("out")
    parser.add_argument("mode", choices=["graphs", "eager"])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=150)
    parser.add_argument("--max-running", type=int, default=16)
    parser.add_argument(
        "--capture", default=None, help="decode capture sizes, e.g. 1,2,4 (default: SGLang's)"
    )
    args = parser.parse_args()
    if os.environ.get("SGLANG_PLATFORM") != "devgraph":
        raise SystemExit("run with SGLANG_PLATFORM=devgraph")
    import sglang as sgl

    capture = [int(s) for s in args.capture.split(",")] if args.capture else None
    start = time.perf_counter()
    engine = sgl.Engine(
        model_path=args.model_dir,
        **engine_kwargs(args.mode, max_running=args.max_running, capture=capture),
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
        )
        generated = time.perf_counter() - start
    finally:
        engine.shutdown()
    with open(args.out, "w") as f:
        json.dump(
            {"output_ids": [o["output_ids"] for o in outputs], "start_s": started, "generate_s": generated},
            f,
        )


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    main()
