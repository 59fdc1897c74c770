"""Tensor-parallel capture: ``devgraph.wrap`` on every rank of a gloo group on the CPU reference.

The model is the reference paged decoder sharded over the ranks (``devgraph.testing.models``:
vocab-parallel embedding and logits, column/row-parallel layers), so every forward issues
collectives: one all-reduce after the embedding, two per layer, one all-gather of the logits.
Each spawned test runs a sequence of decode steps with new tokens, batch sizes inside and between
the buckets (padded), through the graphed shard, an eager twin of the shard and the single-process
model on every rank, and compares them in this process.

Tolerances: graphed vs the eager shard run on the same padded batch, and rank vs rank, are exact
(bitwise: the replayed ops and collectives do the same arithmetic on the same shapes; an unpadded
eager batch can differ in the last bit, since a matmul over 3 rows may round unlike one over 4).
Against the single-process model they are ``atol = rtol = 1e-5`` in float32: the row-parallel
layers add the ranks' partial sums, which rounds differently from one matmul over the whole inner
dimension (about 1e-6 on logits of order one); with one rank the shard is bitwise the
single-process model (``test_one_rank_shard_is_bitwise_the_single_process_model``).

Every spawned run is bounded: the process group times out after 30 s (a collective a peer never
joins raises), and the run is killed after ``RUN_TIMEOUT`` seconds (``RanksTimedOut``).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import devgraph
from devgraph.testing.distributed import run_ranks
from devgraph.testing.models import (
    DecoderConfig,
    KVBlockManager,
    PagedDecoder,
    TensorParallel,
    make_decoder,
    pad_batch,
    shard_decoder,
)

#: Heads, key/value heads, intermediate and vocabulary sizes divisible by 1, 2 and 4 ranks.
CONFIG = DecoderConfig(num_heads=8, num_kv_heads=4)
SEED = 5
RUN_TIMEOUT = 150.0
SINGLE_ATOL = SINGLE_RTOL = 1e-5
#: Batch sizes (full) and token counts (piecewise) captured.
BUCKETS = [1, 2, 4]

#: (sequence ids, new tokens) per decode step: batches 3 (padded to 4), 1, 4, 2, 3; sequence 0
#: takes part in every step, so later steps read keys and values cached by earlier ones.
STEPS = [
    ([0, 1, 2], [17, 250, 3]),
    ([0], [99]),
    ([0, 1, 2, 3], [5, 128, 64, 200]),
    ([0, 3], [31, 7]),
    ([0, 1, 2], [255, 0, 42]),
]


def _serve(rank: int, world_size: int, collectives: str, options: dict, steps: list) -> dict:
    """On one rank: run ``steps`` through the graphed shard, its eager twin (on the batch padded as
    the graph pads it) and the whole single-process model."""
    parallel = TensorParallel.of(collectives=collectives)
    # frontend='raw': the decoder's host lengths (host_args) are served without Dynamo only
    graphed = devgraph.wrap(
        make_decoder(CONFIG, SEED, parallel=parallel), device="cpu", frontend="raw", **options
    )
    models = {
        "graphed": graphed,
        "eager": make_decoder(CONFIG, SEED, parallel=parallel),
        "single": make_decoder(CONFIG, SEED),
    }
    managers = {name: KVBlockManager(CONFIG) for name in models}
    logits: dict[str, list[torch.Tensor]] = {name: [] for name in models}
    for ids, tokens in steps:
        for name, model in models.items():
            batch = managers[name].decode_batch(ids, tokens)
            if name == "eager":  # the rows the graph computes: padded up to the bucket
                batch = pad_batch(batch, min(b for b in BUCKETS if b >= len(ids)), CONFIG)
            with torch.no_grad():
                logits[name].append(model(**batch)[: len(ids)].clone())
    stats = graphed.stats
    pieces = _collectives_per_piece(graphed) if options.get("mode") == "piecewise" else None
    return {
        **logits,
        "replays": stats.replays,
        "eager_calls": stats.eager_calls,
        "rank": rank,
        "pieces": pieces,
    }


def _collectives_per_piece(graphed) -> list[list[str]]:
    """The collectives (their op names, ``wait_tensor`` left out) in each captured piece."""
    return [
        [
            str(node.target)
            for node in piece.graph_module.graph.nodes
            if "c10d" in str(node.target) and "wait_tensor" not in str(node.target)
        ]
        for piece in graphed.runner.pieces.traced.compiled.split.captured
    ]


def _check(results: list[dict], world_size: int) -> None:
    assert [r["rank"] for r in results] == list(range(world_size))
    for r in results:
        assert r["replays"] == len(STEPS) and r["eager_calls"] == 0, "every step must replay graphs"
        for step, (got, eager, single) in enumerate(zip(r["graphed"], r["eager"], r["single"])):
            assert got.shape == (len(STEPS[step][0]), CONFIG.vocab_size)
            assert torch.equal(got, eager), f"rank {r['rank']} step {step}: graphed != eager shard"
            torch.testing.assert_close(got, single, atol=SINGLE_ATOL, rtol=SINGLE_RTOL)
    for r in results[1:]:
        for step, (a, b) in enumerate(zip(results[0]["graphed"], r["graphed"])):
            assert torch.equal(a, b), f"step {step}: rank {r['rank']}'s logits differ from rank 0's"


@pytest.mark.parametrize(("world_size", "collectives"), [(2, "inplace"), (2, "functional"), (4, "inplace")])
def test_full_graphs_on_every_rank_equal_eager_and_the_single_process_model(world_size, collectives):
    options = {"batch_sizes": BUCKETS}
    results = run_ranks(
        _serve, world_size, args=(collectives, options, STEPS), timeout=RUN_TIMEOUT, pg_timeout=30
    )
    _check(results, world_size)


@pytest.mark.parametrize(("world_size", "collectives"), [(2, "inplace"), (4, "functional")])
def test_piecewise_pieces_holding_collectives_equal_eager_and_the_single_process_model(
    world_size, collectives
):
    """Attention is the splitting op; every collective sits inside a captured piece."""
    options = {"mode": "piecewise", "capture_sizes": BUCKETS}
    results = run_ranks(
        _serve, world_size, args=(collectives, options, STEPS), timeout=RUN_TIMEOUT, pg_timeout=30
    )
    _check(results, world_size)
    # Embedding all-reduce + layer 0 up to attention | o_proj and down all-reduces of layer 0 + layer
    # 1 up to attention | layer 1's two all-reduces + the logits' all-gather.
    pieces = [[op.split(".")[1] for op in piece] for piece in results[0]["pieces"]]
    assert pieces == [
        ["all_reduce"],
        ["all_reduce", "all_reduce"],
        ["all_reduce", "all_reduce", "all_gather_into_tensor"],
    ]


def _capture_with(rank: int, world_size: int, options_by_rank: list[dict]) -> tuple[str, str]:
    model = make_decoder(CONFIG, SEED, parallel=TensorParallel.of())
    graphed = devgraph.wrap(model, device="cpu", frontend="raw", **options_by_rank[rank])  # host_args: raw
    try:
        graphed(**KVBlockManager(CONFIG).decode_batch([0, 1, 2], [1, 2, 3]))
    except devgraph.RankMismatchError as exc:
        return "RankMismatchError", str(exc)
    return "captured", ""


@pytest.mark.parametrize(
    ("options_by_rank", "expected"),
    [
        (
            [{"batch_sizes": [1, 2, 4]}, {"batch_sizes": [1, 2, 8]}],
            "rank 1 of 2 captures batch sizes [1, 2, 8] but rank 0 captures [1, 2, 4]: size 4 differs",
        ),
        (
            [
                {"mode": "piecewise", "capture_sizes": [1, 2, 4]},
                {"mode": "piecewise", "capture_sizes": [1, 4]},
            ],
            "rank 1 of 2 captures capture sizes (tokens) [1, 4] but rank 0 captures [1, 2, 4]: size 2 differs",
        ),
    ],
    ids=["full", "piecewise"],
)
def test_ranks_capturing_different_sizes_fail_with_rank_mismatch_on_every_rank(options_by_rank, expected):
    results = run_ranks(_capture_with, 2, args=(options_by_rank,), timeout=RUN_TIMEOUT, pg_timeout=30)
    for rank, (outcome, message) in enumerate(results):
        assert outcome == "RankMismatchError", f"rank {rank} {outcome}"
        assert expected in message, message


# -- in one process --------------------------------------------------------------------------


@pytest.mark.parametrize("collectives", ["inplace", "functional"])
def test_one_rank_shard_is_bitwise_the_single_process_model(collectives):
    single = make_decoder(CONFIG, SEED)
    shard = make_decoder(CONFIG, SEED, parallel=TensorParallel(0, 1, collectives=collectives))
    assert isinstance(shard.embed_tokens, torch.nn.Module) and shard.parallel is not None
    managers = [KVBlockManager(CONFIG), KVBlockManager(CONFIG)]
    for ids, tokens in STEPS:
        with torch.no_grad():
            want = single(**managers[0].decode_batch(ids, tokens))
            got = shard(**managers[1].decode_batch(ids, tokens))
        assert torch.equal(got, want)


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_shards_of_all_ranks_hold_every_weight_once(world_size):
    """Concatenating the ranks' shards along the split dims rebuilds each whole weight."""
    single = make_decoder(CONFIG, SEED)
    shards = [shard_decoder(single, TensorParallel(r, world_size)) for r in range(world_size)]
    c, n = CONFIG, world_size
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    for name, whole in single.state_dict().items():
        parts = [s.state_dict()[name] for s in shards]
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            rebuilt = torch.cat(parts, dim=1)
        elif name.endswith("qkv_proj.weight"):  # each rank: its q heads, then its k, then its v heads
            blocks = [p.split([q // n, kv // n, kv // n]) for p in parts]
            rebuilt = torch.cat([torch.cat([b[i] for b in blocks]) for i in range(3)])
        elif name.endswith("gate_up_proj.weight"):
            halves = [p.chunk(2) for p in parts]
            rebuilt = torch.cat([torch.cat([h[i] for h in halves]) for i in range(2)])
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            rebuilt = torch.cat(parts)
        else:  # norms: whole on every rank
            assert all(torch.equal(p, whole) for p in parts), name
            continue
        assert torch.equal(rebuilt, whole), name
    assert shards[0].layers[0].k_cache.shape[2] == c.num_kv_heads // n


@pytest.mark.parametrize(
    ("field", "value"), [("num_kv_heads", 2), ("intermediate_size", 130), ("vocab_size", 254)]
)
def test_a_size_the_ranks_cannot_share_is_refused_naming_it(field, value):
    import attrs

    config = attrs.evolve(CONFIG, **{field: value})
    with pytest.raises(ValueError, match=rf"DecoderConfig\.{field} \({value}\).*world size \(4\)"):
        PagedDecoder(config, TensorParallel(0, 4))


def test_tensor_parallel_of_needs_an_initialised_group():
    with pytest.raises(ValueError, match="init_process_group"):
        TensorParallel.of()


# -- the example -----------------------------------------------------------------------------


def test_the_two_rank_demo_agrees_on_every_rank():
    env = {**os.environ, "DEVGRAPH_TEST_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "devgraph", "demo", "--tp", "2", "--steps", "3"],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT + 30,
        env=env,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    for rank in range(2):
        assert any(
            line.split()[:1] == [str(rank)] and line.endswith("ok") for line in run.stdout.splitlines()
        )
    assert "graphed logits match eager on every rank" in run.stdout


# -- full_and_piecewise: decode from full graphs, prefill and mixed batches from pieces ------------

#: Token counts the pieces capture in ``full_and_piecewise`` mode (the full graphs take ``BUCKETS``).
PIECE_SIZES = [4, 8]

#: (sequence id, tokens) per row of each call: a prefill of two prompts (5 rows, pieces, padded to
#: 8), decode steps (full graphs, 2 and 3 padded to 4), a mixed batch (one decode row and a 2-token
#: prompt: pieces, padded to 4), and a last decode over every sequence.
MIXED_STEPS = [
    [(0, 17), (0, 250), (0, 3), (1, 99), (1, 5)],
    [(0, 128), (1, 64)],
    [(0, 200), (1, 31), (2, 7)],
    [(0, 255), (3, 0), (3, 42)],
    [(0, 11), (1, 12), (2, 13), (3, 14)],
]
#: Which runner serves each of ``MIXED_STEPS``: True for the full graphs.
MIXED_DECODE = [False, True, True, False, True]


def _is_decode(block_table, **_):
    """A uniform decode batch: one row per sequence (a prompt's rows share their first block)."""
    return block_table.shape[0] == block_table[:, 0].unique().numel()


def _rows_batch(manager: KVBlockManager, rows: list[tuple[int, int]]) -> dict:
    """One call holding ``rows`` (a prompt's tokens are consecutive rows of one sequence)."""
    parts = [manager.decode_batch([sid], [tok]) for sid, tok in rows]
    batch = {k: torch.cat([p[k] for p in parts]) for k in parts[0] if k != "seq_lens_host"}
    batch["seq_lens_host"] = [n for p in parts for n in p["seq_lens_host"]]
    return batch


def _serve_both(rank: int, world_size: int, collectives: str) -> dict:
    """On one rank: ``MIXED_STEPS`` through a ``full_and_piecewise`` shard, its eager twin (on the
    batch padded as the serving runner pads it) and the single-process model."""
    parallel = TensorParallel.of(collectives=collectives)
    graphed = devgraph.wrap(
        make_decoder(CONFIG, SEED, parallel=parallel),
        device="cpu",
        mode="full_and_piecewise",
        batch_sizes=BUCKETS,
        capture_sizes=PIECE_SIZES,
        is_decode=_is_decode,
    )
    models = {
        "graphed": graphed,
        "eager": make_decoder(CONFIG, SEED, parallel=parallel),
        "single": make_decoder(CONFIG, SEED),
    }
    managers = {name: KVBlockManager(CONFIG) for name in models}
    logits: dict[str, list[torch.Tensor]] = {name: [] for name in models}
    for rows, decode in zip(MIXED_STEPS, MIXED_DECODE):
        for name, model in models.items():
            batch = _rows_batch(managers[name], rows)
            if name == "eager":
                sizes = BUCKETS if decode else PIECE_SIZES
                batch = pad_batch(batch, min(s for s in sizes if s >= len(rows)), CONFIG)
            with torch.no_grad():
                logits[name].append(model(**batch)[: len(rows)].clone())
    stats = graphed.stats
    return {
        **logits,
        "rank": rank,
        "piece_replays": stats.replays,
        "full_replays": stats.full.replays,
        "eager_calls": stats.eager_calls + stats.full.eager_calls,
        "pieces": _collectives_per_piece(graphed),
    }


@pytest.mark.parametrize("collectives", ["inplace", "functional"])
def test_full_and_piecewise_decodes_from_full_graphs_and_prefills_from_pieces_on_every_rank(collectives):
    results = run_ranks(_serve_both, 2, args=(collectives,), timeout=RUN_TIMEOUT, pg_timeout=30)
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["full_replays"] == sum(MIXED_DECODE) and r["eager_calls"] == 0
        assert r["piece_replays"] == len(MIXED_STEPS) - sum(MIXED_DECODE)
        assert all(piece for piece in r["pieces"]), "every captured piece holds a collective"
        for step, (got, eager, single) in enumerate(zip(r["graphed"], r["eager"], r["single"])):
            assert got.shape == (len(MIXED_STEPS[step]), CONFIG.vocab_size)
            assert torch.equal(got, eager), f"rank {r['rank']} step {step}: graphed != eager shard"
            torch.testing.assert_close(got, single, atol=SINGLE_ATOL, rtol=SINGLE_RTOL)
    for step, (a, b) in enumerate(zip(results[0]["graphed"], results[1]["graphed"])):
        assert torch.equal(a, b), f"step {step}: rank 1's logits differ from rank 0's"
