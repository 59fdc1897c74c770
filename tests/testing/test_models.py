"""The reference paged decoder (devgraph.testing.models): paged decode equals dense attention."""

from __future__ import annotations

import random

import attrs
import pytest
import torch

from devgraph.testing.models import (
    SCRATCH_BLOCK,
    DecoderConfig,
    KVBlockManager,
    OutOfBlocksError,
    PagedDecoder,
    dense_reference_logits,
    greedy_decode,
    make_decoder,
    pad_batch,
)

ATOL = RTOL = 1e-4


def _tokens(n: int, seed: int, vocab: int = 256) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def _run(model, manager, histories, lengths, pad_to=None):
    """Feed `histories[i][:lengths[i]]` one token per step; return per-step (batch, logits, ids)."""
    steps = []
    for t in range(max(lengths)):
        ids = [i for i, n in enumerate(lengths) if t < n]
        batch = manager.decode_batch(ids, [histories[i][t] for i in ids])
        kwargs = pad_batch(batch, pad_to, model.config) if pad_to else batch
        with torch.no_grad():
            logits = model(**kwargs)
        steps.append((batch, logits[: len(ids)], ids, t))
    return steps


def _real_blocks(model: PagedDecoder) -> list[torch.Tensor]:
    return [c[SCRATCH_BLOCK + 1 :].clone() for layer in model.layers for c in (layer.k_cache, layer.v_cache)]


# -- paged decode vs dense reference -------------------------------------------------------------


def test_decode_logits_match_dense_reference_across_block_boundaries():
    model = make_decoder(seed=1)
    manager = KVBlockManager(model.config)
    lengths = [3, 17, 34]  # inside one block, just past one boundary, past two
    histories = [_tokens(n, seed=i) for i, n in enumerate(lengths)]
    for _batch, logits, ids, t in _run(model, manager, histories, lengths):
        expected = dense_reference_logits(model, [histories[i][: t + 1] for i in ids])
        torch.testing.assert_close(logits.double(), expected, atol=ATOL, rtol=RTOL)
    assert [manager.seq_len(i) for i in range(3)] == lengths
    assert [len(manager.blocks(i)) for i in range(3)] == [1, 2, 3]


def test_decode_with_int32_slot_mapping_matches_int64():
    lengths = [5, 20]
    histories = [_tokens(n, seed=10 + i) for i, n in enumerate(lengths)]
    results = []
    for slot_dtype in (torch.int64, torch.int32):
        model = make_decoder(seed=2)
        steps = _run(model, KVBlockManager(model.config, slot_dtype=slot_dtype), histories, lengths)
        assert steps[0][0]["slot_mapping"].dtype == slot_dtype
        results.append([logits for _, logits, _, _ in steps])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_greedy_decode_matches_dense_greedy():
    model = make_decoder(seed=3)
    prompts = [_tokens(2, seed=20), _tokens(15, seed=21), _tokens(9, seed=22)]
    got = greedy_decode(model, prompts, steps=6)
    for prompt, tokens in zip(prompts, got):
        history = list(prompt)
        expected = []
        for _ in range(6):
            expected.append(int(dense_reference_logits(model, [history]).argmax(-1)))
            history.append(expected[-1])
        assert tokens == expected


def test_greedy_decode_frees_its_blocks_and_uses_the_given_forward():
    model = make_decoder(seed=4)
    manager = KVBlockManager(model.config)
    calls = []

    def forward(**kwargs):
        calls.append(len(kwargs["seq_lens_host"]))
        return model(**kwargs)

    free_before = manager.num_free_blocks
    out = greedy_decode(model, [[1, 2, 3], [4]], steps=2, forward=forward, manager=manager)
    assert [len(t) for t in out] == [2, 2]
    assert calls == [2, 2, 1, 1]  # the short prompt finishes first: the batch shrinks
    assert manager.num_free_blocks == free_before


# -- padding ---------------------------------------------------------------------------------------


def test_padded_rows_do_not_change_real_rows_logits_or_cache():
    lengths = [4, 18, 33]
    histories = [_tokens(n, seed=30 + i) for i, n in enumerate(lengths)]
    plain, padded = make_decoder(seed=5), make_decoder(seed=5)
    steps_plain = _run(plain, KVBlockManager(plain.config), histories, lengths)
    steps_padded = _run(padded, KVBlockManager(padded.config), histories, lengths, pad_to=8)
    # Not bit-equal: a bigger batch may round matmuls differently; corruption would be far larger.
    for (_, a, _, _), (_, b, _, _) in zip(steps_plain, steps_padded):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for a, b in zip(_real_blocks(plain), _real_blocks(padded)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_pad_only_batch_writes_only_the_scratch_block():
    model = make_decoder(seed=6)
    _run(model, KVBlockManager(model.config), [_tokens(20, seed=40)], [20])
    before = _real_blocks(model)
    with torch.no_grad():
        logits = model(**model.dummy_inputs(5))
    assert logits.shape == (5, model.config.vocab_size)
    assert torch.isfinite(logits).all()
    for a, b in zip(before, _real_blocks(model)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert model.layers[0].k_cache[SCRATCH_BLOCK].abs().sum() > 0


def test_pad_values_and_devgraph_options():
    pad = PagedDecoder.pad_values()
    assert pad == {
        "input_ids": 0,
        "positions": 0,
        "block_table": 0,
        "seq_lens": 1,
        "slot_mapping": 0,
        "seq_lens_host": 1,
    }
    assert PagedDecoder.devgraph_options() == {
        "pad_values": pad,
        "host_args": ("seq_lens_host",),
        "frontend": "raw",
    }
    assert make_decoder().devgraph_options() == PagedDecoder.devgraph_options()


def test_pad_batch_pads_every_argument_to_the_bucket():
    config = DecoderConfig()
    batch = KVBlockManager(config).decode_batch([0, 1], [5, 6])
    out = pad_batch(batch, 4, config)
    assert out["seq_lens_host"] == [1, 1, 1, 1]
    assert out["input_ids"].tolist() == [5, 6, 0, 0]
    assert out["slot_mapping"].tolist() == [16, 32, 0, 0]
    assert out["block_table"].shape == (4, config.max_blocks_per_seq)
    assert out["block_table"][2:].eq(0).all()
    assert {k: v.dtype for k, v in out.items() if isinstance(v, torch.Tensor)} == {
        "input_ids": torch.int64,
        "positions": torch.int64,
        "block_table": torch.int32,
        "seq_lens": torch.int32,
        "slot_mapping": torch.int64,
    }
    with pytest.raises(ValueError, match="more than batch_size"):
        pad_batch(batch, 1, config)


# -- capture ---------------------------------------------------------------------------------------


def test_forward_captures_and_replays_on_the_cpu_reference_backend():
    import devgraph

    graph_model, eager_model = make_decoder(seed=7), make_decoder(seed=7)
    graph_mgr, eager_mgr = KVBlockManager(graph_model.config), KVBlockManager(eager_model.config)
    bucket = 4
    static = graph_model.dummy_inputs(bucket)
    graph = devgraph.device("cpu").graph()
    with torch.no_grad(), graph.capture(auto_update_ops=("devgraph::paged_decode_attention",)):
        out = graph_model(**static)

    lengths = [3, 19]
    histories = [_tokens(n, seed=50 + i) for i, n in enumerate(lengths)]
    for t in range(max(lengths)):
        ids = [i for i, n in enumerate(lengths) if t < n]
        tokens = [histories[i][t] for i in ids]
        padded = pad_batch(graph_mgr.decode_batch(ids, tokens), bucket, graph_model.config)
        for name, value in padded.items():
            if isinstance(value, torch.Tensor):
                static[name].copy_(value)
        graph.replay(host_args={"seq_lens_host": padded["seq_lens_host"]})
        with torch.no_grad():
            expected = eager_model(**eager_mgr.decode_batch(ids, tokens))
        torch.testing.assert_close(out[: len(ids)], expected, atol=1e-5, rtol=1e-5)


# -- construction and config -----------------------------------------------------------------------


def test_make_decoder_is_deterministic_per_seed():
    a, b, c = make_decoder(seed=0), make_decoder(seed=0), make_decoder(seed=1)
    for (name, pa), pb, pc in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(pa, pb), name
        assert not torch.equal(pa, pc), name


def test_make_decoder_builds_caches_of_the_configured_shape():
    config = DecoderConfig(num_layers=3, num_blocks=10, block_size=8)
    model = make_decoder(config)
    assert len(model.layers) == 3
    for layer in model.layers:
        assert layer.k_cache.shape == (10, 8, 2, 16)
        assert layer.v_cache.shape == (10, 8, 2, 16)
    assert "layers.0.k_cache" not in model.state_dict()


def test_config_defaults():
    config = DecoderConfig()
    assert (config.head_dim, config.max_seq_len) == (16, 128)
    assert config.dtype == torch.float32
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        config.num_layers = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"hidden_size": 0}, "hidden_size"),
        ({"vocab_size": -1}, "vocab_size"),
        ({"vocab_size": 2.5}, "vocab_size"),
        ({"num_layers": True}, "num_layers"),
        ({"hidden_size": 60, "num_heads": 8}, "hidden_size"),
        ({"num_kv_heads": 3}, "num_kv_heads"),
        ({"hidden_size": 12, "num_heads": 4, "num_kv_heads": 2}, "head_dim"),
        ({"num_blocks": 1}, "num_blocks"),
        ({"rms_eps": 0.0}, "rms_eps"),
        ({"rope_theta": -1.0}, "rope_theta"),
        ({"dtype": torch.int32}, "dtype"),
    ],
)
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        DecoderConfig(**kwargs)


# -- block manager ---------------------------------------------------------------------------------


def test_block_manager_never_hands_out_the_scratch_block():
    config = DecoderConfig(num_blocks=4, block_size=2)
    manager = KVBlockManager(config)
    batch = manager.decode_batch([0, 1, 2], [1, 2, 3])
    assert sorted(b for s in range(3) for b in manager.blocks(s)) == [1, 2, 3]
    assert SCRATCH_BLOCK not in batch["block_table"][:, :1].flatten().tolist()
    assert manager.num_free_blocks == 0


def test_block_manager_slots_positions_and_tables():
    config = DecoderConfig(block_size=4)
    manager = KVBlockManager(config)
    batches = [manager.decode_batch(["a"], [t]) for t in range(6)]
    assert [b["positions"].item() for b in batches] == [0, 1, 2, 3, 4, 5]
    assert [b["seq_lens_host"] for b in batches] == [[1], [2], [3], [4], [5], [6]]
    assert [b["slot_mapping"].item() for b in batches] == [4, 5, 6, 7, 8, 9]  # blocks 1 then 2
    assert batches[-1]["block_table"][0, :3].tolist() == [1, 2, 0]
    assert batches[-1]["seq_lens"].tolist() == [6]


def test_block_manager_out_of_blocks_raises_and_changes_nothing():
    config = DecoderConfig(num_blocks=3, block_size=2)
    manager = KVBlockManager(config)
    manager.decode_batch([0, 1], [1, 1])
    manager.decode_batch([0, 1], [1, 1])
    with pytest.raises(OutOfBlocksError, match="out of blocks"):
        manager.decode_batch([0, 1], [1, 1])
    assert (manager.seq_len(0), manager.seq_len(1)) == (2, 2)
    manager.free(1)
    assert manager.decode_batch([0], [1])["seq_lens_host"] == [3]


def test_block_manager_refuses_to_grow_past_max_blocks_per_seq():
    config = DecoderConfig(block_size=2, max_blocks_per_seq=2)
    manager = KVBlockManager(config)
    for _ in range(4):
        manager.decode_batch([0], [1])
    with pytest.raises(OutOfBlocksError, match="max_blocks_per_seq"):
        manager.decode_batch([0], [1])


def test_block_manager_free_returns_blocks():
    manager = KVBlockManager(DecoderConfig())
    manager.decode_batch([7], [1])
    before = manager.num_free_blocks
    manager.free(7)
    manager.free(7)  # unknown ids are ignored
    assert manager.num_free_blocks == before + 1
    assert manager.seq_len(7) == 0


@pytest.mark.parametrize(
    ("seq_ids", "tokens", "match"),
    [([0, 1], [1], "2 seq_ids but 1 tokens"), ([0, 0], [1, 2], "twice"), ([], [], "at least one")],
)
def test_block_manager_rejects_bad_batches(seq_ids, tokens, match):
    with pytest.raises(ValueError, match=match):
        KVBlockManager(DecoderConfig()).decode_batch(seq_ids, tokens)


def test_block_manager_rejects_non_integer_slot_dtype():
    with pytest.raises(ValueError, match="slot_dtype"):
        KVBlockManager(DecoderConfig(), slot_dtype=torch.float32)


def test_truncate_gives_back_the_blocks_a_shorter_sequence_no_longer_needs():
    config = DecoderConfig(block_size=4)
    manager = KVBlockManager(config)
    free = manager.num_free_blocks
    for _ in range(6):  # 6 tokens: 2 blocks
        manager.decode_batch(["a"], [1])
    assert len(manager.blocks("a")) == 2 and manager.num_free_blocks == free - 2
    manager.truncate("a", 4)  # the rejected tokens' block back
    assert manager.seq_len("a") == 4 and manager.num_free_blocks == free - 1
    step = manager.decode_batch(["a"], [1])  # position 4 starts a fresh block again
    assert step["positions"].tolist() == [4] and len(manager.blocks("a")) == 2
    with pytest.raises(ValueError, match="cannot truncate"):
        manager.truncate("a", 6)
