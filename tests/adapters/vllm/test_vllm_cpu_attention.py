"""The FULL-graph tasks of vLLM's CPU attention (``_cpu_attention``) on devgraph's CPU reference,
without an engine: a replay re-issued with a step's host lengths computes what vLLM's own kernel
computes on that step, bit for bit, and the KV-cache write is replayed too."""

from __future__ import annotations

import pytest
import torch
from vllm import _custom_ops as vllm_ops

import devgraph
from devgraph.adapters.vllm import _cpu_attention  # defines the devgraph ops

H, HKV, D, BLOCK, BLOCKS, SCALE = 4, 2, 32, 32, 16, 0.17


def _caches():
    kv = torch.randn(BLOCKS, HKV, BLOCK, 2 * D)  # vLLM's CPU layout: [blocks, kv heads, block, 2 * D]
    key_cache, value_cache = kv.view(BLOCKS, HKV, BLOCK * 2, D).chunk(2, dim=2)
    return kv, key_cache, value_cache


def _vllm_step(lens, query, key_cache, value_cache, table):
    """vLLM's CPU attention of one decode step, as its metadata builder and forward run it."""
    n = len(lens)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    start_loc = torch.arange(n + 1, dtype=torch.int32)
    plan = vllm_ops.cpu_attn_get_scheduler_metadata(
        num_reqs=n, num_heads=H, num_kv_heads=HKV, head_dim=D, seq_lens=seq_lens, dtype=torch.float32,
        query_start_loc=start_loc, causal=True, sliding_window_size=-1, isa="vec", enable_kv_split=False,
    )  # fmt: skip
    out = torch.zeros(n, H, D)
    vllm_ops.cpu_attention_with_kv_cache(
        query[:n], key_cache, value_cache, out, start_loc, seq_lens, SCALE, True, None, -1, table[:n], 0.0,
        plan, None,
    )  # fmt: skip
    return out


def _task(query, key_cache, value_cache, out, table, lens):
    torch.ops.devgraph.vllm_cpu_decode_attention(
        query, key_cache, value_cache, out, table, lens, SCALE, -1, 0.0, None, None, H, -1, "vec", False,
        1.0, 1.0, "auto",
    )  # fmt: skip


@pytest.fixture
def step_buffers():
    torch.manual_seed(0)
    _, key_cache, value_cache = _caches()
    table = torch.randint(1, BLOCKS, (4, 4), dtype=torch.int32)
    return torch.randn(4, H, D), key_cache, value_cache, table, torch.zeros(4, H, D)


def test_the_task_is_vllms_kernel_and_padding_rows_change_nothing(step_buffers):
    query, key_cache, value_cache, table, out = step_buffers
    _task(query, key_cache, value_cache, out, table, [5, 90, 17, 0])  # a padded batch of 3
    assert torch.equal(out[:3], _vllm_step([5, 90, 17], query, key_cache, value_cache, table))


def test_replay_reissued_with_the_steps_lengths_equals_vllms_step(step_buffers):
    query, key_cache, value_cache, table, out = step_buffers
    graph = devgraph.device("cpu").graph()
    with graph.capture(auto_update_ops=(_cpu_attention.DECODE_OP,)):
        _task(query, key_cache, value_cache, out, table, [5, 90, 17, 0])
    assert [t.op for t in graph.tasks] == [_cpu_attention.DECODE_OP]
    query.copy_(torch.randn(4, H, D))
    graph.replay(host_args={"seq_lens_host": [7, 3, 50, 0]})
    assert torch.equal(out[:3], _vllm_step([7, 3, 50], query, key_cache, value_cache, table))
    graph.replay()  # not updated: the lengths of the last update, as a device graph keeps them
    assert torch.equal(out[:3], _vllm_step([7, 3, 50], query, key_cache, value_cache, table))
    assert not torch.equal(out[:3], _vllm_step([8, 4, 51], query, key_cache, value_cache, table))


def test_kv_cache_write_is_recorded_and_replayed_with_padding_sent_to_the_null_block():
    # vLLM's own cpu_attn_reshape_and_cache is a C++ function no dispatch mode sees: a capture would
    # drop it. Through the devgraph op it is recorded and replays on the step's slots.
    torch.manual_seed(0)
    kv, key_cache, value_cache = _caches()
    kv.zero_()
    key, value = torch.randn(4, HKV, D), torch.randn(4, HKV, D)
    slots = torch.tensor([40, 70, 100, -1])  # the last row is padding
    graph = devgraph.device("cpu").graph()
    with graph.capture():
        torch.ops.devgraph.vllm_cpu_kv_cache_update(
            key, value, key_cache, value_cache, slots, "vec", 1.0, 1.0, "auto"
        )
    key.copy_(torch.randn(4, HKV, D))
    value.copy_(torch.randn(4, HKV, D))
    slots.copy_(torch.tensor([41, 71, 101, -1]))
    kv.zero_()
    graph.replay()
    expected = torch.zeros_like(kv)
    k, v = expected.view(BLOCKS, HKV, BLOCK * 2, D).chunk(2, dim=2)
    vllm_ops.cpu_attn_reshape_and_cache(key, value, k, v, torch.tensor([41, 71, 101, 0]), "vec")
    assert torch.equal(kv, expected) and kv.abs().sum() > 0


def test_vllm_cpu_kernels_called_directly_in_a_capture_are_refused_by_name():
    """vLLM's CPU attention kernels are CompositeImplicitAutograd C++ functions that compute by
    themselves: no dispatch mode sees them, so the reference could not record them (a replay would
    skip the KV-cache write silently). Called directly inside a capture, they are refused; through
    devgraph's op (what the adapter calls), the write is recorded and replayed."""
    _, key_cache, value_cache = _caches()
    key, value = torch.randn(3, HKV, D), torch.randn(3, HKV, D)
    slots = torch.tensor([0, 1, 2])
    graph = devgraph.device("cpu").graph()
    with pytest.raises(devgraph.CaptureError) as err, graph.capture():
        vllm_ops.cpu_attn_reshape_and_cache(key * 1, value, key_cache, value_cache, slots, "vec")
    assert err.value.op == "_C::cpu_attn_reshape_and_cache"
    assert "test_vllm_cpu_attention.py" in (err.value.source or "") or "_custom_ops.py" in (
        err.value.source or ""
    )

    graph = devgraph.device("cpu").graph()
    with graph.capture():
        torch.ops.devgraph.vllm_cpu_kv_cache_update(
            key * 1, value, key_cache, value_cache, slots, "vec", 1.0, 1.0, "auto"
        )
    key_cache.zero_()
    key.fill_(3.0)
    graph.replay()
    assert int((key_cache == 3.0).sum()) == key.numel()  # the replay wrote the three tokens' keys
