"""Run one vLLM engine and write its greedy tokens and devgraph's counters as JSON.

Usage: python _run_engine.py MODEL_DIR MODE OUT_JSON, MODE in eager (``enforce_eager=True``), eager-native
(eager with vLLM's torch implementations of its custom ops, ``custom_ops=["none"]``), default (vLLM's
default compilation config, unchanged), or a cudagraph_mode (PIECEWISE, FULL, FULL_DECODE_ONLY,
FULL_AND_PIECEWISE) with capture sizes 1, 2, 4, 8, set as a user sets it
(``compilation_config={'cudagraph_mode': MODE, 'cudagraph_capture_sizes': [...]}``: vLLM's default
compilation mode and backend otherwise); ``breakable:PIECEWISE`` and ``breakable:FULL_AND_PIECEWISE`` are those
modes with vLLM's own switch VLLM_USE_BREAKABLE_CUDAGRAPH=1 (no torch.compile: PIECEWISE batches from
breakable graphs of the whole model) and capture sizes up to 64, so that the prefill step (61 tokens)
fits one too. More options go before the mode the same way (``OPTION:...:MODE``):
``no-debug``: ``DEVGRAPH_DEBUG`` unset (the wrapper's address checks are its always-on ones only);
``moved-input-ids``: once the engine has started, the model runner's ``input_ids`` buffer is replaced by
a copy, so that every later step hands the graphs a tensor at another address than at capture (a
broken runner);
``kv-fp8``: an fp8 KV cache (``kv_cache_dtype='fp8'``).
A model directory with a ``tokenizer`` subdirectory (``_tiny_model.TOKENIZER_SUBDIR``) is given that
tokenizer.
Run in a fresh process per engine: vLLM resolves its platform once per process (DEVGRAPH_VLLM is
read then). The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that the
graph wrappers' counters are this process's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from _tiny_model import TOKENIZER_SUBDIR

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


OPTIONS = ("breakable", "kv-fp8", "no-debug", "moved-input-ids")


def _move_input_ids(worker) -> None:
    """Give the model runner a new ``input_ids`` buffer: vLLM's runner writes each step's token ids
    into ``input_ids.cpu`` (and its numpy view ``np``), copies them to ``input_ids.gpu`` and passes
    slices of that; on CPU ``gpu`` is the ``cpu`` tensor itself. The captured tensor stays alive (as a
    runner's old buffer would) but is written no more: graphs reading it would replay stale token ids."""
    buffer = worker.model_runner.input_ids
    buffer.captured = buffer.cpu
    buffer.cpu = buffer.gpu = buffer.cpu.clone()
    buffer.np = buffer.cpu.numpy()


def main(model: str, mode: str, out: str) -> None:
    import os

    *options, mode = mode.split(":")
    unknown = set(options) - set(OPTIONS)
    if unknown:
        raise SystemExit(f"unknown options {sorted(unknown)}; known: {OPTIONS}")
    sizes = CAPTURE_SIZES
    if "breakable" in options:
        # vLLM's own switch; set before vLLM is imported, as a user would set it.
        os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"] = "1"
        sizes = BREAKABLE_CAPTURE_SIZES
    if "no-debug" in options:
        os.environ.pop("DEVGRAPH_DEBUG", None)

    import torch
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    if mode == "eager":
        kwargs = {"enforce_eager": True}
    elif mode == "eager-native":
        # Eager with vLLM's torch implementations of its custom ops (RMSNorm, SiluAndMul, rotary)
        # instead of its C++ kernels (what inductor compiles; a configuration users do not run eagerly).
        kwargs = {"enforce_eager": True, "compilation_config": {"custom_ops": ["none"]}}
    elif mode == "default":
        kwargs = {"max_num_seqs": 8}  # vLLM's default compilation config; fewer capture sizes (16 at most)
    else:
        kwargs = {"compilation_config": {"cudagraph_mode": mode, "cudagraph_capture_sizes": sizes}}
    kwargs.setdefault("max_num_seqs", 16)
    if "kv-fp8" in options:
        kwargs["kv_cache_dtype"] = "fp8"
    tokenizer = Path(model) / TOKENIZER_SUBDIR
    if tokenizer.is_dir():
        kwargs["tokenizer"] = str(tokenizer)
    llm = LLM(model=model, dtype="float32", seed=0, max_model_len=128, **kwargs)
    if "moved-input-ids" in options:
        llm.collective_rpc(_move_input_ids)
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
        # vLLM's custom ops (RMSNorm, SiluAndMul, rotary, ...) the model's layers resolved to their
        # platform kernels (enabled) or to their torch implementations (disabled), by name.
        "custom_ops": list(llm.llm_engine.vllm_config.compilation_config.custom_ops),
        "enabled_custom_ops": sorted(llm.llm_engine.vllm_config.compilation_config.enabled_custom_ops),
        "disabled_custom_ops": sorted(llm.llm_engine.vllm_config.compilation_config.disabled_custom_ops),
        "stats": stats,
    }
    with open(out, "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
