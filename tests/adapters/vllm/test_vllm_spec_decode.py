"""vLLM speculative decoding with devgraph's graphs: the target's verify steps and the drafter's.

Methods ``draft_model`` (a 1-layer Llama sharing the target's first layer), ``eagle`` (a random EAGLE
head) and ``ngram``; each engine runs the same requests with greedy sampling and
``num_speculative_tokens=3``. devgraph's engines are compared with vLLM without devgraph as users run it
on CPU: ``enforce_eager`` (vLLM's C++ kernels, which devgraph's graphs run too: docs/vllm.md). Equal
means every greedy token, every top-5 logprob of
every position and vLLM's spec-decode counters (drafts, draft tokens, accepted tokens per position).
"""

from __future__ import annotations

import concurrent.futures
import json
import os

import pytest
from _engine import HERE, engine_env, run_python

#: (method, mode, devgraph): every engine this module reads, started together.
SPEC_RUNS = (
    ("draft_model", "default", True),
    ("draft_model", "eager", False),
    ("draft_model", "PIECEWISE", True),
    ("eagle", "eager", False),
    ("eagle", "breakable:FULL_AND_PIECEWISE", True),
    ("ngram", "eager", False),
    ("ngram", "default", True),
)


@pytest.fixture(scope="module")
def spec_engine(tiny_model, tmp_path_factory):
    from _tiny_model import build_tiny_eagle_head, build_tiny_llama_drafter

    drafters = {
        "draft_model": build_tiny_llama_drafter(tiny_model, tmp_path_factory.mktemp("tiny-llama-drafter")),
        "eagle": build_tiny_eagle_head(tiny_model, tmp_path_factory.mktemp("tiny-eagle-head")),
        "ngram": tiny_model,  # unused
    }
    workdir = tmp_path_factory.mktemp("spec-runs")
    jobs = int(os.environ.get("DEVGRAPH_VLLM_TEST_JOBS", max(1, (os.cpu_count() or 2) // 2)))
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=jobs)

    def run(key):
        method, mode, devgraph = key
        out = workdir / f"{method}-{mode}-{devgraph}.json"
        script = [
            str(HERE / "_run_spec_engine.py"),
            str(tiny_model),
            str(drafters[method]),
            method,
            mode,
            str(out),
        ]
        return run_python(script, engine_env(devgraph)), out

    futures = {key: pool.submit(run, key) for key in SPEC_RUNS}

    def get(method: str, mode: str, devgraph: bool) -> dict:
        proc, out = futures[(method, mode, devgraph)].result()
        if proc.returncode != 0:
            pytest.fail(f"engine run {(method, mode, devgraph)} failed:\n{proc.stderr[-6000:]}")
        record = json.loads(out.read_text())
        record["log"] = proc.stderr
        return record

    yield get
    pool.shutdown(wait=True)


def assert_same_generation(graphed: dict, eager: dict) -> None:
    assert graphed["tokens"] == eager["tokens"]
    assert graphed["logprobs"] == eager["logprobs"]  # every top-5 logprob of every position, bit for bit
    assert graphed["metrics"] == eager["metrics"]


def test_draft_model_default_config_verify_steps_replay_full_graphs(spec_engine):
    graphed = spec_engine("draft_model", "default", True)
    assert_same_generation(graphed, spec_engine("draft_model", "eager", False))
    metrics = graphed["metrics"]
    # Drafts both accepted and rejected (the drafter shares the target's first layer).
    assert 0 < metrics["vllm:spec_decode_num_accepted_tokens"] < metrics["vllm:spec_decode_num_draft_tokens"]
    # vLLM keeps FULL graphs for the verify step (k + 1 = 4 tokens per request, sizes multiples of 4).
    assert graphed["cudagraph_mode"] == "FULL_DECODE_ONLY"
    assert all(size % 4 == 0 for size in graphed["capture_sizes"])
    stats = graphed["stats"]
    assert stats["replay.FULL"] > 0 and stats["update.FULL"] == stats["replay.FULL"]
    # The drafter has no graph mode in FULL_DECODE_ONLY: said once, with what to set.
    assert "the drafter's steps run eagerly" in graphed["log"]
    assert "VLLM_USE_BREAKABLE_CUDAGRAPH=1" in graphed["log"]
    assert not any(k.startswith(("capture.draft", "unreplayed")) for k in stats)


def test_draft_model_piecewise_drafter_and_target_pieces_replayed(spec_engine):
    # Compiled PIECEWISE (VLLM_COMPILE, eager pieces): vLLM's piecewise backend makes the drafter's
    # piece wrappers too; they are told apart by the drafter's model tag.
    graphed = spec_engine("draft_model", "PIECEWISE", True)
    assert_same_generation(graphed, spec_engine("draft_model", "eager", False))
    assert graphed["cudagraph_mode"] == "PIECEWISE"
    assert graphed["metrics"]["vllm:spec_decode_num_accepted_tokens"] > 0
    stats = graphed["stats"]
    assert stats["capture.draft.PIECEWISE"] > 0 and stats["replay.draft.PIECEWISE"] > 0
    assert stats["capture.PIECEWISE"] > 0 and stats["replay.PIECEWISE"] > 0
    assert "unreplayed.draft.PIECEWISE" not in stats


def test_eagle_head_breakable_graphs_serve_the_drafter_and_the_target(spec_engine):
    # vLLM's CPU runner runs EAGLE (EagleLlamaForCausalLM, fed the target's hidden states); the head is
    # the target's first layer, so some drafts are accepted: a drafter graph replaying wrong values
    # would change vLLM's acceptance counters (the tokens cannot change: the target verifies them).
    graphed = spec_engine("eagle", "breakable:FULL_AND_PIECEWISE", True)
    assert_same_generation(graphed, spec_engine("eagle", "eager", False))
    metrics = graphed["metrics"]
    assert 0 < metrics["vllm:spec_decode_num_accepted_tokens"] < metrics["vllm:spec_decode_num_draft_tokens"]
    stats = graphed["stats"]
    assert stats["capture.draft.BREAKABLE"] > 0 and stats["replay.draft.BREAKABLE"] > 0
    assert "unreplayed.draft.BREAKABLE" not in stats
    assert stats["replay.FULL"] > 0 and stats["update.FULL"] == stats["replay.FULL"]


def test_ngram_default_config_verify_steps_replay_full_graphs(spec_engine):
    graphed = spec_engine("ngram", "default", True)
    assert_same_generation(graphed, spec_engine("ngram", "eager", False))
    assert graphed["metrics"]["vllm:spec_decode_num_draft_tokens"] > 0
    stats = graphed["stats"]
    assert stats["replay.FULL"] > 0 and stats["update.FULL"] == stats["replay.FULL"]
    assert "the drafter's steps run eagerly" not in graphed["log"]  # n-gram has no drafter model


def test_full_graphs_with_devgraphs_single_token_attention_are_refused_with_speculative_decoding():
    # On NPU FULL graphs run devgraph's own decode attention (one query token per request).
    from types import SimpleNamespace

    from vllm.config import CompilationMode, CUDAGraphMode

    from devgraph._errors import DevgraphError
    from devgraph.adapters.vllm._spec_decode import check_speculative_config

    platform = SimpleNamespace(devgraph_device_name="npu")
    spec = SimpleNamespace(
        method="draft_model",
        num_speculative_tokens=3,
        enforce_eager=False,
        use_eagle=lambda: False,
        uses_draft_model=lambda: True,
    )

    def config(mode):
        return SimpleNamespace(
            speculative_config=spec,
            compilation_config=SimpleNamespace(cudagraph_mode=mode, mode=CompilationMode.VLLM_COMPILE),
        )

    with pytest.raises(DevgraphError) as refused:
        check_speculative_config(
            platform, config(CUDAGraphMode.FULL_DECODE_ONLY), devgraph_attention=True, cpu_kernel=False
        )
    message = str(refused.value)
    assert "speculative decoding (draft_model, num_speculative_tokens=3)" in message
    assert "the target's verify step takes 4" in message
    assert "compilation_config={'cudagraph_mode': 'PIECEWISE'}" in message
    # PIECEWISE: the platform's attention, eager between the pieces: passes.
    check_speculative_config(
        platform, config(CUDAGraphMode.PIECEWISE), devgraph_attention=False, cpu_kernel=False
    )
    # The CPU reference's verify attention takes k + 1 tokens: passes.
    check_speculative_config(
        platform, config(CUDAGraphMode.FULL_AND_PIECEWISE), devgraph_attention=True, cpu_kernel=True
    )


def test_drafter_graphs_captured_but_never_replayed_are_counted_and_warned(caplog):
    import logging

    from vllm.config import CUDAGraphMode

    from devgraph.adapters.vllm import _stats
    from devgraph.adapters.vllm._spec_decode import report_unreplayed_drafter_graphs
    from devgraph.adapters.vllm._wrapper import DevgraphGraphWrapper

    def wrapper(role: str, replays: int) -> DevgraphGraphWrapper:
        w = object.__new__(DevgraphGraphWrapper)  # the counters' state only, no platform needed
        w.__dict__.update(
            runnable=None, runtime_mode=CUDAGraphMode.PIECEWISE, breaks=None, role=role, replays=replays
        )
        w.entries = {"size 4": None, "size 8": None}
        DevgraphGraphWrapper._all_instances.add(w)
        return w

    kept = [wrapper("draft.", 0), wrapper("draft.", 3), wrapper("", 0)]  # only the first is reported
    before = _stats.stats().get("unreplayed.draft.PIECEWISE", 0)
    with caplog.at_level(logging.WARNING, logger="devgraph"):
        assert report_unreplayed_drafter_graphs() == ["draft.PIECEWISE (2 graphs)"]
        assert report_unreplayed_drafter_graphs() == []  # once per wrapper
    assert _stats.stats()["unreplayed.draft.PIECEWISE"] == before + 1
    (message,) = [r.getMessage() for r in caplog.records if "never replayed" in r.getMessage()]
    assert "drafter graphs captured but never replayed: draft.PIECEWISE (2 graphs)" in message
    del kept
