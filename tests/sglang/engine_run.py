"""Runs a real ``sgl.Engine`` on CPU under the devgraph platform and writes its outputs as JSON.

``python engine_run.py MODEL_DIR OUT.json graphs|eager``: the same engine configuration both ways
(``SGLANG_PLATFORM=devgraph``, the ``devgraph`` attention backend, dummy weights from a fixed seed);
``graphs`` captures decode graphs through devgraph, ``eager`` runs every step eagerly. On device
``cpu`` SGLang 0.5.23 captures decode graphs only with ``enable_torch_compile``; ``torch_compile_max_bs=0``
compiles no bucket's forward as a whole (what SGLang still compiles is recorded whole). Run as a script (SGLang starts
its scheduler in subprocesses) by ``test_engine.py``, under a timeout.
"""

from __future__ import annotations

import json
import logging
import os
import sys

PROMPTS = [
    "the first word of the day",
    "one two three",
    "what is the name of that water",
]
CAPTURE_SIZES = [1, 2, 4]
MAX_NEW_TOKENS = 12


def main(model_dir: str, out_path: str, mode: str) -> None:
    if os.environ.get("SGLANG_PLATFORM") != "devgraph":
        raise SystemExit("run with SGLANG_PLATFORM=devgraph")
    import sglang as sgl

    graphs = mode == "graphs"
    engine = sgl.Engine(
        model_path=model_dir,
        device="cpu",
        load_format="dummy",
        attention_backend="devgraph",
        disable_cuda_graph=not graphs,
        enable_torch_compile=graphs,
        torch_compile_max_bs=0,
        cuda_graph_bs_decode=CAPTURE_SIZES,
        mem_fraction_static=0.05,
        max_total_tokens=1024,
        max_running_requests=4,
        context_length=128,
        random_seed=0,
        skip_server_warmup=True,
        log_level="warning",
    )
    try:
        outputs = engine.generate(
            PROMPTS, {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True}
        )
    finally:
        engine.shutdown()
    with open(out_path, "w") as f:
        json.dump([o["output_ids"] for o in outputs], f)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    main(*sys.argv[1:4])
