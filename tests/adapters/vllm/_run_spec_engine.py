"""Run one vLLM engine with speculative decoding; write tokens, logprobs, spec-decode metrics, counters.

Usage: python _run_spec_engine.py TARGET_DIR DRAFT_DIR METHOD MODE OUT_JSON

METHOD: ``draft_model`` (DRAFT_DIR a smaller model with the target's vocabulary), ``eagle`` (DRAFT_DIR
an EAGLE head) or ``ngram`` (DRAFT_DIR unused). MODE: ``eager`` (``enforce_eager``: vLLM's C++ kernels), ``default``
(vLLM's default compilation config), a ``cudagraph_mode`` name, or ``breakable:MODE`` (vLLM's
``VLLM_USE_BREAKABLE_CUDAGRAPH=1``). Greedy sampling; the engine core runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so devgraph's counters are the engine's.
"""

from __future__ import annotations

import json
import os
import sys

#: Prompts with repeats (so that n-gram drafts are sometimes accepted), of different lengths.
PROMPTS = [
    "w1 w2 w3 w1 w2 w3 w1 w2",
    "w10 w20 w30 w40 w50 w60 w70",
    "w5",
    "w100 w101 w102 w103 w100 w101 w102 w103 w100 w101",
    "w42 w43 w44 w45 w46",
    "w7 w8 w7 w8 w7",
]
MAX_TOKENS = [12 + 2 * i for i in range(len(PROMPTS))]
#: n-gram drafts need the last token to occur earlier: long prompts of distinct words, long outputs
#: (the random model's greedy output also falls into cycles, which the n-gram proposer then predicts).
NGRAM_PROMPTS = [" ".join(f"w{i}" for i in range(start, start + 60)) for start in (0, 60, 120)]
NGRAM_MAX_TOKENS = [40, 36, 32]
NUM_SPEC_TOKENS = 3
LOGPROBS = 5
CAPTURE_SIZES = [1, 2, 4, 8, 16, 32]
BREAKABLE_CAPTURE_SIZES = [1, 2, 4, 8, 16, 32, 64]


def spec_config(method: str, draft: str) -> dict:
    if method == "ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": NUM_SPEC_TOKENS,
            "prompt_lookup_max": 3,
            "prompt_lookup_min": 1,
        }
    return {"method": method, "model": draft, "num_speculative_tokens": NUM_SPEC_TOKENS}


def metrics(llm) -> dict:
    found: dict = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            found[m.name] = getattr(m, "values", None) or getattr(m, "value", None)
    return found


def main(target: str, draft: str, method: str, mode: str, out: str) -> None:
    *options, mode = mode.split(":")
    sizes = CAPTURE_SIZES
    if "breakable" in options:
        os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"] = "1"
        sizes = BREAKABLE_CAPTURE_SIZES

    import torch
    from vllm import LLM, SamplingParams

    if mode == "eager":
        kwargs: dict = {"enforce_eager": True}
    elif mode == "default":
        kwargs = {}
    else:
        kwargs = {
            "compilation_config": {
                "mode": 3,
                "backend": "eager",
                "cudagraph_mode": mode,
                "cudagraph_capture_sizes": sizes,
            }
        }
    llm = LLM(
        model=target,
        dtype="float32",
        seed=0,
        max_model_len=128,
        max_num_seqs=8,
        disable_log_stats=False,
        speculative_config=spec_config(method, draft),
        **kwargs,
    )
    prompts, max_tokens = (NGRAM_PROMPTS, NGRAM_MAX_TOKENS) if method == "ngram" else (PROMPTS, MAX_TOKENS)
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=LOGPROBS) for n in max_tokens
    ]
    with torch.inference_mode():
        results = llm.generate(prompts, params, use_tqdm=False)
    stats = {}
    try:
        from devgraph.adapters.vllm import stats as devgraph_stats
        from devgraph.adapters.vllm._spec_decode import report_unreplayed_drafter_graphs

        report_unreplayed_drafter_graphs()  # what the worker's shutdown reports, counted before reading
        stats = devgraph_stats()
    except ImportError:
        pass
    cc = llm.llm_engine.vllm_config.compilation_config
    record = {
        "tokens": [list(r.outputs[0].token_ids) for r in results],
        "logprobs": [
            [sorted([t, p.logprob] for t, p in position.items()) for position in r.outputs[0].logprobs]
            for r in results
        ],
        "metrics": metrics(llm),
        "cudagraph_mode": str(cc.cudagraph_mode.name),
        "compilation_mode": str(cc.mode.name),
        "capture_sizes": list(cc.cudagraph_capture_sizes or []),
        "stats": stats,
    }
    with open(out, "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main(*sys.argv[1:6])
