"""Piecewise mode end to end on the CPU reference backend and the torch_npu simulator.

The paged decoder treats every token as a row, so a prefill of T tokens is T rows of one sequence
(block table of that sequence, seq_lens = position + 1): the same forward serves decode batches and
prefills of any length. Piecewise output must equal eager output for token counts inside, between
and above the captured sizes.
"""

from __future__ import annotations

import logging

import attrs
import pytest
import torch

import devgraph
from devgraph.testing.models import DecoderConfig, KVBlockManager, make_decoder

SIZES = [1, 2, 4, 8, 16, 32]
ATOL = RTOL = 1e-5


@pytest.fixture(scope="module", params=["cpu", "npu-sim"])
def device(request):
    """Module-scoped (the function-scoped ``any_device`` would tear the simulator down between tests,
    and these tests share one compiled model per device)."""
    if request.param == "cpu":
        yield devgraph.device("cpu")
        return
    from devgraph_sim.npu import simulated_torch_npu

    with simulated_torch_npu():
        yield devgraph.device("npu")


class Decoders:
    """A graphed decoder, an eager twin with the same weights, and one block manager for both."""

    def __init__(self, device, config: DecoderConfig, **options) -> None:
        if device.name == "npu":  # Ascend's fused attention (and the simulator) refuses float32
            config = attrs.evolve(config, dtype=torch.bfloat16)
        self.model = make_decoder(config, device=device.torch_device)
        self.reference = make_decoder(config, device=device.torch_device)
        self.graphed = devgraph.wrap(self.model, device=device, **options)
        self.manager = KVBlockManager(config, device=device.torch_device)
        self.next_id = 0

    def new_ids(self, n: int) -> list[int]:
        ids = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        return ids

    def prefill(self, prompts: dict[int, list[int]]) -> dict:
        """One call holding every prompt token as a row (a prefill, or several: a mixed batch)."""
        rows = [self.manager.decode_batch([sid], [tok]) for sid, toks in prompts.items() for tok in toks]
        batch = {k: torch.cat([r[k] for r in rows]) for k in rows[0] if k != "seq_lens_host"}
        batch["seq_lens_host"] = [n for r in rows for n in r["seq_lens_host"]]
        return batch

    def check(self, batch: dict) -> torch.Tensor:
        got = self.graphed(**batch)
        with torch.no_grad():
            want = self.reference(**batch)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
        return got

    def built(self):
        """The runner, after one call has traced and captured it."""
        if not self.graphed.runner.captured:
            (sid,) = self.new_ids(1)
            self.check(self.manager.decode_batch([sid], [1]))
            self.free([sid])
        return self.graphed.runner

    def free(self, ids) -> None:
        for i in ids:
            self.manager.free(i)


@pytest.fixture(scope="module")
def decoders(device):
    return Decoders(device, DecoderConfig(), mode="piecewise", capture_sizes=SIZES)


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 256, (n,), generator=g).tolist()


@pytest.mark.parametrize("tokens", [1, 5, 16, 23, 32, 45])
def test_prefill_equals_eager_for_token_counts(decoders, tokens):
    (sid,) = decoders.new_ids(1)
    decoders.check(decoders.prefill({sid: _tokens(tokens, seed=tokens)}))
    decoders.free([sid])


@pytest.mark.parametrize("batch", [1, 3, 8, 13, 40])
def test_decode_equals_eager_for_batch_sizes(decoders, batch):
    ids = decoders.new_ids(batch)
    decoders.check(decoders.prefill({i: _tokens(3, seed=i) for i in ids}))
    for step in range(3):
        decoders.check(decoders.manager.decode_batch(ids, _tokens(batch, seed=100 + step)))
    decoders.free(ids)


def test_mixed_prefill_and_decode_rows_equal_eager(decoders):
    ids = decoders.new_ids(3)
    decoders.check(decoders.prefill({ids[0]: _tokens(4, 1), ids[1]: _tokens(2, 2)}))
    decoders.check(decoders.prefill({ids[0]: _tokens(1, 3), ids[1]: _tokens(1, 4), ids[2]: _tokens(6, 5)}))
    decoders.free(ids)


def test_sizes_above_the_buckets_run_the_pieces_uncaptured(decoders):
    before = dict(decoders.graphed.stats.fallbacks)
    replays = decoders.graphed.stats.replays
    (sid,) = decoders.new_ids(1)
    decoders.check(decoders.prefill({sid: _tokens(SIZES[-1] + 3, seed=7)}))
    decoders.free([sid])
    stats = decoders.graphed.stats
    assert stats.fallbacks["size_not_captured"] == before.get("size_not_captured", 0) + 1
    assert stats.replays == replays


def test_every_piece_has_a_graph_per_size_in_one_shared_pool(decoders):
    runner = decoders.built()
    assert runner.stats.pieces == decoders.model.config.num_layers + 1
    assert runner.stats.splitting_ops == decoders.model.config.num_layers
    assert runner.stats.captured_sizes == tuple(SIZES)
    pools = set()
    for size in SIZES:
        graphs = runner.pieces.graphs(size)  # size 1 from a trace of its own
        assert len(graphs) == runner.stats.pieces
        pools.update(id(g.pool()) for g in graphs)
    assert len(pools) == 1


def test_attention_runs_eagerly_between_the_pieces(decoders):
    pieces = decoders.built().pieces.traced.compiled.split.pieces
    kinds = [p.is_splitting_op for p in pieces]
    assert kinds == [False, True, False, True, False]
    assert all("paged_decode_attention" in p.ops for p in pieces if p.is_splitting_op)


@pytest.fixture(scope="module")
def both_modes(device):
    def is_decode(block_table, **_):
        return block_table.shape[0] == block_table[:, 0].unique().numel()  # one row per sequence

    return Decoders(
        device,
        DecoderConfig(num_layers=1),
        mode="full_and_piecewise",
        batch_sizes=[1, 2, 4],
        capture_sizes=[8, 16],
        is_decode=is_decode,
    )


def test_full_and_piecewise_sends_decode_to_full_graphs_and_prefill_to_pieces(both_modes):
    ids = both_modes.new_ids(3)
    both_modes.check(
        both_modes.prefill({ids[0]: _tokens(5, 1), ids[1]: _tokens(9, 2), ids[2]: _tokens(2, 3)})
    )
    stats = both_modes.graphed.stats
    assert stats.replays == 1 and stats.full.replays == 0
    for step in range(2):
        both_modes.check(both_modes.manager.decode_batch(ids, _tokens(3, 10 + step)))
    assert stats.replays == 1 and stats.full.replays == 2
    assert stats.full.captured_sizes == (1, 2, 4)
    both_modes.free(ids)


def test_decode_batches_above_the_full_sizes_replay_the_pieces(both_modes):
    ids = both_modes.new_ids(6)
    both_modes.check(both_modes.prefill({i: _tokens(2, 20 + i) for i in ids}))
    stats = both_modes.graphed.stats
    replays, full_replays, eager = stats.replays, stats.full.replays, stats.eager_calls
    # 6 sequences: above the full graphs' largest batch (4), inside the pieces' sizes (8).
    both_modes.check(both_modes.manager.decode_batch(ids, _tokens(6, 30)))
    assert stats.replays == replays + 1 and stats.full.replays == full_replays
    assert stats.eager_calls == eager and "batch_too_large" not in stats.full.fallbacks
    both_modes.free(ids)


def test_full_and_piecewise_graphs_share_one_pool(both_modes):
    ids = both_modes.new_ids(2)
    both_modes.check(both_modes.prefill({ids[0]: _tokens(3, 1), ids[1]: _tokens(2, 2)}))
    both_modes.check(both_modes.manager.decode_batch(ids, _tokens(2, 3)))
    runner = both_modes.graphed.runner
    pools = {id(g.pool()) for size in runner.pieces.plan.sizes for g in runner.pieces.graphs(size)}
    pools.update(id(runner.full.graph(s).pool()) for s in runner.full.sizes)
    assert len(pools) == 1
    both_modes.free(ids)


def test_capture_budget_drops_sizes_and_pads_to_the_next_one(device):
    # 2 pieces per size (1 layer) and 5 streams: two of the four sizes fit.
    dec = Decoders(
        device, DecoderConfig(num_layers=1), mode="piecewise", capture_sizes=[2, 4, 8, 16], capture_budget=5
    )
    (sid,) = dec.new_ids(1)
    dec.check(dec.prefill({sid: _tokens(3, 1)}))
    stats = dec.graphed.stats
    assert len(stats.captured_sizes) == 2 and stats.captured_sizes[-1] == 16
    assert set(stats.dropped_sizes) | set(stats.captured_sizes) == {2, 4, 8, 16}
    assert stats.replays == 1


def test_capture_logs_once_per_size_from_the_first_piece(device, caplog):
    with caplog.at_level(logging.DEBUG, logger="devgraph.compile"):
        dec = Decoders(device, DecoderConfig(num_layers=1), mode="piecewise", capture_sizes=[2, 4, 8])
        dec.check(dec.manager.decode_batch(dec.new_ids(2), [3, 4]))
    lines = [r.getMessage() for r in caplog.records if "capturing" in r.getMessage()]
    assert lines == [f"devgraph: capturing 2 pieces for size {s}" for s in (8, 4, 2)]


# -- a Hugging Face model, split at a user-listed aten op ------------------------------------------


class _Logits(torch.nn.Module):
    """One sequence's tokens as rows: ``input_ids[T] -> logits[T, vocab]``."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids[None], use_cache=False).logits[0]


@pytest.fixture(scope="module")
def hf_model(device):
    pytest.importorskip("transformers")
    from _hf_models import tiny_model

    # tests/_hf_models.py's Llama (2 layers, vocab 128, seed 0) at width 32: head dim 8
    llama = tiny_model(
        "llama",
        hidden_size=32,
        intermediate_size=64,
        head_dim=8,
        max_position_embeddings=128,
        attn_implementation="sdpa",
    )
    model = _Logits(llama.requires_grad_(False))
    graphed = devgraph.wrap(
        model,
        device=device,
        mode="piecewise",
        capture_sizes=[4, 8, 16],
        splitting_ops=["aten::scaled_dot_product_attention"],
    )
    return model, graphed


@pytest.mark.parametrize("tokens", [3, 8, 11, 20])
def test_hf_tiny_llama_piecewise_equals_eager(hf_model, tokens):
    model, graphed = hf_model
    ids = torch.randint(0, 128, (tokens,), generator=torch.Generator().manual_seed(tokens))
    with torch.no_grad():
        want = model(ids)
    torch.testing.assert_close(graphed(ids), want, atol=ATOL, rtol=RTOL)


def test_hf_model_is_split_at_sdpa_and_its_norms_fused(hf_model):
    _, graphed = hf_model
    graphed(torch.arange(5))
    # Dynamo in front: the graph it handed over for this call (traced again after the reset of Dynamo
    # between tests, so the latest; graphed.stats adds up every graph's).
    runner = graphed.graphs.runners[-1]
    assert runner.stats.splitting_ops == 2 and runner.stats.pieces == 3
    assert runner.stats.passes["add_rms_norm"] == 4
    # SDPA returns a fresh tensor every call: the next piece gets it copied into its captured input.
    assert runner.pieces.module.input_copies > 0


def test_fused_qwen3_pieces_equal_eager(device):
    from _fusion_models import make_tiny_qwen3

    model = make_tiny_qwen3()
    graphed = devgraph.wrap(
        model,
        device=device,
        mode="piecewise",
        capture_sizes=[8],
        splitting_ops=["aten::scaled_dot_product_attention"],
    )
    ids = torch.randint(0, 64, (6,), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(6)
    with torch.no_grad():
        want = model(ids, positions)
    torch.testing.assert_close(graphed(ids, positions), want, atol=1e-4, rtol=1e-4)
    assert graphed.stats.passes["split_qkv_rms_norm_rope"] == 2 and graphed.stats.replays == 1
