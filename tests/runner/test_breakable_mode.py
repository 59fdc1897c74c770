"""devgraph.wrap(mode="breakable") and "full_and_breakable": the breakable part of the one runner.

Decode across buckets and a count of 1, prefill rows, padding, fallback and stats, a dense and a
mixture-of-experts model, routing of decode batches to whole graphs, and the refusal of an op that
should have been a break: on the CPU reference and the NPU simulator.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import devgraph
from devgraph import CaptureError, DevgraphError
from devgraph.testing.models import DecoderConfig, KVBlockManager, make_decoder

SIZES = [1, 2, 4, 8]


def _config(dev, **kw) -> DecoderConfig:
    return DecoderConfig(dtype=torch.bfloat16 if dev.name == "npu" else torch.float32, **kw)


def _pair(dev, mode="breakable", moe=False, **options):
    config = _config(dev, num_layers=2)
    eager = make_decoder(config, seed=1, device=dev.torch_device)
    model = make_decoder(config, seed=1, device=dev.torch_device)
    if moe:
        for a, b in zip(eager.layers, model.layers):
            a.moe = _MoE(config, seed=3).to(dev.torch_device)
            b.moe = _MoE(config, seed=3).to(dev.torch_device)
        eager, model = _MoEDecoder(eager), _MoEDecoder(model)
    options.setdefault("batch_sizes", SIZES)
    return eager, devgraph.wrap(model, device=dev, mode=mode, **options)


def _tol(dev) -> float:
    return 5e-2 if dev.name == "npu" else 1e-4


def _decode_both(dev, eager, graphed, batches):
    """Decode steps of ``batches[i]`` sequences (shrinking/growing) through both; the worst difference."""
    config = eager.config
    managers = [KVBlockManager(config, device=dev.torch_device) for _ in range(2)]
    worst = 0.0
    for step, batch in enumerate(batches):
        tokens = [(5 * i + step) % config.vocab_size + 1 for i in range(batch)]
        ids = list(range(batch))
        a = eager(**managers[0].decode_batch(ids, tokens))
        b = graphed(**managers[1].decode_batch(ids, tokens))
        assert b.shape == a.shape
        worst = max(worst, (a.float() - b.float()).abs().max().item())
    return worst


def test_decode_across_buckets_and_a_count_of_one_equals_eager(any_device):
    eager, graphed = _pair(any_device)
    with torch.no_grad():
        assert _decode_both(any_device, eager, graphed, [1, 3, 5, 8, 2, 1]) < _tol(any_device)
    stats = graphed.stats
    assert stats.replays == 6 and stats.eager_calls == 0
    assert stats.captured_sizes == tuple(sorted(SIZES, reverse=True)) or sorted(stats.captured_sizes) == SIZES
    assert stats.graphs == len(SIZES) * 3 and stats.breaks == 2  # 2 attention layers: 3 segments per size


def _prefill(manager, seq, tokens):
    rows = [manager.decode_batch([seq], [t]) for t in tokens]
    batch = {k: torch.cat([r[k] for r in rows]) for k in rows[0] if k != "seq_lens_host"}
    batch["seq_lens_host"] = [x for r in rows for x in r["seq_lens_host"]]
    return batch


def test_prefill_rows_of_new_lengths_equal_eager(any_device):
    """A prompt as rows (one token each, lengths 1..T): attention sees each call's lengths."""
    eager, graphed = _pair(any_device)
    managers = [KVBlockManager(eager.config, device=any_device.torch_device) for _ in range(2)]
    with torch.no_grad():
        for seq, prompt in enumerate([[3, 1, 4, 1, 5], [9, 2], [6, 5, 3, 5, 8, 9, 7]]):
            a = eager(**_prefill(managers[0], seq, prompt))
            b = graphed(**_prefill(managers[1], seq, prompt))
            torch.testing.assert_close(b.float(), a.float(), atol=_tol(any_device), rtol=0)
    assert graphed.stats.replays == 3


def test_a_batch_above_the_largest_bucket_falls_back_counted(any_device):
    eager, graphed = _pair(any_device, batch_sizes=[1, 2])
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        assert _decode_both(any_device, eager, graphed, [3, 1]) < _tol(any_device)
    assert graphed.stats.fallbacks == {"batch_too_large": 1} and graphed.stats.replays == 1
    assert any("batch_too_large" in str(w.message) for w in caught)


class _MoE(nn.Module):
    """Top-2 of 4 experts per row, computed densely with masks (fixed shapes, rows independent)."""

    def __init__(self, config: DecoderConfig, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        h, e = config.hidden_size, 4
        self.router = nn.Parameter(torch.randn(h, e, generator=g) / h**0.5)
        self.w1 = nn.Parameter(torch.randn(e, h, 2 * h, generator=g) / h**0.5)
        self.w2 = nn.Parameter(torch.randn(e, 2 * h, h, generator=g) / (2 * h) ** 0.5)
        self.to(config.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = torch.topk(torch.softmax(x @ self.router, -1), 2, dim=-1)
        gate = torch.zeros_like(x @ self.router).scatter(-1, chosen, weights)  # [T, E]
        hidden = torch.nn.functional.silu(torch.einsum("th,ehf->tef", x, self.w1))
        return torch.einsum("te,tef,efh->th", gate, hidden, self.w2)


class _MoEDecoder(nn.Module):
    """The reference decoder with an MoE block after every layer (its attention stays the break)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.config = inner.config
        for layer in inner.layers:
            forward = layer.forward

            def moe_forward(*args, _forward=forward, _layer=layer, **kwargs):
                hidden, residual = _forward(*args, **kwargs)
                return hidden + _layer.moe(hidden), residual

            layer.forward = moe_forward

    def devgraph_options(self):
        return self.inner.devgraph_options()

    def forward(self, input_ids, positions, block_table, seq_lens, slot_mapping, seq_lens_host):
        return self.inner(input_ids, positions, block_table, seq_lens, slot_mapping, seq_lens_host)


def test_a_mixture_of_experts_decoder_equals_eager(any_device):
    eager, graphed = _pair(any_device, moe=True)
    with torch.no_grad():
        assert _decode_both(any_device, eager, graphed, [3, 1, 8]) < _tol(any_device) * 10
    assert graphed.stats.eager_calls == 0 and graphed.stats.replays == 3


def test_full_and_breakable_sends_decode_to_whole_graphs_and_the_rest_to_breakable(any_device):
    def is_decode(**call):  # one row per sequence: every row has its own blocks
        table = call["block_table"]
        return table.unique(dim=0).shape[0] == table.shape[0]

    eager, graphed = _pair(any_device, mode="full_and_breakable", is_decode=is_decode)
    managers = [KVBlockManager(eager.config, device=any_device.torch_device) for _ in range(2)]
    with torch.no_grad():
        for seq, prompt in enumerate([[3, 1, 4], [2, 7]]):  # prefills: rows of one sequence
            a = eager(**_prefill(managers[0], seq, prompt))
            b = graphed(**_prefill(managers[1], seq, prompt))
            torch.testing.assert_close(b.float(), a.float(), atol=_tol(any_device), rtol=0)
        for step in range(2):  # decode steps of both sequences
            a = eager(**managers[0].decode_batch([0, 1], [step + 1, step + 2]))
            b = graphed(**managers[1].decode_batch([0, 1], [step + 1, step + 2]))
            torch.testing.assert_close(b.float(), a.float(), atol=_tol(any_device), rtol=0)
    stats = graphed.stats
    assert stats.replays == 2 and stats.full.replays == 2
    assert stats.eager_calls == 0 and stats.full.eager_calls == 0


def test_full_and_breakable_needs_a_way_to_tell_decode_batches(any_device):
    with pytest.raises(DevgraphError, match="is_decode"):
        _pair(any_device, mode="full_and_breakable")


@torch.library.custom_op("devgraph_testing::scale_rows", mutates_args=())
def _scale_rows(x: torch.Tensor, factors: list[int]) -> torch.Tensor:
    return x * torch.tensor(factors, dtype=x.dtype, device=x.device)[:, None]


@_scale_rows.register_fake
def _(x, factors):
    return torch.empty_like(x)


class _HostListModel(nn.Module):
    """A model whose custom op reads a per-row host list: a break, or refused."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, factors: list[int]) -> torch.Tensor:
        return self.proj(_scale_rows(self.proj(x), factors)).relu()


def test_an_unmarked_host_list_op_is_refused_and_a_marked_one_is_served(any_device):
    # Host lists reach break ops in the untraced forward only (frontend='raw'); with Dynamo in front
    # a host list would be a constant of its graph, and host_args is refused.
    model = _HostListModel().to(any_device.torch_device)
    with pytest.raises(DevgraphError, match=r"host_args=.*frontend='raw'"):
        devgraph.wrap(model, device=any_device, mode="breakable", batch_sizes=[2, 4], host_args=["factors"])

    def raw(**options):
        with pytest.warns(UserWarning, match="without Dynamo's guards"):
            return devgraph.wrap(
                model, device=any_device, mode="breakable", frontend="raw", batch_sizes=[2, 4], **options
            )

    refused = raw(host_args=["factors"])
    with torch.no_grad(), pytest.raises(CaptureError, match="mark it as a break") as err:
        refused(torch.randn(3, 4, device=any_device.torch_device), [1, 2, 3])
    assert err.value.op == "devgraph_testing::scale_rows" and "test_breakable_mode.py" in err.value.source
    graphed = raw(host_args=["factors"], pad_values={"factors": 1}, breaks=["devgraph_testing::scale_rows"])
    with torch.no_grad():
        for rows, factors in [(3, [1, 2, 3]), (1, [5]), (4, [2, 2, 0, 7])]:
            x = torch.randn(rows, 4, device=any_device.torch_device)
            torch.testing.assert_close(graphed(x, factors), model(x, factors))
    assert graphed.stats.replays == 3 and graphed.stats.breaks == 1


def test_breaks_must_name_registered_ops():
    model = make_decoder(DecoderConfig(num_layers=1))
    with pytest.raises(DevgraphError, match="spell a break op"):
        devgraph.wrap(model, device="cpu", mode="breakable", breaks=["devgraph_testing::nope"])


def test_breaks_apply_to_breakable_modes_only():
    model = make_decoder(DecoderConfig(num_layers=1))
    with pytest.raises(DevgraphError, match="breaks"):
        devgraph.wrap(model, device="cpu", breaks=["devgraph::paged_decode_attention"])
