"""Level 2: ``DevgraphGraphBackend`` driven through SGLang's graph-backend ABC, as SGLang's runner does.

A stub runner stands in for SGLang's ``DecodeCudaGraphRunner``: static buffers sized for the
largest bucket, a paged decode step through ``devgraph.ops.paged_decode_attention`` whose lengths
are a host list (the NPU form), keys captured largest first inside one ``capture_session``. Replay
must equal eager on *refreshed* inputs and host lengths; a replay that ignored either would not.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref
from types import SimpleNamespace

import pytest

# "sglang.srt", not "sglang": this directory is itself importable as a namespace package "sglang".
pytest.importorskip("sglang.srt")

import torch
from sglang.srt.model_executor.runner.shape_key import ShapeKey

from devgraph import ops
from devgraph.adapters.sglang import _stats
from devgraph.adapters.sglang._backend import DevgraphGraphBackend

pytestmark = pytest.mark.usefixtures("fresh_stats")  # every test starts and ends with the counters reset

BUCKETS = [1, 2, 4]
HEADS, KV_HEADS, DIM, BLOCK, BLOCKS, MAX_BLOCKS = 4, 2, 8, 4, 32, 6


@dataclasses.dataclass
class StepOutput:
    """Shaped like SGLang's LogitsProcessorOutput: a dataclass of tensors the backend weak-refs."""

    next_token_logits: torch.Tensor
    hidden_states: torch.Tensor | None = None


class HostLens:
    """The attention backend's side: the current batch's padded host lengths."""

    def __init__(self) -> None:
        self.lens: list[int] = []

    def devgraph_host_args(self) -> dict[str, list[int]]:
        return {"seq_lens_host": list(self.lens)}


class StubRunner:
    """What the backend reads of SGLang's runner: device, attention backend, raw batch size."""

    def __init__(self, attn_backend=None) -> None:
        self.model_runner = SimpleNamespace(device="cpu")
        self.attn_backend = attn_backend
        self.raw_bs: int | None = None
        g = torch.Generator().manual_seed(0)
        self.key_cache = torch.randn(BLOCKS, BLOCK, KV_HEADS, DIM, generator=g)
        self.value_cache = torch.randn(BLOCKS, BLOCK, KV_HEADS, DIM, generator=g)
        self.query = torch.zeros(BUCKETS[-1], HEADS, DIM)
        self.block_table = torch.zeros(BUCKETS[-1], MAX_BLOCKS, dtype=torch.int32)
        self.seq_lens = torch.ones(BUCKETS[-1], dtype=torch.int32)
        self.host_lens: list[int] = [1] * BUCKETS[-1]

    def step(self, bs: int, host_lens: list[int]) -> StepOutput:
        hidden = self.query[:bs] * 1.0  # an op before attention, as a model has
        for _layer in range(2):  # two attention layers: two updatable tasks per graph
            hidden = ops.paged_decode_attention(
                hidden, self.key_cache, self.value_cache, self.block_table[:bs], self.seq_lens[:bs], host_lens
            )
        return StepOutput(next_token_logits=hidden.sum(-1))

    def load(self, bs: int, raw: int, seed: int) -> list[int]:
        """Fill the static buffers with a new batch of ``raw`` rows padded to ``bs`` (SGLang's load_batch)."""
        g = torch.Generator().manual_seed(seed)
        lens = torch.randint(1, BLOCK * MAX_BLOCKS, (raw,), generator=g).tolist() + [1] * (bs - raw)
        self.query[:bs] = torch.randn(bs, HEADS, DIM, generator=g)
        self.block_table[:bs] = torch.randint(0, BLOCKS, (bs, MAX_BLOCKS), generator=g, dtype=torch.int32)
        self.seq_lens[:bs] = torch.tensor(lens, dtype=torch.int32)
        self.raw_bs = raw
        if self.attn_backend is not None:
            self.attn_backend.lens = lens
        return lens


def _pool(backend: DevgraphGraphBackend):
    """The one pool every graph of ``backend`` was captured into."""
    (pool,) = {id(g.pool()): g.pool() for g in backend.graphs.values()}.values()
    return pool


def _capture(runner: StubRunner) -> DevgraphGraphBackend:
    backend = DevgraphGraphBackend(runner)
    with backend.capture_session(stream=None):
        for bs in sorted(BUCKETS, reverse=True):
            lens = [1] * bs  # SGLang's fill value at capture
            backend.capture_one(ShapeKey(bs), lambda bs=bs, lens=lens: runner.step(bs, lens))
    return backend


def test_every_bucket_is_captured_largest_first_and_can_run():
    runner = StubRunner(HostLens())
    backend = _capture(runner)
    assert _stats.stats().captured == [4, 2, 1]
    assert all(backend.can_run(None, ShapeKey(bs)) for bs in BUCKETS)
    assert not backend.can_run(None, ShapeKey(3))


def test_replay_equals_eager_on_refreshed_inputs_and_lengths():
    runner = StubRunner(HostLens())
    backend = _capture(runner)
    for seed, (bs, raw) in enumerate([(4, 3), (2, 2), (4, 4), (1, 1), (4, 1)]):
        lens = runner.load(bs, raw, seed)
        with backend.replay_session():
            got = backend.replay(ShapeKey(bs), None).next_token_logits.clone()
        want = runner.step(bs, lens).next_token_logits
        torch.testing.assert_close(got, want)


def test_stale_check_replays_differ_when_inputs_change():
    # Guards the test above: two batches give different results, so equality with eager is not a
    # coincidence of a replay that ignored the refreshed buffers or lengths.
    runner = StubRunner(HostLens())
    backend = _capture(runner)
    runner.load(4, 4, seed=1)
    first = backend.replay(ShapeKey(4), None).next_token_logits.clone()
    runner.load(4, 4, seed=2)
    second = backend.replay(ShapeKey(4), None).next_token_logits.clone()
    assert not torch.allclose(first, second)


def test_replay_without_host_lengths_reads_the_lengths_frozen_at_capture():
    # An attention backend that never hands over its lengths: the graph replays the capture-time
    # ones (the NPU's semantics, which the CPU reference reproduces) - so a backend that skipped the
    # task update would be caught by test_replay_equals_eager_on_refreshed_inputs_and_lengths.
    runner = StubRunner(attn_backend=None)
    backend = _capture(runner)
    lens = runner.load(4, 4, seed=3)
    got = backend.replay(ShapeKey(4), None).next_token_logits.clone()
    stale = runner.step(4, [1] * 4).next_token_logits
    fresh = runner.step(4, lens).next_token_logits
    torch.testing.assert_close(got, stale)
    assert not torch.allclose(got, fresh)


def test_replay_with_input_update_gives_every_attention_task_the_lengths():
    # SGLang's NPU runner path: one mapping in cpu_update_input for all attention layers.
    runner = StubRunner(attn_backend=None)
    backend = _capture(runner)
    lens = runner.load(4, 2, seed=4)
    got = backend.replay_with_input_update(
        ShapeKey(4), seq_lens=torch.tensor(lens), attr_name="seq_lens_host"
    )
    torch.testing.assert_close(got.next_token_logits, runner.step(4, lens).next_token_logits)


def test_npu_runner_replay_uses_devgraph_attentions_own_lengths():
    # SGLang's NPUGraphRunner names the Ascend kernels' argument (actual_seq_lengths_kv) and pads
    # with 0; devgraph's attention tasks take seq_lens_host, set for this batch outside the graph.
    runner = StubRunner(HostLens())
    backend = _capture(runner)
    lens = runner.load(4, 3, seed=7)
    got = backend.replay_with_input_update(
        ShapeKey(4), seq_lens=[*lens[:3], 0], attr_name="actual_seq_lengths_kv", attr_type=[]
    )
    torch.testing.assert_close(got.next_token_logits, runner.step(4, lens).next_token_logits)
    assert _stats.stats().task_updates == 1


def test_backend_keeps_no_strong_reference_to_capture_outputs():
    # The pool owns output memory; the backend must hold only non-owning views of it.
    runner = StubRunner(HostLens())
    refs = []

    def step(bs):
        out = runner.step(bs, [1] * bs)
        refs.append(weakref.ref(out.next_token_logits))
        return out

    backend = DevgraphGraphBackend(runner)
    with backend.capture_session(stream=None):
        backend.capture_one(ShapeKey(2), lambda: step(2))
    gc.collect()
    assert refs[-1]() is None
    assert backend.holds_graphs()


def test_outputs_are_weak_views_overwritten_by_the_next_replay():
    runner = StubRunner(HostLens())
    backend = _capture(runner)
    runner.load(2, 2, seed=5)
    first = backend.replay(ShapeKey(2), None).next_token_logits
    held = first.clone()
    runner.load(2, 2, seed=6)
    second = backend.replay(ShapeKey(2), None).next_token_logits
    assert first.data_ptr() == second.data_ptr()
    assert not torch.allclose(first, held)  # the first result's memory now holds the second


def test_counters_record_replays_padding_and_task_updates():
    runner = StubRunner(HostLens())
    backend = _capture(runner)
    for seed, (bs, raw) in enumerate([(4, 3), (4, 4), (2, 1)]):
        runner.load(bs, raw, seed)
        backend.replay(ShapeKey(bs), None)
    s = _stats.stats()
    assert dict(s.replays) == {4: 2, 2: 1}
    assert (s.padded_replays, s.padded_rows, s.task_updates) == (2, 2, 3)


def test_backends_of_one_device_share_one_pool_while_graphs_live():
    first = _capture(StubRunner(HostLens()))
    second = _capture(StubRunner(HostLens()))
    assert _pool(second) is _pool(first)


def test_cleanup_drops_graphs_and_a_new_capture_gets_a_fresh_pool():
    gc.collect()  # backends of earlier tests must not hold the shared pool
    runner = StubRunner(HostLens())
    backend = _capture(runner)
    pool = _pool(backend)
    backend.cleanup()
    assert not backend.holds_graphs() and not backend.can_run(None, ShapeKey(4))
    assert pool.retired  # every graph in it was reset: never captured into again
    again = _capture(runner)
    assert _pool(again) is not pool
