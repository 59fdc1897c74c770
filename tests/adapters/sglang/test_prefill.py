"""Level 2: ``DevgraphBreakableBackend`` (SGLang prefill graphs) driven as SGLang's prefill runner drives it.

A stub runner stands in for ``PrefillCudaGraphRunner``: static token buffers sized for the largest
bucket, a two-layer body whose attention is the ``devgraph`` attention backend's extend (SGLang's
``torch_native`` extend over a token-indexed KV pool), buckets captured largest first in one
``capture_session``. Each replay gets a *new* batch: other request splits, cached prefixes, fewer real
tokens than the bucket (padding). Replay must equal the eager body on it; a replay whose break read
the capture-time batch, or attended over the padding, would not.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

# "sglang.srt", not "sglang": this directory is itself importable as a namespace package "sglang".
pytest.importorskip("sglang.srt")

import torch
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.model_executor.runner.shape_key import ShapeKey

from devgraph import DevgraphError
from devgraph.adapters.sglang import _prefill, _stats
from devgraph.adapters.sglang._attention import EXTEND_ATTENTION, DevgraphAttentionBackend
from devgraph.adapters.sglang._prefill import DevgraphBreakableBackend, resolve_prefill_backend_hook

pytestmark = pytest.mark.usefixtures("fresh_stats")  # every test starts and ends with the counters reset

BUCKETS = [8, 16]
HIDDEN, HEADS, KV_HEADS, DIM, LAYERS, SLOTS, REQS, CONTEXT = 32, 4, 2, 8, 2, 64, 4, 32


class KVPool:
    """SGLang's token-indexed KV pool, as the torch_native backend uses it."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.k = [torch.randn(SLOTS, KV_HEADS, DIM, generator=g) for _ in range(LAYERS)]
        self.v = [torch.randn(SLOTS, KV_HEADS, DIM, generator=g) for _ in range(LAYERS)]

    def set_kv_buffer(self, layer, loc_info, k, v) -> None:
        self.k[layer.layer_id][loc_info.loc] = k
        self.v[layer.layer_id][loc_info.loc] = v

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v[layer_id]


class StubRunner:
    """What the backend and the body read of SGLang's prefill runner and model runner."""

    def __init__(self) -> None:
        self.kv = KVPool()
        req_to_token = torch.zeros(REQS, CONTEXT, dtype=torch.int64)
        model_runner = SimpleNamespace(
            device="cpu",
            req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
            token_to_kv_pool=self.kv,
            model=None,
            page_size=1,
        )
        self.attention = DevgraphAttentionBackend(model_runner)
        model_runner.attn_backend = self.attention
        self.model_runner = model_runner
        self.req_to_token = req_to_token
        self.raw_num_tokens: int | None = None
        g = torch.Generator().manual_seed(0)
        self.weights = [torch.randn(HIDDEN, HIDDEN, generator=g) / HIDDEN**0.5 for _ in range(4 * LAYERS)]
        self.layers = [RadixAttention(HEADS, DIM, DIM**-0.5, KV_HEADS, layer_id=i) for i in range(LAYERS)]
        self.hidden = torch.zeros(max(BUCKETS), HIDDEN)  # the static input buffer
        self.out_cache_loc = torch.zeros(max(BUCKETS), dtype=torch.int64)  # static, as SGLang's slot

    def body(self, batch, tokens: int) -> torch.Tensor:
        """The transformer body: projections in the graphs, attention (the backend's extend) between."""
        h = self.hidden[:tokens] * 1.0
        for i, layer in enumerate(self.layers):
            wq, wk, wv, wo = self.weights[4 * i : 4 * i + 4]
            q = h @ wq
            k = (h @ wk)[:, : KV_HEADS * DIM].reshape(-1, KV_HEADS, DIM)
            v = (h @ wv)[:, : KV_HEADS * DIM].reshape(-1, KV_HEADS, DIM)
            h = h + self.attention.forward_extend(q, k, v, layer, batch) @ wo
        return h

    def batch(self, tokens: int, seqs: list[int], prefixes: list[int], seed: int):
        """A batch of ``sum(seqs)`` real tokens padded to ``tokens`` (SGLang's load_batch), its KV slots
        and prefixes laid out in the pool; the static buffers refilled."""
        g = torch.Generator().manual_seed(seed)
        real = sum(seqs)
        slots = torch.randperm(SLOTS - 1, generator=g)[: real + sum(prefixes)] + 1  # slot 0: padding's
        rows, at = [], 0
        for r, (n, p) in enumerate(zip(seqs, prefixes)):
            self.req_to_token[r, : p + n] = slots[at : at + p + n]
            rows.append(slots[at + p : at + p + n])
            at += p + n
        self.hidden[:tokens] = torch.randn(tokens, HIDDEN, generator=g)
        self.out_cache_loc[:tokens] = 0
        self.out_cache_loc[:real] = torch.cat(rows)
        self.raw_num_tokens = real
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
        return SimpleNamespace(
            out_cache_loc=self.out_cache_loc[:tokens],
            req_pool_indices=torch.arange(len(seqs)),
            seq_lens=as_tensor([n + p for n, p in zip(seqs, prefixes)]),
            extend_prefix_lens=as_tensor(prefixes),
            extend_seq_lens=as_tensor(seqs),
            extend_seq_lens_cpu=list(seqs),
            encoder_lens=None,
        )


def _capture(runner: StubRunner) -> DevgraphBreakableBackend:
    backend = DevgraphBreakableBackend(runner)
    with backend.capture_session(stream=None):
        for tokens in sorted(BUCKETS, reverse=True):  # SGLang's runner: largest first
            batch = runner.batch(tokens, [tokens], [0], seed=tokens)
            backend.capture_one(ShapeKey(tokens), lambda b=batch, t=tokens: runner.body(b, t))
    return backend


def test_each_bucket_is_one_breakable_graph_cut_at_every_attention_layer():
    runner = StubRunner()
    backend = _capture(runner)
    assert _stats.stats().prefill_captured == [16, 8]
    for tokens in BUCKETS:
        graph = backend.graphs[ShapeKey(tokens)]
        assert len(graph.graphs) == LAYERS + 1
        assert [b.op for b in graph.captured_breaks] == [EXTEND_ATTENTION] * LAYERS
        assert _stats.stats().prefill_graphs[tokens] == {"segments": LAYERS + 1, "breaks": LAYERS}
    assert backend.can_run(None, ShapeKey(8)) and not backend.can_run(None, ShapeKey(12))
    assert not runner.attention.breakable  # extend is eager again once capture is over


@pytest.mark.parametrize(
    ("tokens", "seqs", "prefixes"),
    [
        (16, [16], [0]),  # the capture's split, new tokens
        (16, [3, 9, 4], [0, 0, 0]),  # three requests
        (16, [5, 6], [0, 0]),  # 11 real tokens padded to 16
        (8, [2, 5], [4, 7]),  # cached prefixes in the pool, padded
        (8, [1], [9]),
    ],
)
def test_replay_equals_the_eager_body_on_a_new_batch(tokens, seqs, prefixes):
    runner = StubRunner()
    backend = _capture(runner)
    batch = runner.batch(tokens, seqs, prefixes, seed=100 + tokens + len(seqs))
    graphed = backend.replay(ShapeKey(tokens), batch).clone()
    real = sum(seqs)
    with torch.no_grad():
        eager = runner.body(batch, tokens)
    torch.testing.assert_close(graphed[:real], eager[:real])
    assert _stats.stats().prefill_replays[tokens] == 1
    assert _stats.stats().prefill_padded_tokens == tokens - real


def test_padded_tokens_write_no_kv_and_attend_to_nothing():
    runner = StubRunner()
    backend = _capture(runner)
    slot0 = [k[0].clone() for k in runner.kv.k]
    batch = runner.batch(16, [5, 6], [0, 0], seed=7)
    graphed = backend.replay(ShapeKey(16), batch)
    # The padded rows' KV slot (0) is untouched; their attention adds zeros, so the body leaves
    # their hidden rows as they came in.
    assert all(torch.equal(k[0], before) for k, before in zip(runner.kv.k, slot0))
    torch.testing.assert_close(graphed[11:], runner.hidden[11:16])


def test_cleanup_releases_every_graph():
    runner = StubRunner()
    backend = _capture(runner)
    backend.cleanup()
    assert not backend.holds_graphs()


def test_another_attention_backend_is_refused_naming_the_switch():
    runner = SimpleNamespace(model_runner=SimpleNamespace(device="cpu", attn_backend=object()))
    with pytest.raises(DevgraphError, match="--attention-backend devgraph"):
        DevgraphBreakableBackend(runner)


def test_memory_saver_is_refused():
    with pytest.raises(DevgraphError, match="--enable-memory-saver"):
        DevgraphBreakableBackend(StubRunner(), enable_memory_saver=True)


def test_hook_passes_other_platforms_through_to_sglang():
    calls = []

    def original(runner):
        calls.append(runner)
        return "sglang's backend"

    runner = object()
    assert resolve_prefill_backend_hook(original, runner) == "sglang's backend" and calls == [runner]


def _exec(backend: str):
    prefill = SimpleNamespace(backend=backend)
    graph = SimpleNamespace(cuda_graph_config=SimpleNamespace(prefill=prefill), debug_cuda_graph=False)
    return SimpleNamespace(graph=graph, features=SimpleNamespace(enable_memory_saver=False))


def test_hook_builds_devgraphs_backend_on_devgraphs_platform(monkeypatch):
    import sglang.srt.runtime_context as context

    monkeypatch.setattr(_prefill, "_is_devgraph_platform", lambda: True)
    monkeypatch.setattr(context, "get_exec", lambda: _exec("breakable"))
    backend = resolve_prefill_backend_hook(lambda runner: pytest.fail("SGLang's backend built"), StubRunner())
    assert isinstance(backend, DevgraphBreakableBackend)


def test_hook_refuses_full_prefill_graphs_naming_the_setting(monkeypatch):
    import sglang.srt.runtime_context as context

    monkeypatch.setattr(_prefill, "_is_devgraph_platform", lambda: True)
    monkeypatch.setattr(context, "get_exec", lambda: _exec("full"))
    with pytest.raises(DevgraphError, match="--cuda-graph-backend-prefill breakable"):
        resolve_prefill_backend_hook(lambda runner: None, StubRunner())
