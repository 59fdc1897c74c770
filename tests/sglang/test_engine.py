"""Level 3: a real ``sgl.Engine`` on CPU, token-identical with and without devgraph's decode graphs."""

from __future__ import annotations

import json
import os
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


def _run(model_dir: Path, tmp: Path, mode: str) -> tuple[list[list[int]], dict]:
    out, stats = tmp / f"{mode}.json", tmp / f"{mode}-stats.json"
    env = dict(os.environ, SGLANG_PLATFORM="devgraph", DEVGRAPH_SGLANG_STATS=str(stats))
    proc = subprocess.run(
        [sys.executable, str(HERE / "engine_run.py"), str(model_dir), str(out), mode],
        env=env,
        cwd=tmp,
        timeout=TIMEOUT_S,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, f"engine ({mode}) failed:\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text()), (json.loads(stats.read_text()) if stats.exists() else {})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine")
    model_dir = tiny_model.build(tmp / "model")
    return {mode: _run(model_dir, tmp, mode) for mode in ("eager", "graphs")}


def test_greedy_tokens_identical_with_and_without_devgraph(runs):
    (eager, _), (graphed, _) = runs["eager"], runs["graphs"]
    assert len(eager) == len(engine_run.PROMPTS)
    assert all(len(ids) == engine_run.MAX_NEW_TOKENS for ids in eager)
    assert graphed == eager


def test_eager_run_captures_and_replays_nothing(runs):
    _, stats = runs["eager"]
    assert stats == {}  # the backend never wrote its counters: no capture, no replay


def test_engine_captures_every_bucket_largest_first(runs):
    _, stats = runs["graphs"]
    assert stats["captured"] == sorted(engine_run.CAPTURE_SIZES, reverse=True)


def test_decode_steps_replay_padded_to_a_bucket_with_task_updates(runs):
    _, stats = runs["graphs"]
    replays = sum(stats["replays"].values())
    # Three prompts decode together: batch 3 is padded to bucket 4 (one padded row per replay).
    assert stats["replays"].get("4", 0) >= engine_run.MAX_NEW_TOKENS - 2
    assert stats["padded_replays"] >= engine_run.MAX_NEW_TOKENS - 2
    assert stats["padded_rows"] >= stats["padded_replays"]
    # Every replay handed the attention tasks the batch's host lengths.
    assert stats["task_updates"] == replays
