"""devgraph.ops: numerics against float64, registration in the dispatcher, routing, tracing, errors."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import devgraph
import devgraph.ops as ops
from devgraph import DevgraphError, _plugins
from devgraph.backends import _reference
from devgraph.backends.cpu import _kernels as cpu_kernels
from devgraph.backends.cuda import _kernels as cuda_kernels
from devgraph.ops import _defs, _registry

TOL = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2},
}
DTYPES = [torch.float32, torch.bfloat16]
EPS = 1e-6


def _close(actual: torch.Tensor, expected64: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == dtype
    torch.testing.assert_close(actual.double(), expected64, **TOL[dtype])


def _rand(
    *shape: int, dtype: torch.dtype = torch.float32, gen: torch.Generator | None = None
) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


# ----------------------------------------------------------------------------- float64 references


def _rms64(x: torch.Tensor, w: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    x, w = x.double(), w.double()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _quant64(normed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.clamp(torch.round(normed / scale.double()), -128, 127)


def _rope64(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Neox rotary of ``x[T, H, D]`` with per-token ``cos_sin[T, R]``, element by element."""
    out = x.clone()
    half = cos_sin.shape[-1] // 2
    for t in range(x.shape[0]):
        for i in range(half):
            c, s = cos_sin[t, i].item(), cos_sin[t, half + i].item()
            a, b = x[t, :, i], x[t, :, half + i]
            out[t, :, i] = a * c - b * s
            out[t, :, half + i] = b * c + a * s
    return out


def _paged64(q, key_cache, value_cache, block_table, lens, scale):
    """Decode attention gathered token by token (``block_table[b, t // bs]``, offset ``t % bs``)."""
    batch, hq, dim = q.shape
    block_size, hkv = key_cache.shape[1], key_cache.shape[2]
    out = torch.zeros(batch, hq, dim, dtype=torch.float64)
    for b in range(batch):
        length = int(lens[b])
        if length == 0:
            continue
        rows = [(int(block_table[b, t // block_size]), t % block_size) for t in range(length)]
        keys = torch.stack([key_cache[blk, off] for blk, off in rows]).double()  # [L, Hkv, D]
        values = torch.stack([value_cache[blk, off] for blk, off in rows]).double()
        for h in range(hq):
            kv = h // (hq // hkv)
            probs = torch.softmax(keys[:, kv] @ q[b, h].double() * scale, dim=0)
            out[b, h] = probs @ values[:, kv]
    return out


# ----------------------------------------------------------------------------- norms and quant


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 8), (3, 5, 64), (7, 128)])
def test_rms_norm_matches_float64(shape, dtype, gen):
    x, w = _rand(*shape, dtype=dtype, gen=gen), _rand(shape[-1], dtype=dtype, gen=gen)
    _close(ops.rms_norm(x, w, EPS), _rms64(x, w), dtype)


def test_rms_norm_of_non_contiguous_input_is_contiguous(gen):
    x = _rand(8, 6, gen=gen).t()
    out = ops.rms_norm(x, torch.ones(8), EPS)
    assert out.is_contiguous()
    _close(out, _rms64(x, torch.ones(8)), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 8), (2, 3, 32), (9, 64)])
def test_add_rms_norm_matches_float64(shape, dtype, gen):
    x, r = _rand(*shape, dtype=dtype, gen=gen), _rand(*shape, dtype=dtype, gen=gen)
    w = _rand(shape[-1], dtype=dtype, gen=gen)
    normed, summed = ops.add_rms_norm(x, r, w, EPS)
    s64 = x.double() + r.double()
    _close(summed, s64, dtype)
    _close(normed, _rms64(s64, w), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 16), (2, 3, 64)])
def test_add_rms_norm_quant_matches_float64_within_one_step(shape, dtype, gen):
    x, r = _rand(*shape, dtype=dtype, gen=gen), _rand(*shape, dtype=dtype, gen=gen)
    w = _rand(shape[-1], dtype=dtype, gen=gen)
    scale = torch.tensor(0.01, dtype=torch.float32)  # small enough that some values saturate
    q, summed = ops.add_rms_norm_quant(x, r, w, EPS, scale)
    s64 = x.double() + r.double()
    assert q.dtype == torch.int8 and q.shape == x.shape
    # The fused op rounds `normed` to x's dtype before quantising: at most one step from float64.
    assert (q.double() - _quant64(_rms64(s64, w), scale)).abs().max() <= 1
    _close(summed, s64, dtype)
    assert q.abs().max() >= 127


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_quant_equals_unfused_chain_bit_for_bit(dtype, gen):
    x, r, w = (
        _rand(6, 32, dtype=dtype, gen=gen),
        _rand(6, 32, dtype=dtype, gen=gen),
        _rand(32, dtype=dtype, gen=gen),
    )
    scale = torch.tensor([0.05])
    q, summed = ops.add_rms_norm_quant(x, r, w, EPS, scale)
    normed, summed2 = ops.add_rms_norm(x, r, w, EPS)
    assert torch.equal(q, torch.clamp(torch.round(normed.float() / scale), -128, 127).to(torch.int8))
    assert torch.equal(summed, summed2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 16), (2, 3, 64)])
def test_add_rms_norm_dynamic_quant_matches_float64(shape, dtype, gen):
    x, r = _rand(*shape, dtype=dtype, gen=gen), _rand(*shape, dtype=dtype, gen=gen)
    w = _rand(shape[-1], dtype=dtype, gen=gen)
    q, scale, summed = ops.add_rms_norm_dynamic_quant(x, r, w, EPS)
    s64 = x.double() + r.double()
    n64 = _rms64(s64, w)
    scale64 = n64.abs().amax(-1, keepdim=True) / 127
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (*shape[:-1], 1)
    torch.testing.assert_close(scale.double(), scale64, rtol=TOL[dtype]["rtol"], atol=0)
    assert (q.double() - _quant64(n64, scale64)).abs().max() <= 1
    assert q.abs().amax(-1).min() >= 126  # every row uses the full range
    _close(summed, s64, dtype)


def test_add_rms_norm_dynamic_quant_of_zero_row_gives_zero_not_nan():
    x = torch.zeros(2, 16)
    x[1] = 1.0
    q, scale, _ = ops.add_rms_norm_dynamic_quant(x, torch.zeros_like(x), torch.ones(16), EPS)
    assert torch.isfinite(scale).all() and scale[0, 0] > 0
    assert torch.equal(q[0], torch.zeros(16, dtype=torch.int8))
    assert torch.equal(q[1], torch.full((16,), 127, dtype=torch.int8))


# ----------------------------------------------------------------------------- split qkv + norm + rope


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("tokens", "hq", "hkv", "dim", "rotary"),
    [(3, 4, 2, 16, 16), (5, 2, 2, 8, 8), (1, 8, 1, 32, 32), (4, 4, 2, 16, 8)],  # GQA, MHA, MQA, partial
)
def test_split_qkv_rms_norm_rope_matches_float64(tokens, hq, hkv, dim, rotary, dtype, gen):
    qkv = _rand(tokens, (hq + 2 * hkv) * dim, dtype=dtype, gen=gen)
    qw, kw = _rand(dim, dtype=dtype, gen=gen), _rand(dim, dtype=dtype, gen=gen)
    cache = _rand(64, rotary, dtype=dtype, gen=gen)
    positions = torch.randint(0, 64, (tokens,), generator=gen)
    q, k, v = ops.split_qkv_rms_norm_rope(qkv, qw, kw, cache, positions, hq, hkv, dim, EPS)

    q64, k64, v64 = qkv.double().split([hq * dim, hkv * dim, hkv * dim], dim=-1)
    cos_sin = cache.double()[positions]
    q_ref = _rope64(_rms64(q64.reshape(tokens, hq, dim), qw), cos_sin).reshape(tokens, -1)
    k_ref = _rope64(_rms64(k64.reshape(tokens, hkv, dim), kw), cos_sin).reshape(tokens, -1)
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    _close(q, q_ref, dtype)
    _close(k, k_ref, dtype)
    _close(v, v64, dtype)


def test_split_qkv_value_output_never_aliases_input(gen):
    qkv = _rand(1, 4 * 8, gen=gen)
    _, _, v = ops.split_qkv_rms_norm_rope(
        qkv, torch.ones(8), torch.ones(8), torch.zeros(4, 8), torch.zeros(1, dtype=torch.long), 2, 1, 8, EPS
    )
    assert v.untyped_storage().data_ptr() != qkv.untyped_storage().data_ptr()


# ----------------------------------------------------------------------------- paged decode attention

PAGED_CASES = [
    # batch, hq, hkv, dim, block_size, max_blocks, lengths
    (3, 4, 2, 16, 4, 4, [5, 9, 16]),  # GQA, lengths not multiples of the block size, one full
    (2, 2, 2, 8, 8, 3, [1, 17]),  # MHA, length 1
    (4, 8, 1, 32, 16, 2, [31, 2, 16, 0]),  # MQA, an empty sequence
]


def _paged_inputs(case, dtype, gen):
    batch, hq, hkv, dim, block_size, max_blocks, lengths = case
    num_blocks = batch * max_blocks + 3
    q = _rand(batch, hq, dim, dtype=dtype, gen=gen)
    key_cache = _rand(num_blocks, block_size, hkv, dim, dtype=dtype, gen=gen)
    value_cache = _rand(num_blocks, block_size, hkv, dim, dtype=dtype, gen=gen)
    block_table = torch.randperm(num_blocks, generator=gen)[: batch * max_blocks].reshape(batch, max_blocks)
    return (
        q,
        key_cache,
        value_cache,
        block_table.to(torch.int32),
        torch.tensor(lengths, dtype=torch.int32),
        lengths,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", PAGED_CASES)
def test_paged_decode_attention_cpu_kernel_matches_float64(case, dtype, gen):
    q, kc, vc, bt, seq_lens, lengths = _paged_inputs(case, dtype, gen)
    out = ops.paged_decode_attention(q, kc, vc, bt, seq_lens, lengths)
    _close(out, _paged64(q, kc, vc, bt, lengths, q.shape[-1] ** -0.5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", PAGED_CASES)
def test_paged_decode_attention_device_length_math_matches_float64(case, dtype, gen):
    q, kc, vc, bt, seq_lens, lengths = _paged_inputs(case, dtype, gen)
    out = torch.full_like(q, float("nan"))
    cuda_kernels.paged_decode_attention(q, kc, vc, bt, seq_lens, [], 0.3, out)  # CPU tensors, CUDA math
    _close(out, _paged64(q, kc, vc, bt, lengths, 0.3), dtype)


def test_paged_decode_attention_writes_into_given_out_and_returns_it(gen):
    q, kc, vc, bt, seq_lens, lengths = _paged_inputs(PAGED_CASES[0], torch.float32, gen)
    out = torch.empty_like(q)
    assert ops.paged_decode_attention(q, kc, vc, bt, seq_lens, lengths, scale=0.5, out=out) is out
    _close(out, _paged64(q, kc, vc, bt, lengths, 0.5), torch.float32)


def test_cpu_kernel_reads_host_lengths_and_cuda_kernel_reads_device_lengths(gen):
    q, kc, vc, bt, _, _ = _paged_inputs(PAGED_CASES[0], torch.float32, gen)
    host, device = [3, 4, 5], torch.tensor([7, 8, 9], dtype=torch.int32)
    cpu_out = ops.paged_decode_attention(q, kc, vc, bt, device, host, scale=1.0)
    cuda_out = torch.empty_like(q)
    cuda_kernels.paged_decode_attention(q, kc, vc, bt, device, host, 1.0, cuda_out)
    _close(cpu_out, _paged64(q, kc, vc, bt, host, 1.0), torch.float32)
    _close(cuda_out, _paged64(q, kc, vc, bt, [7, 8, 9], 1.0), torch.float32)


def test_device_length_math_ignores_padding_entries_of_the_block_table(gen):
    q, kc, vc, bt, _, _ = _paged_inputs(PAGED_CASES[0], torch.float32, gen)
    lengths = [2, 4, 6]  # uses blocks 0, 0 and 0-1 of each row
    padded = bt.clone()
    padded[:, 2:] = -1
    padded[0, 1:] = 10**6
    out = torch.empty_like(q)
    cuda_kernels.paged_decode_attention(
        q, kc, vc, padded, torch.tensor(lengths, dtype=torch.int32), [], 1.0, out
    )
    _close(out, _paged64(q, kc, vc, bt, lengths, 1.0), torch.float32)


def test_device_length_kernel_replays_new_lengths_without_task_update(gen):
    """Capture-safety of the CUDA math, checked by the CPU reference backend's host-sync check."""
    q, kc, vc, bt, seq_lens, lengths = _paged_inputs(PAGED_CASES[0], torch.float32, gen)
    cuda_kernels.register_all(_registry.register)
    graph = devgraph.device("cpu").graph()
    out = torch.empty_like(q)
    with ops.route(CPU="CUDA"), graph.capture():
        ops.paged_decode_attention(q, kc, vc, bt, seq_lens, lengths, scale=1.0, out=out)
    seq_lens.copy_(torch.tensor([1, 2, 3]))
    # The CPU recorder replays through the dispatcher, so the routing must hold at replay too.
    with ops.route(CPU="CUDA"):
        graph.replay()
    _close(out, _paged64(q, kc, vc, bt, [1, 2, 3], 1.0), torch.float32)


def test_cpu_kernel_replays_stale_host_lengths_until_updated(gen):
    q, kc, vc, bt, seq_lens, lengths = _paged_inputs(PAGED_CASES[0], torch.float32, gen)
    graph = devgraph.device("cpu").graph()
    out = torch.empty_like(q)
    with graph.capture(auto_update_ops=["devgraph::paged_decode_attention"]):
        ops.paged_decode_attention(q, kc, vc, bt, seq_lens, lengths, scale=1.0, out=out)
    seq_lens.copy_(torch.tensor([1, 2, 3]))
    graph.replay()
    _close(out, _paged64(q, kc, vc, bt, lengths, 1.0), torch.float32)  # stale, as on NPU
    graph.replay(host_args={"seq_lens_host": [1, 2, 3]})
    _close(out, _paged64(q, kc, vc, bt, [1, 2, 3], 1.0), torch.float32)


# ----------------------------------------------------------------------------- registration


def test_every_op_has_a_cpu_kernel_and_a_fake_impl_in_the_dispatcher():
    assert set(ops.op_names()) == set(_defs.SCHEMAS)
    for op in ops.op_names():
        assert ops.has_kernel(op, "CPU"), op
        assert ops.has_kernel(f"devgraph::{op}", "Meta"), op  # register_fake installs the Meta kernel


def test_cuda_kernels_register_on_a_cpu_only_torch_build():
    cuda_kernels.register_all(_registry.register)
    for op in ops.op_names():
        assert ops.has_kernel(op, "CUDA"), op
    assert ops.kernel_for("paged_decode_attention", "CUDA") is cuda_kernels.paged_decode_attention
    assert ops.kernel_for("paged_decode_attention", "CPU") is cpu_kernels.paged_decode_attention


def test_has_kernel_is_false_for_unknown_ops_and_unregistered_keys():
    assert not ops.has_kernel("no_such_op", "CPU")
    assert not ops.has_kernel("rms_norm", "XPU")


def test_loading_and_defining_twice_is_harmless(gen):
    x, w = _rand(3, 8, gen=gen), _rand(8, gen=gen)
    before = ops.rms_norm(x, w, EPS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when a kernel overrides another one
        ops.load()
        ops.load()
        _defs.define_all()
        cpu_kernels.register_all(_registry.register)
        cpu_kernels.register_all(_registry.register)
    assert torch.equal(ops.rms_norm(x, w, EPS), before)


def test_registering_a_kernel_for_an_unknown_op_says_which_ops_exist():
    with pytest.raises(DevgraphError, match=r"unknown op devgraph::nope.*rms_norm"):
        _registry.register("nope", "CPU", lambda *a: None)


def test_a_failing_kernel_plugin_is_named_in_the_error():
    class BrokenKernels:
        @devgraph.hookimpl
        def devgraph_register_op_kernels(self, register):
            raise ImportError("no module named fancy_kernels")

    pm = _plugins.plugin_manager()
    pm.register(BrokenKernels(), name="broken_kernels")
    try:
        with pytest.raises(devgraph.PluginLoadError, match=r"broken_kernels.*fancy_kernels"):
            ops.load()
    finally:
        pm.unregister(name="broken_kernels")
    ops.load()


def test_importing_devgraph_does_not_import_ops_and_importing_ops_registers_them():
    code = """
        import sys
        sys.modules["torch_npu"] = None
        import devgraph
        print("devgraph.ops" in sys.modules)
        import devgraph.ops as ops
        print(all(ops.has_kernel(op, "CPU") for op in ops.op_names()), len(ops.op_names()))
    """
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["False", "True", str(len(_defs.SCHEMAS))]


# ----------------------------------------------------------------------------- routing


def test_route_sends_cpu_calls_to_the_privateuse1_kernel(monkeypatch, gen):
    calls = []

    def npu_rms_norm(x, weight, eps):
        calls.append(eps)
        return torch.zeros_like(x)

    # Only the registry's table is patched: the CPU trampoline consults it, no PrivateUse1 kernel is
    # left behind in the dispatcher for other tests.
    monkeypatch.setitem(_registry._kernels, ("rms_norm", "PrivateUse1"), npu_rms_norm)
    x, w = _rand(2, 8, gen=gen), torch.ones(8)
    with ops.route(CPU="PrivateUse1"):
        assert torch.equal(ops.rms_norm(x, w, 0.5), torch.zeros(2, 8))
        assert ops.kernel_for("rms_norm", "CPU") is npu_rms_norm
    assert calls == [0.5]
    _close(ops.rms_norm(x, w, EPS), _rms64(x, w), torch.float32)  # routing ends with the block


def test_route_to_a_key_without_a_kernel_names_both_keys(monkeypatch):
    monkeypatch.delitem(_registry._kernels, ("rms_norm", "PrivateUse1"), raising=False)
    with ops.route(CPU="PrivateUse1"), pytest.raises(DevgraphError, match=r"no PrivateUse1 kernel.*routed"):
        ops.rms_norm(torch.ones(2, 4), torch.ones(4), EPS)


def test_nested_routes_combine_and_unwind_on_error():
    with ops.route(CPU="PrivateUse1"):
        with pytest.raises(RuntimeError), ops.route(CUDA="CPU"):
            assert _registry._route.get() == {"CPU": "PrivateUse1", "CUDA": "CPU"}
            raise RuntimeError("boom")
        assert _registry._route.get() == {"CPU": "PrivateUse1"}
    assert not _registry._route.get()


# ----------------------------------------------------------------------------- tracing


def _all_ops(x, r, w, scale, qkv, qw, kw, cache, positions, q, kc, vc, bt, seq_lens):
    a = ops.rms_norm(x, w, EPS)
    b = ops.add_rms_norm(x, r, w, EPS)
    c = ops.add_rms_norm_quant(x, r, w, EPS, scale)
    d = ops.add_rms_norm_dynamic_quant(x, r, w, EPS)
    e = ops.split_qkv_rms_norm_rope(qkv, qw, kw, cache, positions, 4, 2, 8, EPS)
    f = ops.paged_decode_attention(q, kc, vc, bt, seq_lens, [5, 9, 16])
    return a, *b, *c, *d, *e, f


def _all_args(gen):
    paged = _paged_inputs((3, 4, 2, 8, 4, 4, [5, 9, 16]), torch.float32, gen)
    return (
        _rand(5, 16, gen=gen),
        _rand(5, 16, gen=gen),
        _rand(16, gen=gen),
        torch.tensor(0.05),
        _rand(5, 64, gen=gen),
        _rand(8, gen=gen),
        _rand(8, gen=gen),
        _rand(32, 8, gen=gen),
        torch.arange(5),
        *paged[:5],
    )


def test_torch_compile_fullgraph_traces_every_op(gen):
    torch._dynamo.reset()
    args = _all_args(gen)
    compiled = torch.compile(_all_ops, fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled(*args), _all_ops(*args), strict=True):
        assert torch.equal(got, want)


def test_make_fx_in_fake_mode_records_the_devgraph_ops(gen):
    gm = make_fx(_all_ops, tracing_mode="fake")(*_all_args(gen))
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert {f"devgraph.{op}.default" for op in _defs.SCHEMAS} <= targets


def test_fake_impl_rejects_bad_shapes_while_tracing():
    with pytest.raises(ValueError, match="weight must be"):
        make_fx(lambda x, w: ops.rms_norm(x, w, EPS), tracing_mode="fake")(torch.ones(2, 8), torch.ones(4))


# ----------------------------------------------------------------------------- errors


def _paged_args(**overrides):
    args = dict(
        query=torch.zeros(2, 4, 8),
        key_cache=torch.zeros(6, 4, 2, 8),
        value_cache=torch.zeros(6, 4, 2, 8),
        block_table=torch.zeros(2, 3, dtype=torch.int32),
        seq_lens=torch.ones(2, dtype=torch.int32),
        seq_lens_host=[1, 1],
    )
    args.update(overrides)
    return args


BAD_CALLS = {
    "rms_norm weight size": (
        lambda: ops.rms_norm(torch.ones(2, 16), torch.ones(8), EPS),
        r"weight must be \[H\] = \[16\]",
    ),
    "rms_norm integer x": (
        lambda: ops.rms_norm(torch.ones(2, 4, dtype=torch.int64), torch.ones(4), EPS),
        "x must be a floating",
    ),
    "rms_norm 0-d x": (
        lambda: ops.rms_norm(torch.tensor(1.0), torch.ones(1), EPS),
        r"x must be a tensor \[..., H\]",
    ),
    "add_rms_norm residual": (
        lambda: ops.add_rms_norm(torch.ones(2, 4), torch.ones(3, 4), torch.ones(4), EPS),
        r"residual must be .*\[2, 4\]",
    ),
    "quant scale": (
        lambda: ops.add_rms_norm_quant(torch.ones(2, 4), torch.ones(2, 4), torch.ones(4), EPS, torch.ones(2)),
        "scale must be a one-element float32",
    ),
    "split qkv width": (
        lambda: ops.split_qkv_rms_norm_rope(
            torch.ones(3, 40), torch.ones(8), torch.ones(8), torch.ones(4, 8), torch.arange(3), 4, 2, 8, EPS
        ),
        r"qkv must be \[T, \(num_heads \+ 2 \* num_kv_heads\) \* head_dim\] = \[T, 64\]",
    ),
    "split positions dtype": (
        lambda: ops.split_qkv_rms_norm_rope(
            torch.ones(3, 32), torch.ones(8), torch.ones(8), torch.ones(4, 8), torch.ones(3), 2, 1, 8, EPS
        ),
        r"positions must be int64 .*\[T\] = \[3\]",
    ),
    "split cache width": (
        lambda: ops.split_qkv_rms_norm_rope(
            torch.ones(3, 32), torch.ones(8), torch.ones(8), torch.ones(4, 16), torch.arange(3), 2, 1, 8, EPS
        ),
        "cos_sin_cache must be",
    ),
    "paged query dims": (
        lambda: ops.paged_decode_attention(**_paged_args(query=torch.zeros(2, 32))),
        r"query must be \[B, Hq, D\]",
    ),
    "paged gqa": (
        lambda: ops.paged_decode_attention(
            **_paged_args(key_cache=torch.zeros(6, 4, 3, 8), value_cache=torch.zeros(6, 4, 3, 8))
        ),
        "key_cache must be .*Hkv dividing Hq = 4",
    ),
    "paged head dim": (
        lambda: ops.paged_decode_attention(**_paged_args(key_cache=torch.zeros(6, 4, 2, 16))),
        r"key_cache must be \[num_blocks, block_size, Hkv, D = 8\]",
    ),
    "paged value cache": (
        lambda: ops.paged_decode_attention(**_paged_args(value_cache=torch.zeros(6, 4, 2, 4))),
        "value_cache must be",
    ),
    "paged block table": (
        lambda: ops.paged_decode_attention(**_paged_args(block_table=torch.zeros(3, 3, dtype=torch.int32))),
        r"block_table must be int32 \[B = 2, max_blocks_per_seq\]",
    ),
    "paged block table dtype": (
        lambda: ops.paged_decode_attention(**_paged_args(block_table=torch.zeros(2, 3))),
        "block_table must be int32",
    ),
    "paged seq_lens": (
        lambda: ops.paged_decode_attention(**_paged_args(seq_lens=torch.ones(3, dtype=torch.int32))),
        r"seq_lens must be int32 \[B\] = \[2\]",
    ),
    "paged host lens length": (
        lambda: ops.paged_decode_attention(**_paged_args(seq_lens_host=[1, 1, 1])),
        "seq_lens_host must be a host list of B = 2",
    ),
    "paged host lens tensor": (
        lambda: ops.paged_decode_attention(**_paged_args(seq_lens_host=torch.ones(2, dtype=torch.int32))),
        "seq_lens_host must be a host list",
    ),
    "paged host lens missing on cpu": (
        lambda: ops.paged_decode_attention(**_paged_args(seq_lens_host=None)),
        "CPU reference backend",
    ),
    "paged host lens too long": (
        lambda: ops.paged_decode_attention(**_paged_args(seq_lens_host=[1, 13])),
        r"seq_lens_host\[1\] = 13 exceeds",
    ),
    "paged out": (
        lambda: ops.paged_decode_attention(**_paged_args(), out=torch.zeros(2, 4, 4)),
        r"out must be \[B, Hq, D\] = \[2, 4, 8\]",
    ),
}


@pytest.mark.parametrize("call", list(BAD_CALLS.values()), ids=list(BAD_CALLS))
def test_bad_arguments_raise_value_error_naming_the_argument(call):
    fn, message = call
    with pytest.raises(ValueError, match=message):
        fn()


def test_raw_op_call_raises_the_same_value_error():
    with pytest.raises(ValueError, match=r"devgraph.rms_norm: weight must be \[H\] = \[16\]"):
        torch.ops.devgraph.rms_norm(torch.ones(2, 16), torch.ones(8), EPS)


def test_reference_scale_default_is_inverse_sqrt_head_dim(gen):
    q, kc, vc, bt, seq_lens, lengths = _paged_inputs(PAGED_CASES[1], torch.float32, gen)
    default = ops.paged_decode_attention(q, kc, vc, bt, seq_lens, lengths)
    explicit = torch.empty_like(q)
    _reference.paged_decode_attention_host_lens(q, kc, vc, bt, lengths, 1 / math.sqrt(q.shape[-1]), explicit)
    assert torch.equal(default, explicit)
