"""Level 3 on the torch_npu simulator: a real ``sgl.Engine`` decoding through SGLang's NPU runner path.

Every process of the engine holds devgraph's torch_npu simulator (tests/sim) (``engine_run.py`` with
``DEVGRAPH_SGLANG_NPU_SIM=1``), so ``devgraph.device()`` is devgraph's NPU backend on CPU tensors.
SGLang runs on device ``cpu``; the devgraph platform gives it ``DevgraphNPUGraphRunner`` (SGLang's
``NPUGraphRunner``, whose replay is ``backend.replay_with_input_update(...)``), the graphs are
``NpuGraph`` captures on the simulator, decode attention runs devgraph's NPU kernel
(``npu_fused_infer_attention_score`` with ``actual_seq_lengths_kv`` from the host lengths, through
the simulator's ``CPU -> PrivateUse1`` routing), and every replay re-issues the attention tasks with
the batch's lengths on the update stream (``graph_task_update_begin/end``), replay first, each task
waiting on its event. The same engine with graphs off runs the same NPU kernels eagerly; greedy
tokens must be identical. Mutants checked by hand: skipping the task update in ``NpuGraph.replay``,
or recording a task's event before its rewrite, changed the tokens of all 6 requests.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

# "sglang.srt", not "sglang": this directory is itself importable as a namespace package "sglang".
pytest.importorskip("sglang.srt")

import engine_run
import tiny_model

HERE = Path(__file__).parent
TIMEOUT_S = int(os.environ.get("DEVGRAPH_SGLANG_ENGINE_TIMEOUT", "900"))
# Every decode batch (1 to 4 requests) has a graph of its size: nothing is padded or run eagerly.
REQUESTS, MAX_RUNNING, MAX_NEW_TOKENS, CAPTURE = 6, 4, 24, "1,2,3,4"
#: Ascend's paged attention takes blocks of a multiple of 16 tokens.
PAGE_SIZE = 16


def _run(model_dir: Path, tmp: Path, mode: str, *options: str) -> tuple[dict, dict, str]:
    """Output JSON ({} if the engine failed), the scheduler's devgraph counters and the engine's log."""
    out, stats, log = tmp / f"{mode}.json", tmp / f"{mode}-stats.json", tmp / f"{mode}.log"
    env = dict(
        os.environ,
        SGLANG_PLATFORM="devgraph",
        DEVGRAPH_SGLANG_STATS=str(stats),
        **{engine_run.NPU_SIM_ENV: "1"},
    )
    env.pop("DEVGRAPH_BACKEND", None)  # the simulator's npu is the one accelerator devgraph sees
    cmd = [sys.executable, str(HERE / "engine_run.py"), str(model_dir), str(out), mode, *options]
    with open(log, "w") as f:  # a file, not a pipe that could fill up
        proc = subprocess.Popen(
            cmd, env=env, cwd=tmp, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the engine and the scheduler processes it started
        proc.wait()
    text = log.read_text()
    if proc.returncode != 0:
        return {}, {}, text
    counters = json.loads(stats.read_text()) if stats.exists() else {}
    return json.loads(out.read_text()), counters, text


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model.build(tmp_path_factory.mktemp("qwen3") / "model", "qwen3")


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("npu-sim")
    options = ["--requests", str(REQUESTS), "--max-running", str(MAX_RUNNING)]
    options += ["--max-new-tokens", str(MAX_NEW_TOKENS), "--capture", CAPTURE, "--page-size", str(PAGE_SIZE)]
    results = {}
    for mode in ("eager", "graphs"):  # one engine at a time: CI machines have few cores
        out, counters, log = _run(model_dir, tmp, mode, *options)
        assert out, f"engine ({mode}) on the NPU simulator failed:\n{log[-6000:]}"
        results[mode] = out, counters
    return results


def test_npu_runner_tokens_identical_to_the_engine_without_graphs(runs):
    (eager, _), (graphed, _) = runs["eager"], runs["graphs"]
    lengths = engine_run.max_new_tokens(REQUESTS, MAX_NEW_TOKENS)
    assert [len(ids) for ids in eager["output_ids"]] == lengths
    mismatched = [i for i, (a, b) in enumerate(zip(eager["output_ids"], graphed["output_ids"])) if a != b]
    assert not mismatched, f"requests {mismatched} differ"


def test_decode_graphs_are_npu_graphs_of_sglangs_npu_runner_updated_at_every_replay(runs):
    _, stats = runs["graphs"]
    assert stats["runner"] == "DevgraphNPUGraphRunner"
    assert stats["captured"] == [4, 3, 2, 1]  # largest first
    layers = 2  # tiny_model
    for size, graph in stats["graphs"].items():
        assert graph == {"graph": "NpuGraph", "tasks": ["devgraph::paged_decode_attention"] * layers}, size
    replays = {int(k): n for k, n in stats["replays"].items()}
    assert set(replays) == {1, 2, 3, 4}, replays  # batches shrink as requests finish: every graph ran
    assert stats["padded_replays"] == 0 and stats["eager_decode"] == {}
    # Every replay went through replay_with_input_update and re-issued the attention tasks.
    assert stats["task_updates"] == sum(replays.values())


def test_eager_engine_on_the_simulator_captures_nothing(runs):
    _, stats = runs["eager"]
    assert stats == {}


def test_attention_runs_the_npu_kernel_which_refuses_single_token_pages(model_dir, tmp_path):
    # The CPU reference kernel takes any block size; Ascend's paged attention (and devgraph's NPU
    # kernel on the simulator) needs a multiple of 16: the capture's warm-up decode refuses it.
    options = ["--requests", "1", "--max-new-tokens", "2", "--capture", "1", "--page-size", "1"]
    out, _, log = _run(model_dir, tmp_path, "graphs", *options)
    assert not out and engine_run.STARTED not in log
    assert "devgraph.paged_decode_attention on npu: block_size 1" in log
