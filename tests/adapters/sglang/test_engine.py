"""Level 3: a real ``sgl.Engine`` on CPU, token-identical with and without devgraph's graphs.

Per architecture (dense with QK-norm, Phi3's fused projections; bf16 random weights): 32 greedy
requests, up to 16 running, outputs of 75 to 150 tokens, so decode batches take many sizes from 16
down to 1 as requests finish and new ones join, and new requests are prefilled in batches of one to
16 prompts (padded to SGLang's prefill token buckets when prefill graphs are on). Near-tied tokens flip on such runs when a graph step
is not the eager step bit for bit (a compiled forward, a batch padded to a larger graph); a
12-token run of three requests did not show it. A mixture of experts cannot be captured on CPU at
SGLang 0.5.23 (its native MoE reads expert counts on the host): the engine refuses at start.
"""

from __future__ import annotations

import json
import os
import re
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
REQUESTS, MAX_RUNNING, MAX_NEW_TOKENS = 32, 16, 150
ARCHS = ("qwen3", "phi3")


def _start(
    model_dir: Path, tmp: Path, mode: str, *options: str, name: str | None = None
) -> tuple[subprocess.Popen, Path]:
    """The engine process, writing ``<name>.json``, ``<name>-stats.json`` and ``<name>.log`` in ``tmp``
    (``name``: the mode unless given)."""
    name = name or mode
    stats = tmp / f"{name}-stats.json"
    env = dict(os.environ, SGLANG_PLATFORM="devgraph", DEVGRAPH_SGLANG_STATS=str(stats))
    cmd = [sys.executable, str(HERE / "engine_run.py"), str(model_dir), str(tmp / f"{name}.json"), mode]
    with open(tmp / f"{name}.log", "w") as log:  # a file, not a pipe that could fill up
        proc = subprocess.Popen(
            [*cmd, *options], env=env, cwd=tmp, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    return proc, tmp / name


def _finish(started: tuple[subprocess.Popen, Path]) -> tuple[dict, dict, str]:
    """Output JSON ({} if the engine failed), the scheduler's devgraph counters ({} if it never
    wrote them) and the engine's log."""
    proc, base = started
    out, stats = base.with_suffix(".json"), base.parent / f"{base.name}-stats.json"
    try:
        proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the engine and the scheduler processes it started
        proc.wait()
    stderr = base.with_suffix(".log").read_text()
    if proc.returncode != 0:
        return {}, {}, stderr
    counters = json.loads(stats.read_text()) if stats.exists() else {}
    return json.loads(out.read_text()), counters, stderr


def _run(
    model_dir: Path, tmp: Path, mode: str, *options: str, name: str | None = None
) -> tuple[dict, dict, str]:
    return _finish(_start(model_dir, tmp, mode, *options, name=name))


#: Prefill graphs up to this many tokens (SGLang's buckets 4..256): the first prefill batch, 16
#: prompts of at most 13 tokens, fits.
PREFILL_MAX_TOKENS = 256

#: The engine runs the tests compare, by name: (engine_run mode, its extra options).
RUNS = {
    "eager": ("eager", ()),
    "graphs": ("graphs", ()),  # decode graphs
    # decode and prefill graphs
    "prefill": ("graphs", ("--prefill", "--prefill-max-tokens", str(PREFILL_MAX_TOKENS))),
}


class EngineRuns:
    """One architecture's engine runs, each started the first time a test asks for it (one at a time:
    CI machines have few cores), so a test selection runs only the engines it reads."""

    def __init__(self, arch: str, tmp: Path) -> None:
        self.arch, self.tmp = arch, tmp
        self.model_dir = tiny_model.build(tmp / "model", arch)
        self._done: dict[str, tuple[dict, dict]] = {}

    def __getitem__(self, name: str) -> tuple[dict, dict]:
        if name not in self._done:
            mode, extra = RUNS[name]
            options = ["--requests", str(REQUESTS), "--max-running", str(MAX_RUNNING)]
            options += ["--max-new-tokens", str(MAX_NEW_TOKENS), *extra]
            out, counters, stderr = _run(self.model_dir, self.tmp, mode, *options, name=name)
            assert out, f"engine ({self.arch}, {name}) failed:\n{stderr[-6000:]}"
            self._done[name] = out, counters
        return self._done[name]


@pytest.fixture(scope="module", params=ARCHS)
def runs(request, tmp_path_factory):
    return EngineRuns(request.param, tmp_path_factory.mktemp(request.param))


def test_greedy_tokens_identical_with_and_without_devgraph(runs):
    (eager, _), (graphed, _) = runs["eager"], runs["graphs"]
    lengths = engine_run.max_new_tokens(REQUESTS, MAX_NEW_TOKENS)
    assert [len(ids) for ids in eager["output_ids"]] == lengths
    mismatched = [i for i, (a, b) in enumerate(zip(eager["output_ids"], graphed["output_ids"])) if a != b]
    assert not mismatched, f"requests {mismatched} differ"


def test_eager_run_captures_and_replays_nothing(runs):
    _, stats = runs["eager"]
    assert stats == {}  # the backend never wrote its counters: no capture, no replay


def test_greedy_tokens_identical_with_prefill_and_decode_graphs_and_without(runs):
    (eager, _), (graphed, _) = runs["eager"], runs["prefill"]
    mismatched = [i for i, (a, b) in enumerate(zip(eager["output_ids"], graphed["output_ids"])) if a != b]
    assert not mismatched, f"requests {mismatched} differ"
    assert len(graphed["output_ids"]) == REQUESTS


def test_prefill_batches_replay_breakable_graphs_cut_at_every_attention_layer(runs):
    _, stats = runs["prefill"]
    buckets = [n for n in [*range(4, 33, 4), *range(48, 257, 16)] if n <= PREFILL_MAX_TOKENS]
    assert stats["prefill_captured"] == sorted(buckets, reverse=True)  # SGLang's buckets, largest first
    layers = 2  # the tiny models' layers: one break each, one more segment than breaks
    assert {tuple(g.values()) for g in stats["prefill_graphs"].values()} == {(layers + 1, layers)}
    replays = sum(stats["prefill_replays"].values())
    assert replays >= 2, stats["prefill_replays"]  # the first batch and the refills as requests finish
    assert stats["prefill_padded_tokens"] > 0  # batches padded to a bucket, and still token-identical
    assert stats["captured"] == list(range(MAX_RUNNING, 0, -1))  # the decode graphs beside them


def test_every_decode_size_is_captured_largest_first_and_replayed_unpadded(runs):
    _, stats = runs["graphs"]
    # SGLang's default decode sizes on cpu cover every batch up to 16.
    assert stats["captured"] == list(range(MAX_RUNNING, 0, -1))
    replayed = {int(k) for k in stats["replays"]}
    assert len(replayed) >= 8, stats["replays"]  # batches shrink and refill: many sizes ran as graphs
    assert stats["padded_replays"] == stats["padded_rows"] == 0
    assert stats["eager_decode"] == {}
    # Every replay handed the attention tasks the batch's host lengths.
    assert stats["task_updates"] == sum(stats["replays"].values())


def test_decode_batches_without_a_graph_of_their_size_run_eagerly_counted_and_warned(tmp_path):
    """Batches above the largest captured size, or between captured sizes, are not padded."""
    model_dir = tiny_model.build(tmp_path / "model", "llama")
    # Outputs of 6 to 12 tokens: decode batches of 8 shrink one by one to 2 (the two 12-token requests).
    options = ["--requests", "8", "--max-running", "8", "--max-new-tokens", "12", "--capture", "1,2,4"]
    out, stats, stderr = _run(model_dir, tmp_path, "graphs", *options)
    assert out, f"engine failed:\n{stderr[-6000:]}"
    assert stats["captured"] == [4, 2, 1]
    eager = {int(k): n for k, n in stats["eager_decode"].items()}
    assert eager.get(8, 0) > 0  # above the largest graph
    assert eager.get(3, 0) > 0  # between graphs: SGLang would have padded it to 4
    assert set(eager) <= {3, 5, 6, 7, 8}
    assert {int(k) for k in stats["replays"]} <= {1, 2, 4} and stats["padded_replays"] == 0
    # One warning for the engine, with the numbers and the sizes to capture.
    assert stderr.count("decode steps ran eagerly") == 1, stderr[-3000:]
    assert re.search(r"devgraph: [1-8] of 8 decode steps ran eagerly: no graph of their batch size", stderr)
    assert "--cuda-graph-bs-decode 1 2 3 4 5 6 7 8, or lower --max-running-requests to 4" in stderr


def test_sliding_window_model_is_refused_at_engine_start(tmp_path):
    model_dir = tiny_model.build(tmp_path / "model", "gemma2")
    out, _, stderr = _run(model_dir, tmp_path, "eager", "--requests", "1", "--max-new-tokens", "2")
    assert not out and engine_run.STARTED not in stderr  # refused at start, not at the first decode
    assert "DevgraphError" in stderr and "(layer 0) uses a sliding window of 31" in stderr


def test_moe_decode_graphs_are_refused_at_engine_start_naming_the_host_sync(tmp_path):
    # SGLang's CPU MoE without sgl_kernel (moe_forward_native) copies the tokens per expert to the
    # host: a graph would freeze that routing, so devgraph's capture refuses it and the engine
    # stops at start (the eager engine serves the same model; the identity test runs it dense).
    model_dir = tiny_model.build(tmp_path / "model", "qwen3_moe")
    out, _, log = _run(model_dir, tmp_path, "graphs", "--requests", "1", "--max-new-tokens", "2")
    assert not out and engine_run.STARTED not in log
    assert "host synchronisation inside graph capture" in log
    assert "fused_moe_native.py" in log and "Tensor.cpu" in log


def test_moe_prefill_graphs_are_refused_at_engine_start_naming_the_host_sync(tmp_path):
    # Prefill graphs are captured before decode graphs: SGLang's CPU MoE copies the tokens per expert
    # to the host inside the first segment, so devgraph's breakable capture refuses it by op and line
    # (a graph would freeze the routing) and the engine stops at start.
    model_dir = tiny_model.build(tmp_path / "model", "qwen3_moe")
    options = ["--requests", "1", "--max-new-tokens", "2", "--prefill", "--prefill-max-tokens", "8"]
    out, _, log = _run(model_dir, tmp_path, "graphs", *options)
    assert not out and engine_run.STARTED not in log
    assert "host synchronisation inside graph capture" in log
    assert "fused_moe_native.py" in log and "Tensor.cpu" in log
    assert "prefill_cuda_graph_runner.py" in log and "decode_cuda_graph_runner.py" not in log


def test_platform_without_the_graph_switch_warns_at_start_and_captures_nothing(tmp_path):
    # SGLANG_PLATFORM=devgraph alone: SGLang on cpu captures no decode graph (it needs
    # enable_torch_compile); devgraph says so at start, naming the option, instead of running silently.
    model_dir = tiny_model.build(tmp_path / "model", "llama")
    out, stats, log = _run(model_dir, tmp_path, "unset", "--requests", "2", "--max-new-tokens", "4")
    assert out, f"engine failed:\n{log[-6000:]}"
    assert stats == {}  # nothing captured, nothing replayed
    assert log.count("no decode graph will be captured") == 1
    assert "enable_torch_compile=True" in log
    assert log.find("no decode graph will be captured") < log.find(engine_run.STARTED)


def test_cuda_graph_max_bs_decode_sizes_the_decode_graphs(tmp_path):
    model_dir = tiny_model.build(tmp_path / "model", "llama")
    options = ["--requests", "4", "--max-new-tokens", "4", "--max-running", "8", "--max-bs", "4"]
    out, stats, log = _run(model_dir, tmp_path, "graphs", *options)
    assert out, f"engine failed:\n{log[-6000:]}"
    assert stats["captured"] == [4, 3, 2, 1]  # every size up to it, largest first (not 1..8)
