"""The CUDA paged decode attention (flex over the blocks in use, or the SDPA window) against the reference.

Everything but the last class runs on CPU tensors: eager flex with the dense mask computes what the
compiled kernel computes, the block mask is checked against the tokens each sequence owns, flex's
CPU compiler runs the real block-sparse kernel once, and the CPU reference, CUDA and NPU (simulated)
kernels are compared with each other. The ``cuda`` tests run the compiled kernel inside a CUDA graph.

``hypothesis`` is optional here (a GPU machine may lack it): without it the one property test skips,
saying so, and every other test, the ``cuda`` ones included, still collects and runs.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import devgraph
import devgraph.ops as ops
from devgraph.backends import _reference
from devgraph.backends.cuda import _kernels as cuda_kernels
from devgraph.backends.cuda import _paged_attention as pa
from devgraph.graph import _capture
from devgraph.ops import _registry
from devgraph_sim.npu import simulated_torch_npu

try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
except ImportError:
    st = None

HostSyncCheck = _capture._modes()[0]  # the torch function mode devgraph's capture enters

TOL = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2},
    torch.float16: {"rtol": 2e-3, "atol": 2e-3},
}


def _case(batch, hq, hkv, dim, block_size, max_blocks, dtype=torch.float32, seed=0, spare=3):
    g = torch.Generator().manual_seed(seed)
    num_blocks = batch * max_blocks + spare
    q = torch.randn(batch, hq, dim, generator=g).to(dtype)
    k = torch.randn(num_blocks, block_size, hkv, dim, generator=g).to(dtype)
    v = torch.randn(num_blocks, block_size, hkv, dim, generator=g).to(dtype)
    table = torch.randperm(num_blocks, generator=g)[: batch * max_blocks].view(batch, max_blocks)
    return q, k, v, table.to(torch.int32)


def _old(q, k, v, table, lens, scale):
    """The previous CUDA kernel (whole block table, float32): the reference the new one must equal."""
    out = torch.empty(q.shape, dtype=torch.float64)
    _reference.paged_decode_attention_device_lens(
        q, k, v, table, torch.tensor(lens, dtype=torch.int32), scale, out
    )
    return out


def _new(q, k, v, table, lens, scale, out_dtype=None):
    out = torch.full(q.shape, float("nan"), dtype=out_dtype or q.dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=q.device)
    cuda_kernels.paged_decode_attention(q, k, v, table, seq_lens, [], scale, out)
    return out


def _close(actual, expected, dtype):
    assert not actual.isnan().any()
    torch.testing.assert_close(actual.double(), expected.double(), **TOL[dtype])


# -- which path serves which shapes ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("block_size", "dim", "hq", "hkv", "flex"),
    [(16, 16, 4, 2, True), (128, 64, 28, 4, True), (32, 128, 8, 8, True), (1, 64, 4, 2, False),
     (8, 64, 4, 2, False), (48, 64, 4, 2, False), (16, 8, 4, 2, False), (16, 64, 128, 1, False)],
)  # fmt: skip
def test_flex_serves_power_of_two_blocks_of_at_least_16(block_size, dim, hq, hkv, flex):
    q, k, _, _ = _case(1, hq, hkv, dim, block_size, 1, spare=0)
    assert pa.flex_supported(q, k) is flex


# -- the block mask --------------------------------------------------------------------------------


def _owned(table, lens, block_size):
    """(b, physical token) pairs sequence b attends: its first lens[b] tokens through the table."""
    return {
        (b, int(table[b, t // block_size]) * block_size + t % block_size)
        for b, n in enumerate(lens)
        for t in range(n)
    }


@pytest.mark.parametrize("lens", [[5, 16, 0, 64], [1, 17, 33, 48], [64, 64, 64, 64]])
def test_block_mask_lists_each_sequences_blocks_and_cuts_the_last(lens):
    block_size, max_blocks = 16, 4
    _, k, _, table = _case(4, 2, 1, 16, block_size, max_blocks)
    padded = table.clone()
    for b, n in enumerate(lens):  # padding past the blocks in use: any value
        padded[b, -(-n // block_size) :] = -1 if b % 2 else 10**6
    mask = pa.block_mask(padded, torch.tensor(lens), k.shape[0], block_size, group=2)
    kept = set()
    for b, n in enumerate(mask.kv_num_blocks.view(-1).tolist()):
        # What the compiled kernel does: visit the listed blocks, apply mask_mod inside them.
        for block in mask.kv_indices[b, 0, 0, :n].tolist():
            for t in range(block * block_size, (block + 1) * block_size):
                if mask.mask_mod(torch.tensor(b), 0, 0, torch.tensor(t)):
                    kept.add((b, t))
    assert kept == _owned(table, lens, block_size)


def test_dense_block_mask_equals_the_kernels_view():
    block_size, lens = 16, [5, 16, 0, 40]
    _, k, _, table = _case(4, 2, 1, 16, block_size, 3)
    dense = pa.block_mask(table, torch.tensor(lens), k.shape[0], block_size, group=2, dense=True)
    b, t = torch.meshgrid(torch.arange(4), torch.arange(k.shape[0] * block_size), indexing="ij")
    allowed = torch.vmap(torch.vmap(lambda b, t: dense.mask_mod(b, 0, 0, t)))(b, t)
    assert {tuple(x) for x in allowed.nonzero().tolist()} == _owned(table, lens, block_size)


# -- results unchanged: the new kernel equals the old one and the float64 reference -----------------

GRID = [
    # batch, hq, hkv, dim, block_size, max_blocks, lengths
    (3, 4, 2, 16, 16, 4, [5, 16, 64]),  # flex; one block exactly, the table's maximum
    (4, 8, 1, 32, 16, 3, [1, 17, 0, 48]),  # flex, MQA, an empty sequence, block boundaries
    (2, 6, 2, 16, 32, 2, [33, 31]),  # flex, GQA 3 (not a power of two)
    (2, 7, 1, 64, 64, 2, [128, 65]),  # flex, GQA 7
    (3, 4, 4, 16, 16, 2, [0, 0, 0]),  # flex, every sequence empty
    (3, 4, 2, 16, 4, 4, [5, 9, 16]),  # window: block size 4
    (2, 2, 2, 8, 8, 3, [1, 24]),  # window: head dim 8
    (3, 4, 2, 16, 1, 20, [20, 1, 0]),  # window: block size 1 (SGLang's token pool)
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", GRID, ids=lambda c: "-".join(map(str, c[:6])))
def test_new_kernel_equals_old_kernel(case, dtype):
    *shape, lens = case
    q, k, v, table = _case(*shape, dtype=dtype)
    _close(_new(q, k, v, table, lens, 0.3), _old(q, k, v, table, lens, 0.3), dtype)


@pytest.mark.parametrize("case", GRID, ids=lambda c: "-".join(map(str, c[:6])))
def test_new_kernel_equals_the_cpu_reference_kernel(case):
    *shape, lens = case
    q, k, v, table = _case(*shape, dtype=torch.bfloat16)
    expected = ops.paged_decode_attention(q, k, v, table, torch.tensor(lens, dtype=torch.int32), lens, 0.3)
    _close(_new(q, k, v, table, lens, 0.3), expected, torch.bfloat16)


if st is not None:

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        data=st.data(),
        block_size=st.sampled_from([1, 4, 16, 32]),
        kv_heads=st.sampled_from([1, 2]),
        group=st.sampled_from([1, 2, 3, 4]),
        dim=st.sampled_from([8, 16, 32]),
        max_blocks=st.integers(1, 4),
    )
    def test_new_kernel_equals_old_kernel_for_any_lengths(data, block_size, kv_heads, group, dim, max_blocks):
        batch = data.draw(st.integers(1, 4), label="batch")
        capacity = block_size * max_blocks
        near_edges = st.sampled_from(sorted({0, 1, block_size - 1, block_size, block_size + 1, capacity}))
        lengths = st.one_of(st.integers(0, capacity), near_edges.filter(lambda n: 0 <= n <= capacity))
        lens = data.draw(st.lists(lengths, min_size=batch, max_size=batch), label="lens")
        q, k, v, table = _case(batch, kv_heads * group, kv_heads, dim, block_size, max_blocks, seed=len(lens))
        _close(_new(q, k, v, table, lens, dim**-0.5), _old(q, k, v, table, lens, dim**-0.5), torch.float32)

else:

    @pytest.mark.skip(
        reason="hypothesis is not installed (pip install hypothesis): this property test needs it"
    )
    def test_new_kernel_equals_old_kernel_for_any_lengths():
        pass


def test_lengths_past_the_table_are_clamped_and_negative_ones_give_zeros():
    q, k, v, table = _case(3, 4, 2, 16, 16, 2)
    got = _new(q, k, v, table, [40, -3, 32], 0.3)
    _close(got, _old(q, k, v, table, [32, 0, 32], 0.3), torch.float32)


def test_float32_query_over_a_bfloat16_cache_writes_a_float32_out():
    q, k, v, table = _case(2, 4, 2, 16, 16, 2, dtype=torch.bfloat16)
    got = _new(q.float(), k, v, table, [7, 20], 0.3, out_dtype=torch.float32)
    assert got.dtype == torch.float32
    _close(got, _old(q, k, v, table, [7, 20], 0.3), torch.bfloat16)


def _flex(q, k, v, table, seq_lens, scale, **options):
    out = torch.empty_like(q)
    pa.flex_decode(_reference.PagedAttentionArgs(q, k, v, table, seq_lens, [], scale, out), **options)
    return out


def test_compiled_flex_skips_unlisted_blocks_on_cpu():
    """The real block-sparse kernel (flex's CPU compiler), with the kernel's mask_mod alone.

    That mask_mod admits every block but the last one of a sequence, and the blocks no sequence
    lists hold NaN, so this passes only if the kernel reads just the listed blocks: what the CUDA
    kernel relies on. Slow (compiles, ~30 s).
    """
    torch._dynamo.reset()
    q, k, v, table = _case(3, 4, 2, 16, 16, 3)
    unused = torch.ones(k.shape[0], dtype=torch.bool)
    unused[table.view(-1).long()] = False
    k[unused], v[unused] = float("nan"), float("nan")
    lens = [5, 48, 0]
    # flex's CPU compiler wants one kv_indices entry per cache block
    got = _flex(q, k, v, table, torch.tensor(lens), 0.3, compiled=True, width=k.shape[0])
    _close(got, _old(q, k, v, table, lens, 0.3), torch.float32)
    compiles = dict(counters["stats"])
    lens = [17, 1, 32]  # new lengths, same shapes, under capture's host-sync check: no recompile
    seq_lens = torch.tensor(lens)
    with HostSyncCheck("cpu"):  # its checks apply to these (CPU) tensors
        got = _flex(q, k, v, table, seq_lens, 0.3, compiled=True, width=k.shape[0])
    _close(got, _old(q, k, v, table, lens, 0.3), torch.float32)
    assert dict(counters["stats"]) == compiles
    q4, table4, lens = torch.cat([q, q[:1]]), torch.cat([table, table[:1]]), [17, 1, 32, 20]
    got = _flex(q4, k, v, table4, torch.tensor(lens), 0.3, compiled=True, width=k.shape[0])
    _close(got, _old(q4, k, v, table4, lens, 0.3), torch.float32)
    assert dict(counters["stats"]) == compiles  # batch 3 ran padded to 4: batch 4 reuses its kernel


# -- capture safety and the other backends -------------------------------------------------------


def test_window_kernel_replays_new_device_lengths_on_the_cpu_reference():
    """No host reads (the reference backend refuses them at capture); new lengths need no update."""
    q, k, v, table = _case(3, 4, 2, 16, 4, 4)
    seq_lens, lens = torch.tensor([5, 9, 16], dtype=torch.int32), [5, 9, 16]
    cuda_kernels.register_all(_registry.register)
    graph = devgraph.device("cpu").graph()
    out = torch.empty_like(q)
    with ops.route(CPU="CUDA"), graph.capture():
        ops.paged_decode_attention(q, k, v, table, seq_lens, lens, scale=0.3, out=out)
    seq_lens.copy_(torch.tensor([1, 0, 13]))
    with ops.route(CPU="CUDA"):
        graph.replay()
    _close(out, _old(q, k, v, table, [1, 0, 13], 0.3), torch.float32)


def test_block_mask_is_built_without_host_reads_and_follows_new_lengths_on_replay():
    """What the compiled kernel is given, captured by the CPU reference (which refuses host reads).

    (Eager flex itself runs under vmap, which the reference recorder cannot record; on CUDA the
    compiled kernel is one recorded launch.)
    """
    _, k, _, table = _case(3, 2, 1, 16, 16, 4)
    seq_lens = torch.tensor([5, 16, 40])
    graph = devgraph.device("cpu").graph()
    with graph.capture():
        mask = pa.block_mask(table, seq_lens, k.shape[0], 16, group=2)
        counts = mask.kv_num_blocks.clone()
        cut = mask.mask_mod(torch.arange(3), 0, 0, table[:, 0].long() * 16 + 3)  # offset 3 of block 0
    seq_lens.copy_(torch.tensor([3, 0, 64]))
    graph.replay()
    assert counts.view(-1).tolist() == [1, 0, 4]
    # seq 0 holds 3 tokens (offsets 0-2), seq 1 none, seq 2 four full blocks
    assert cut.tolist() == [False, False, True]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", [c for c in GRID if c[4] % 16 == 0], ids=lambda c: "-".join(map(str, c[:6])))
def test_cpu_cuda_and_npu_kernels_agree(case, dtype):
    *shape, lens = case
    q, k, v, table = _case(*shape, dtype=dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    cpu = ops.paged_decode_attention(q, k, v, table, seq_lens, lens, 0.3)
    with simulated_torch_npu():
        npu = ops.paged_decode_attention(q, k, v, table, seq_lens, lens, 0.3)
    cuda = _new(q, k, v, table, lens, 0.3)
    _close(npu, cpu, dtype)
    _close(cuda, cpu, dtype)


# -- on a CUDA GPU: the compiled kernel in a captured graph ----------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("case", GRID, ids=lambda c: "-".join(map(str, c[:6])))
def test_cuda_kernel_equals_old_kernel_on_gpu(case, dtype):
    *shape, lens = case
    q, k, v, table = (t.cuda() for t in _case(*shape, dtype=dtype))
    got = _new(q, k, v, table, lens, 0.3).cpu()
    assert not got.isnan().any()
    tol = {**TOL, torch.float32: {"rtol": 1e-4, "atol": 1e-4}}[dtype]  # GPU float32 dot products
    torch.testing.assert_close(got.double(), _old(q.cpu(), k.cpu(), v.cpu(), table.cpu(), lens, 0.3), **tol)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("block_size", [16, 4], ids=["flex", "window"])
def test_cuda_graph_replays_new_lengths_with_the_new_kernel(block_size):
    dev = devgraph.device("cuda")
    q, k, v, table = (t.cuda() for t in _case(4, 8, 2, 64, block_size, 8, dtype=torch.bfloat16))
    seq_lens = torch.tensor([5, 40, 0, 8 * block_size], dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)

    def step():
        ops.paged_decode_attention(q, k, v, table, seq_lens, None, scale=0.125, out=out)

    stream = dev.capture_stream()
    stream.wait_stream(dev.current_stream())
    with stream:
        step()  # compiles (flex) before capture
        step()
    dev.current_stream().wait_stream(stream)
    graph = dev.graph()
    with graph.capture(auto_update_ops=dev.updatable_ops):  # devgraph's capture, its guards on
        step()
    for lens in ([1, 2, 3, 4], [8 * block_size, 0, 17, 33]):
        seq_lens.copy_(torch.tensor(lens))
        graph.replay()
        dev.synchronize()
        expected = _old(q.cpu(), k.cpu(), v.cpu(), table.cpu(), lens, 0.125)
        _close(out.cpu(), expected, torch.bfloat16)
