"""Run one vLLM engine and write its greedy tokens and devgraph's counters as JSON.

Usage: python _run_engine.py MODEL_DIR MODE OUT_JSON, MODE in eager, eager-native (eager with vLLM's
torch implementations of its custom ops), default (vLLM's default compilation
config, unchanged), or a cudagraph_mode (PIECEWISE, FULL, FULL_DECODE_ONLY, FULL_AND_PIECEWISE) with
capture sizes 1, 2, 4, 8; ``breakable:PIECEWISE`` and ``breakable:FULL_AND_PIECEWISE`` are those
modes with vLLM's own switch VLLM_USE_BREAKABLE_CUDAGRAPH=1 (no torch.compile: PIECEWISE batches from
breakable graphs of the whole model) and capture sizes up to 64, so that the prefill step (61 tokens)
fits one too.
Run in a fresh process per engine: vLLM resolves its platform once per process (DEVGRAPH_VLLM is
read then). The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that the
graph wrappers' counters are this process's.
"""

from __future__ import annotations

import json
import sys

# Prompts of different lengths, more of them (10) than the largest capture size (8), each generating
# a different number of tokens: decode batches shrink from 10 (above the largest size: eager) to 1.
PROMPTS = [
    "w1 w2 w3",
    "w10 w20 w30 w40 w50 w60 w70",
    "w5",
    "w100 w101 w102 w103 w104 w105 w106 w107 w108 w109 w110 w111 w112",
    "w42 w43 w44 w45 w46",
    "w7 w8",
    "w200 w201 w202 w203",
    "w61 w62 w63 w64 w65 w66",
    "w9",
    "w150 w151 w152 w153 w154 w155 w156 w157 w158",
]
CAPTURE_SIZES = [1, 2, 4, 8]
#: Top logprobs recorded per output position (exact floats: JSON keeps a float's repr).
LOGPROBS = 5
MAX_TOKENS = [4 + i for i in range(len(PROMPTS))]
#: Breakable modes: sizes up to the prefill step of all prompts (61 tokens), 1 included.
BREAKABLE_CAPTURE_SIZES = [1, 2, 4, 8, 16, 32, 64]
BREAKABLE = "breakable:"


def main(model: str, mode: str, out: str) -> None:
    import os

    sizes = CAPTURE_SIZES
    if mode.startswith(BREAKABLE):
        # vLLM's own switch; set before vLLM is imported, as a user would set it.
        os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"] = "1"
        mode, sizes = mode[len(BREAKABLE) :], BREAKABLE_CAPTURE_SIZES

    import torch
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    compilation: dict = {"mode": 3, "backend": "eager"}  # VLLM_COMPILE, eager pieces
    if mode == "eager":
        kwargs = {"enforce_eager": True}
    elif mode == "eager-native":
        # Eager with vLLM's torch implementations of its custom ops (RMSNorm, SiluAndMul, rotary):
        # the model code a FULL_DECODE_ONLY engine with devgraph's attention runs, graphs aside.
        kwargs = {"enforce_eager": True, "compilation_config": {"custom_ops": ["none"]}}
    elif mode == "default":
        kwargs = {"max_num_seqs": 8}  # vLLM's default compilation config; fewer capture sizes (16 at most)
    else:
        compilation.update(cudagraph_mode=mode, cudagraph_capture_sizes=sizes)
        kwargs = {"compilation_config": compilation}
    kwargs.setdefault("max_num_seqs", 16)
    llm = LLM(model=model, dtype="float32", seed=0, max_model_len=128, **kwargs)
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=LOGPROBS) for n in MAX_TOKENS
    ]
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
        # Per request, per output position: [[token id, logprob], ...] of the top LOGPROBS tokens.
        "logprobs": [
            [sorted([t, p.logprob] for t, p in position.items()) for position in r.outputs[0].logprobs]
            for r in results
        ],
        "platform": [c.__module__ + "." + c.__qualname__ for c in type(current_platform).__mro__],
        "cudagraph_mode": str(llm.llm_engine.vllm_config.compilation_config.cudagraph_mode.name),
        "capture_sizes": list(llm.llm_engine.vllm_config.compilation_config.cudagraph_capture_sizes or []),
        "compilation_mode": str(llm.llm_engine.vllm_config.compilation_config.mode.name),
        "stats": stats,
    }
    with open(out, "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
