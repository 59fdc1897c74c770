"""``devgraph::paged_decode_attention`` with a sliding window and logit soft-capping.

Every kernel (the CPU reference, the CUDA kernel run on CPU tensors, the CPU reference inside a
captured graph with task-updated lengths) is compared with a straightforward eager reference: walk
each sequence's positions through the block table, float64 scores, ``cap * tanh(s / cap)``, keep
the last ``window`` positions (the query's own included: vLLM's CPU attention and Hugging Face's
convention), softmax. The cases are chosen so that a window off by one in either direction, or a
missing cap, changes the result (checked below), and a mutant of the reference kernel's window is
caught. The NPU kernel refuses both features by name.
"""

from __future__ import annotations

import pytest
import torch

import devgraph
import devgraph.ops as ops
from devgraph.backends import _reference
from devgraph.backends.cuda import _kernels as cuda_kernels
from devgraph_sim.npu import simulated_torch_npu

OP = "devgraph::paged_decode_attention"
BLOCK = 4
LENS = [13, 5, 1, 9, 16]  # windows end mid-block and on block edges; one shorter than any window


def _case(lens=LENS, heads=4, kv_heads=2, dim=8, max_blocks=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    batch = len(lens)
    blocks = batch * max_blocks + 1
    q = torch.randn(batch, heads, dim, generator=g) * 2
    k = torch.randn(blocks, BLOCK, kv_heads, dim, generator=g) * 2
    v = torch.randn(blocks, BLOCK, kv_heads, dim, generator=g)
    # A shuffled table, block 0 never used (an engine's null block).
    table = (torch.randperm(blocks - 1, generator=g)[: batch * max_blocks] + 1).view(batch, max_blocks)
    return q, k, v, table.to(torch.int32)


def _eager(q, k, v, table, lens, scale, window=0, cap=0.0):
    """The definition, spelled out position by position."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // k.shape[2]
    for b, length in enumerate(lens):
        first = max(0, length - window) if window else 0
        positions = range(first, length)
        if not positions:
            continue
        keys = torch.stack([k[table[b, t // BLOCK], t % BLOCK] for t in positions]).double()  # [S, Hkv, D]
        values = torch.stack([v[table[b, t // BLOCK], t % BLOCK] for t in positions]).double()
        for h in range(q.shape[1]):
            s = keys[:, h // group] @ q[b, h].double() * scale
            if cap:
                s = cap * torch.tanh(s / cap)
            out[b, h] = torch.softmax(s, 0) @ values[:, h // group]
    return out


def _close(actual, expected):
    torch.testing.assert_close(actual.double(), expected, rtol=1e-5, atol=1e-5)


def _differs(actual, expected):
    return not torch.allclose(actual.double(), expected, rtol=1e-3, atol=1e-3)


SETTINGS = [(0, 0.0), (1, 0.0), (3, 0.0), (4, 0.0), (6, 0.0), (20, 0.0), (0, 1.5), (6, 1.5), (5, 0.7)]


def _cpu(q, k, v, table, lens, window, cap):
    seq = torch.tensor(lens, dtype=torch.int32)
    return ops.paged_decode_attention(
        q, k, v, table, seq, lens, 0.4, sliding_window=window, logits_soft_cap=cap
    )


def _cuda(q, k, v, table, lens, window, cap):
    out = torch.full(q.shape, float("nan"))
    seq = torch.tensor(lens, dtype=torch.int32)
    cuda_kernels.paged_decode_attention(q, k, v, table, seq, [], 0.4, out, window, cap)
    return out


@pytest.mark.parametrize(("window", "cap"), SETTINGS)
@pytest.mark.parametrize("kernel", [_cpu, _cuda], ids=["cpu", "cuda-on-cpu-tensors"])
def test_kernels_equal_the_eager_definition(kernel, window, cap):
    q, k, v, table = _case()
    _close(kernel(q, k, v, table, LENS, window, cap), _eager(q, k, v, table, LENS, 0.4, window, cap))


@pytest.mark.parametrize("window", [3, 4, 6])
def test_the_cases_tell_a_window_off_by_one_and_a_missing_cap(window):
    # Otherwise the comparisons above could not catch those bugs.
    q, k, v, table = _case()
    out = _cpu(q, k, v, table, LENS, window, 1.5)
    assert _differs(out, _eager(q, k, v, table, LENS, 0.4, window - 1, 1.5))
    assert _differs(out, _eager(q, k, v, table, LENS, 0.4, window + 1, 1.5))
    assert _differs(out, _eager(q, k, v, table, LENS, 0.4, window, 0.0))


def test_a_window_off_by_one_in_the_reference_kernel_is_caught(monkeypatch):
    real = _reference.paged_decode_attention_host_lens

    def off_by_one(q, k, v, table, lens, scale, out, sliding_window=0, logits_soft_cap=0.0):
        window = sliding_window + 1 if sliding_window else 0  # sees one token too many
        real(q, k, v, table, lens, scale, out, window, logits_soft_cap)

    monkeypatch.setattr(_reference, "paged_decode_attention_host_lens", off_by_one)
    with pytest.raises(AssertionError):
        test_kernels_equal_the_eager_definition(_cpu, 6, 0.0)


def test_blocks_before_the_window_are_not_read():
    # An engine frees them (vLLM's sliding-window KV manager points their entries at the null block).
    q, k, v, table = _case()
    expected = _cpu(q, k, v, table, LENS, 4, 0.0)
    poisoned = table.clone()
    poisoned[0, :2] = 0  # sequence 0 (13 tokens, window 4: positions 9-12) never reads blocks 0-1
    k2, v2 = k.clone(), v.clone()
    k2[0], v2[0] = float("nan"), float("nan")
    torch.testing.assert_close(_cpu(q, k2, v2, poisoned, LENS, 4, 0.0), expected)


def test_captured_graph_replays_task_updated_lengths_with_the_window_and_cap():
    q, k, v, table = _case()
    seq = torch.tensor(LENS, dtype=torch.int32)
    graph = devgraph.device("cpu").graph()
    with graph.capture(auto_update_ops=[OP]):
        out = ops.paged_decode_attention(
            q, k, v, table, seq, LENS, 0.4, sliding_window=6, logits_soft_cap=1.5
        )
    (task,) = graph.tasks
    assert task.host_args["sliding_window"] == 6 and task.host_args["logits_soft_cap"] == 1.5
    new = [16, 7, 3, 10, 2]
    seq.copy_(torch.tensor(new, dtype=torch.int32))
    graph.replay(host_args={"seq_lens_host": new})
    _close(out, _eager(q, k, v, table, new, 0.4, 6, 1.5))
    graph.replay()  # without an update: the frozen lengths, still windowed and capped
    _close(out, _eager(q, k, v, table, new, 0.4, 6, 1.5))


@pytest.mark.parametrize(("window", "cap"), [(4, 0.0), (0, 2.0)])
def test_npu_kernel_refuses_window_and_soft_cap_by_name(window, cap):
    q, k, v, table = _case()
    q, k, v = q.half(), k.half(), v.half()
    seq = torch.tensor(LENS, dtype=torch.int32)
    with simulated_torch_npu(), pytest.raises(ValueError, match="does not implement sliding windows"):
        ops.paged_decode_attention(q, k, v, table, seq, LENS, 0.4, sliding_window=window, logits_soft_cap=cap)


def test_unsupported_arguments_per_device_kernel():
    assert ops.unsupported_arguments(OP, "CPU") == ()
    assert ops.unsupported_arguments(OP, "CUDA") == ()
    assert ops.unsupported_arguments(OP, "PrivateUse1") == ("sliding_window", "logits_soft_cap")


@pytest.mark.parametrize(
    ("kwargs", "arg"),
    [(dict(sliding_window=-1), "sliding_window"), (dict(logits_soft_cap=-2.0), "logits_soft_cap")],
)
def test_bad_window_or_cap_is_refused_by_name(kwargs, arg):
    q, k, v, table = _case()
    seq = torch.tensor(LENS, dtype=torch.int32)
    with pytest.raises(ValueError, match=f"devgraph.paged_decode_attention: {arg} must be"):
        ops.paged_decode_attention(q, k, v, table, seq, LENS, **kwargs)
