"""Run one vLLM engine and write its greedy tokens and devgraph's counters as JSON.

Usage: python _run_engine.py MODEL_DIR MODE OUT_JSON, MODE in eager, FULL, PIECEWISE, FULL_AND_PIECEWISE.
Run in a fresh process per engine: vLLM resolves its platform once per process (DEVGRAPH_VLLM is
read then). The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that the
graph wrappers' counters are this process's.
"""

from __future__ import annotations

import json
import sys

# Prompts of different lengths, more of them than the smallest capture size.
PROMPTS = [
    "w1 w2 w3",
    "w10 w20 w30 w40 w50 w60 w70",
    "w5",
    "w100 w101 w102 w103 w104 w105 w106 w107 w108 w109 w110 w111 w112",
    "w42 w43 w44 w45 w46",
]
CAPTURE_SIZES = [1, 2, 4, 8]
MAX_TOKENS = 12


def main(model: str, mode: str, out: str) -> None:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    compilation: dict = {"mode": 3, "backend": "eager"}  # VLLM_COMPILE, eager pieces
    if mode == "eager":
        kwargs = {"enforce_eager": True}
    else:
        compilation.update(cudagraph_mode=mode, cudagraph_capture_sizes=CAPTURE_SIZES)
        kwargs = {"compilation_config": compilation}
    llm = LLM(model=model, dtype="float32", seed=0, max_model_len=128, max_num_seqs=8, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with torch.inference_mode():
        results = llm.generate(PROMPTS, params, use_tqdm=False)
    stats = {}
    try:
        from devgraph.adapters.vllm import stats as devgraph_stats

        stats = devgraph_stats()
    except ImportError:
        pass
    record = {
        "tokens": [list(r.outputs[0].token_ids) for r in results],
        "platform": [c.__module__ + "." + c.__qualname__ for c in type(current_platform).__mro__],
        "cudagraph_mode": str(llm.llm_engine.vllm_config.compilation_config.cudagraph_mode.name),
        "stats": stats,
    }
    with open(out, "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
