"""The NPU backend, run on the torch_npu simulator (devgraph_sim.npu.simulated_torch_npu)."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch
from _npu_cases import DTYPE, SCALE, attention_case, expected_attention

import devgraph
import devgraph.ops as ops
from devgraph import BackendUnavailable, DevgraphError
from devgraph.backends import _reference
from devgraph.backends.npu import _device as npu_device
from devgraph.backends.npu import _kernels as npu_kernels
from devgraph.ops import _registry
from devgraph.testing import conformance
from devgraph_sim.npu import _runtime as npu_sim_runtime
from devgraph_sim.npu import simulated_torch_npu
from devgraph_sim.npu._streams import SimulatedHang

OP = "devgraph::paged_decode_attention"
IFA = "devgraph_npu_sim::npu_fused_infer_attention_score"  # the simulated torch_npu op


def _real_torch_npu_installed() -> bool:
    import importlib.util

    return "torch_npu" not in sys.modules and importlib.util.find_spec("torch_npu") is not None


def _capture_attention(device, lens, *, auto=True):
    q, k, v, table = attention_case()
    seq = torch.tensor(lens, dtype=torch.int32)
    out = torch.empty_like(q)
    graph = device.graph()
    with graph.capture(auto_update_ops=device.updatable_ops if auto else ()):
        ops.paged_decode_attention(q, k, v, table, seq, lens, SCALE, out)
        doubled = out * 2
    return graph, out, doubled, (q, k, v, table)


# -- availability and the sys.modules contract -------------------------------------------------------


@pytest.mark.skipif(_real_torch_npu_installed(), reason="a real torch_npu is installed here")
def test_npu_is_unavailable_outside_the_simulator():
    with pytest.raises(BackendUnavailable, match="torch_npu"):
        devgraph.device("npu")


def test_npu_device_inside_the_simulator(npu):
    assert npu.name == "npu" and not hasattr(npu, "simulated")  # the backend cannot tell
    assert npu.dispatch_key == "PrivateUse1"
    assert npu.torch_device == torch.device("cpu")
    assert npu.capture_stream_budget == npu_device.NPU_HARDWARE_STREAMS == 2048
    # devgraph's op, then those of torch_npu's handler registry (tests/backends/npu/test_npu_handlers.py)
    assert npu.updatable_ops[0] == OP and IFA in npu.updatable_ops
    row = {b.name: b for b in devgraph.list_backends()}["npu"]
    # The probe says where torch_npu came from: the simulator names itself, with no seam.
    assert row.available and "devgraph_sim.npu" in row.reason and row.version == "2.13.0"


def test_stream_budget_comes_from_the_environment(sim, monkeypatch):
    monkeypatch.setenv("DEVGRAPH_NPU_STREAMS", "96")
    assert npu_device.NpuDevice(0).capture_stream_budget == 96
    monkeypatch.setenv("DEVGRAPH_NPU_STREAMS", "lots")
    with pytest.raises(DevgraphError, match="DEVGRAPH_NPU_STREAMS"):
        npu_device.NpuDevice(0)


def test_the_fake_module_says_it_is_a_simulator(sim):
    import torch_npu

    assert torch_npu is sim and torch_npu.__version__ == "2.13.0"
    assert "simulator" in torch_npu.__doc__
    assert sys.modules["torch_npu.npu"] is torch_npu.npu
    assert not hasattr(torch, "npu")


@pytest.mark.parametrize("before", ["absent", "none"])
def test_sys_modules_entries_are_restored_after_the_block(before, monkeypatch):
    for name in ("torch_npu", "torch_npu.npu"):
        if before == "none":
            monkeypatch.setitem(sys.modules, name, None)
        else:
            monkeypatch.delitem(sys.modules, name, raising=False)
    with simulated_torch_npu():
        devgraph.device("npu")
    for name in ("torch_npu", "torch_npu.npu"):
        if before == "none":
            assert sys.modules[name] is None
        else:
            assert name not in sys.modules


def test_nested_simulators_restore_the_outer_one():
    with simulated_torch_npu() as outer:
        with simulated_torch_npu() as inner:
            assert sys.modules["torch_npu"] is inner
        assert sys.modules["torch_npu"] is outer


def test_devices_do_not_outlive_the_simulator():
    with simulated_torch_npu():
        first = devgraph.device("npu")
    with simulated_torch_npu() as second_module:
        second = devgraph.device("npu")
    assert second is not first and second._torch_npu is second_module


def test_probe_reports_a_disabled_torch_npu():
    code = """
        import sys
        sys.modules["torch_npu"] = None
        import devgraph
        rows = {b.name: b for b in devgraph.list_backends()}
        print(rows["npu"].available)
        print(rows["npu"].reason)
    """
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, check=True
    ).stdout
    available, reason = out.strip().splitlines()
    assert available == "False"
    assert reason == "import of torch_npu is disabled (sys.modules['torch_npu'] is None)"


# -- the graph contract --------------------------------------------------------------------------------


@pytest.mark.parametrize("check", conformance.CHECKS, ids=lambda c: c.__name__)
def test_conformance(check, npu):
    check(npu)


def test_capture_replays_through_the_simulated_npu_graph(npu):
    x = torch.ones(4)
    graph = npu.graph()
    with graph.capture():
        y = x * 3 + 1
    assert graph.native.__class__.__module__ == "devgraph_sim.npu._runtime"
    x.fill_(2.0)
    graph.replay()
    torch.testing.assert_close(y, torch.full((4,), 7.0))


def test_memory_stats_count_graph_pools(npu):
    # The counter is the device's: earlier tests' unreachable graphs (reference cycles) must not
    # give their pools back during this capture and hide its bytes, so collect them first and keep
    # the collector off while measuring.
    gc.collect()
    gc.disable()
    try:
        before = npu.memory_stats().reserved
        x = torch.ones(1024)
        graph = npu.graph()
        with graph.capture():
            y = x + 1
        assert npu.memory_stats().reserved >= before + y.numel() * 4
    finally:
        gc.enable()
    assert npu.memory_stats().peak_allocated >= npu.memory_stats().allocated


def test_call_opaque_is_replayed_on_the_same_tensors(npu):
    x, out = torch.ones(3), torch.zeros(3)

    def opaque(a, b):
        with torch._C._DisableTorchDispatch():  # like compiled code: invisible to dispatch modes
            b.copy_(a * 5)

    graph = npu.graph()
    with graph.capture():
        graph.call_opaque(opaque, x, out, name="opaque")
    x.fill_(2.0)
    graph.replay()
    torch.testing.assert_close(out, torch.full((3,), 10.0))


# -- task update -----------------------------------------------------------------------------------------


def test_attention_is_captured_behind_an_external_event(npu):
    graph, *_ = _capture_attention(npu, [5, 9])
    (task,) = graph.tasks
    assert task.op == OP and task.host_args["seq_lens_host"] == [5, 9]
    steps = graph.native._recorded_ops
    wait = steps.index(f"ExternalEvent[{task.handle[1]._id}].wait")
    assert steps[wait + 1].endswith(".reset")
    # The graph holds what the NPU kernel launches, not the devgraph op as one opaque step.
    assert OP not in steps
    assert npu_sim_runtime._tasks(task.handle[0].segment) == [IFA]


def test_replay_without_update_uses_the_captured_lengths(npu):
    graph, out, doubled, case = _capture_attention(npu, [5, 9])
    graph.replay()
    graph.replay()  # no update in between: the graph must not hang, and stays stale
    torch.testing.assert_close(out, expected_attention(*case, [5, 9]))
    torch.testing.assert_close(doubled, 2 * expected_attention(*case, [5, 9]))


def test_update_replays_with_new_lengths(npu):
    graph, out, doubled, case = _capture_attention(npu, [5, 9])
    graph.update({"seq_lens_host": [12, 3]})
    graph.replay()
    torch.testing.assert_close(out, expected_attention(*case, [12, 3]))
    torch.testing.assert_close(doubled, 2 * expected_attention(*case, [12, 3]))
    assert not torch.allclose(out, expected_attention(*case, [5, 9]))


def test_updated_lengths_stay_until_the_next_update(npu):
    graph, out, _, case = _capture_attention(npu, [5, 9])
    graph.replay(host_args={"seq_lens_host": [7, 7]})
    graph.replay()
    torch.testing.assert_close(out, expected_attention(*case, [7, 7]))
    graph.replay(host_args=[{"seq_lens_host": [1, 16]}])
    torch.testing.assert_close(out, expected_attention(*case, [1, 16]))


def test_explicit_task_group_is_reissued_in_task_update(npu):
    q, k, v, table = attention_case()
    seq = torch.tensor([5, 9], dtype=torch.int32)
    out = torch.empty_like(q)
    graph = npu.graph()
    with graph.capture():
        with graph.task_group() as group:
            ops.paged_decode_attention(q, k, v, table, seq, [5, 9], SCALE, out)
    graph.replay()
    torch.testing.assert_close(out, expected_attention(q, k, v, table, [5, 9]))
    with graph.task_update(group):
        ops.paged_decode_attention(q, k, v, table, seq, [2, 11], SCALE, out)
    graph.replay()
    torch.testing.assert_close(out, expected_attention(q, k, v, table, [2, 11]))


def test_update_reuses_the_captured_attention_workspace(npu, monkeypatch):
    seen = []
    real = npu_kernels._attention_scratch

    def spy(*args, **kwargs):
        scratch = real(*args, **kwargs)
        seen.append(scratch[0])
        return scratch

    monkeypatch.setattr(npu_kernels, "_attention_scratch", spy)
    graph, *_ = _capture_attention(npu, [5, 9])
    graph.update({"seq_lens_host": [3, 3], "scale": SCALE})  # not the lengths alone: the kernel runs
    assert len(seen) == 2 and seen[0] is not None and seen[1] is seen[0]
    # The lengths alone re-issue the launch kept from that run: over the same workspace.
    (launch,) = graph._launches.values()
    assert launch.kwargs["workspace"].data_ptr() == seen[0].data_ptr()


def test_attention_workspace_is_freed_with_its_graph(npu):
    # Regression: the workspace cache was process-global, so a reset graph's workspace (graph-pool
    # memory on hardware) stayed pinned for the life of the process.
    graph, *_ = _capture_attention(npu, [5, 9])
    ((workspace, _lse),) = graph._scratch.values()
    alive = weakref.ref(workspace)
    del workspace
    graph.reset()
    gc.collect()
    assert alive() is None


def test_graphs_do_not_share_attention_workspaces(npu):
    first, *_ = _capture_attention(npu, [5, 9])
    second, *_ = _capture_attention(npu, [5, 9])
    assert next(iter(first._scratch.values()))[0] is not next(iter(second._scratch.values()))[0]


def test_simulated_graph_hangs_when_a_waited_event_is_never_recorded(sim):
    npu = sim.npu
    graph = npu.NPUGraph()
    x = torch.ones(2)
    with npu.graph(graph):
        event = npu.ExternalEvent()
        event.wait(npu.current_stream())
        event.reset(npu.current_stream())
        npu.graph_task_group_begin(npu.current_stream())
        y = x + 1
        npu.graph_task_group_end(npu.current_stream())
    graph.replay()  # queued: it stops at the wait
    with pytest.raises(
        SimulatedHang, match=r"would hang.*ExternalEvent\[\d+\]\.wait in front of task group 0"
    ):
        npu.synchronize()
    event.record()  # what an update (or devgraph's stale-release) does
    graph.replay()
    npu.synchronize()
    torch.testing.assert_close(y, torch.full((2,), 2.0))


def test_simulated_task_update_rewrites_the_group(sim):
    npu = sim.npu
    graph, update_stream = npu.NPUGraph(), npu.Stream()
    x, factor = torch.ones(3), 2.0
    with npu.graph(graph):
        y = torch.empty(3)  # graph memory: outlives any update
        npu.graph_task_group_begin(npu.current_stream())
        torch.mul(x, factor, out=y)  # a host scalar, frozen at capture
        handle = npu.graph_task_group_end(npu.current_stream())
    with npu.stream(update_stream):
        npu.graph_task_update_begin(update_stream, handle)
        torch.mul(x, 10.0, out=y)
        npu.graph_task_update_end(update_stream)
    graph.replay()
    torch.testing.assert_close(y, torch.full((3,), 10.0))


def test_simulated_task_update_runs_nothing_until_the_replay(sim):
    # A task update rewrites parameters; the hardware runs nothing until the graph replays.
    npu = sim.npu
    graph, update_stream = npu.NPUGraph(), npu.Stream()
    x = torch.ones(3)
    with npu.graph(graph):
        y = torch.empty(3)
        npu.graph_task_group_begin(npu.current_stream())
        torch.mul(x, 2.0, out=y)
        handle = npu.graph_task_group_end(npu.current_stream())
    with npu.stream(update_stream):
        npu.graph_task_update_begin(update_stream, handle)
        torch.mul(x, 10.0, out=y)
        npu.graph_task_update_end(update_stream)
    torch.testing.assert_close(y, torch.full((3,), 2.0))  # what the capture computed
    graph.replay()
    torch.testing.assert_close(y, torch.full((3,), 10.0))


def _captured_group(npu, x, y):
    graph = npu.NPUGraph()
    with npu.graph(graph):
        npu.graph_task_group_begin(npu.current_stream())
        torch.mul(x, 2.0, out=y)
        handle = npu.graph_task_group_end(npu.current_stream())
    return graph, handle


_UPDATES_OVER_TEMPORARIES = {
    # the task's own new output, freed when the update returns
    "aten::mul writes a new [3] torch.float32 tensor": lambda x, y: x * 10.0,
    # a task reading / writing a buffer allocated during the update
    "aten::mul reads a [3] torch.float32 tensor that aten::empty_like allocated": (
        lambda x, y: torch.mul(torch.empty_like(x), 10.0, out=y)
    ),
    "aten::mul writes a [3] torch.float32 tensor that aten::empty_like allocated": (
        lambda x, y: torch.mul(x, 10.0, out=torch.empty_like(y))
    ),
}


@pytest.mark.parametrize("message", list(_UPDATES_OVER_TEMPORARIES))
def test_simulated_task_update_refuses_memory_allocated_during_the_update(sim, message):
    npu = sim.npu
    update_stream = npu.Stream()
    x, y = torch.ones(3), torch.zeros(3)
    graph, handle = _captured_group(npu, x, y)
    with npu.stream(update_stream):
        npu.graph_task_update_begin(update_stream, handle)
        try:
            with pytest.raises(RuntimeError, match="memory allocated during the update") as err:
                _UPDATES_OVER_TEMPORARIES[message](x, y)
        finally:
            npu.graph_task_update_end(update_stream)
    assert message in str(err.value)
    graph.replay()  # the refused update left the captured task as it was
    torch.testing.assert_close(y, torch.full((3,), 2.0))


def test_simulated_task_update_must_reissue_the_captured_calls(sim):
    npu = sim.npu
    update_stream = npu.Stream()
    x, y = torch.ones(3), torch.zeros(3)
    _, handle = _captured_group(npu, x, y)
    with npu.stream(update_stream):
        npu.graph_task_update_begin(update_stream, handle)
        torch.add(x, 10.0, out=y)
        with pytest.raises(RuntimeError, match=r"issued \['aten::add'\].*captured \['aten::mul'\]"):
            npu.graph_task_update_end(update_stream)


# -- torch_npu's own auto-dispatch form -------------------------------------------------------------


def _ifa_kwargs(case):
    q, k, v, table = case
    nb, bs, hkv, d = k.shape
    args = (q.unsqueeze(2), k.view(nb, bs, hkv * d), v.view(nb, bs, hkv * d))
    kwargs = dict(
        block_table=table, num_heads=q.shape[1], num_key_value_heads=hkv, scale=SCALE,
        input_layout="BNSD", block_size=bs,
    )  # fmt: skip
    return args, kwargs


def test_auto_dispatch_capture_and_cpu_update_input(sim):
    npu = sim.npu
    case = attention_case()
    args, kwargs = _ifa_kwargs(case)
    graph = npu.NPUGraph()
    with npu.graph(graph, auto_dispatch_capture=True):
        attn, _lse = sim.npu_fused_infer_attention_score(*args, actual_seq_lengths_kv=[5, 9], **kwargs)
    graph.replay()
    with pytest.raises(SimulatedHang, match="would hang"):
        npu.synchronize()  # auto-dispatched tasks need an update before every replay
    graph.update(cpu_update_input=[{"actual_seq_lengths_kv": [12, 3]}])
    graph.replay()
    torch.testing.assert_close(attn.squeeze(2), expected_attention(*case, [12, 3]))
    with pytest.raises(RuntimeError, match="there are 1 operators"):
        graph.update(cpu_update_input=[{}, {}])


def test_auto_dispatch_updates_paged_attention_context_lens(sim):
    npu = sim.npu
    q, k, v, table = attention_case()
    context_lens, out = torch.tensor([5, 9], dtype=torch.int32), torch.empty_like(q)
    graph = npu.NPUGraph()
    with npu.graph(graph, auto_dispatch_capture=True):
        sim._npu_paged_attention(q, k, v, k.shape[2], q.shape[1], SCALE, table, context_lens, out)
    context_lens.fill_(1)  # read on the host at launch: the captured task does not see this
    graph.update([{"context_lens": torch.tensor([5, 9], dtype=torch.int32)}])
    graph.replay()
    torch.testing.assert_close(out, expected_attention(q, k, v, table, [5, 9]))
    graph.update([{"context_lens": torch.tensor([2, 13], dtype=torch.int32)}])
    graph.replay()
    torch.testing.assert_close(out, expected_attention(q, k, v, table, [2, 13]))


def test_update_needs_auto_dispatch_capture(sim):
    graph = sim.npu.NPUGraph()
    with sim.npu.graph(graph):
        torch.ones(1) + 1
    with pytest.raises(RuntimeError, match="auto_dispatch_capture=True"):
        graph.update(cpu_update_input=[{}])


# -- op kernels -------------------------------------------------------------------------------------------


def test_privateuse1_kernels_are_registered_for_every_op():
    for name in ops.op_names():
        assert ops.has_kernel(name, "PrivateUse1"), name
        kernel = ops.kernel_for(name, "PrivateUse1")
        assert kernel.__module__ == npu_kernels.__name__, name


def _spy(monkeypatch, sim, name):
    calls = []
    real = getattr(sim, name)

    def wrapper(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)

    wrapper.out = getattr(real, "out", None)
    monkeypatch.setattr(sim, name, wrapper)
    return calls


def _norm_case(dtype=torch.float32, tokens=3, hidden=16):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    residual = torch.randn(tokens, hidden, generator=g).to(dtype)
    weight = torch.rand(hidden, generator=g).to(dtype) + 0.5
    return x, residual, weight


def test_rms_norm_runs_npu_rms_norm(sim, monkeypatch):
    calls = _spy(monkeypatch, sim, "npu_rms_norm")
    x, _, w = _norm_case()
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), _reference.rms_norm(x, w, 1e-6))
    assert calls == ["npu_rms_norm"]


def test_add_rms_norm_runs_npu_add_rms_norm(sim, monkeypatch):
    calls = _spy(monkeypatch, sim, "npu_add_rms_norm")
    x, r, w = _norm_case()
    # every output, as a sequence (its length included)
    torch.testing.assert_close(ops.add_rms_norm(x, r, w, 1e-6), _reference.add_rms_norm(x, r, w, 1e-6))
    assert calls == ["npu_add_rms_norm"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_quant_matches_the_reference(sim, monkeypatch, dtype):
    calls = _spy(monkeypatch, sim, "npu_quantize")
    x, r, w = _norm_case(dtype)
    scale = torch.tensor([0.02])
    got = ops.add_rms_norm_quant(x, r, w, 1e-6, scale)
    want = _reference.add_rms_norm_quant(x, r, w, 1e-6, scale)
    assert got[0].dtype == torch.int8
    torch.testing.assert_close(got, want)  # every output
    assert calls == ["npu_quantize"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_dynamic_quant_matches_the_reference(sim, monkeypatch, dtype):
    calls = _spy(monkeypatch, sim, "npu_dynamic_quant")
    x, r, w = _norm_case(dtype)
    x[1].zero_()
    r[1].zero_()  # an all-zero row: scale is clamped, q is 0
    got = ops.add_rms_norm_dynamic_quant(x, r, w, 1e-6)
    want = _reference.add_rms_norm_dynamic_quant(x, r, w, 1e-6)
    torch.testing.assert_close(got, want)  # every output
    assert calls == (["npu_dynamic_quant"] if dtype == torch.bfloat16 else [])  # npu op: fp16/bf16 only


@pytest.mark.parametrize("rotary_dim", [8, 4])
def test_split_qkv_rms_norm_rope_matches_the_reference(sim, monkeypatch, rotary_dim):
    calls = _spy(monkeypatch, sim, "npu_rotary_mul")
    g = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, tokens = 4, 2, 8, 3
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g)
    qw, kw = torch.rand(dim, generator=g) + 0.5, torch.rand(dim, generator=g) + 0.5
    cache = torch.randn(32, rotary_dim, generator=g)
    pos = torch.tensor([0, 7, 31])
    args = (qkv, qw, kw, cache, pos, heads, kv_heads, dim, 1e-6)
    for got, want in zip(ops.split_qkv_rms_norm_rope(*args), _reference.split_qkv_rms_norm_rope(*args)):
        torch.testing.assert_close(got, want)
    assert calls == (["npu_rotary_mul"] * 2 if rotary_dim == dim else [])


def test_paged_decode_attention_runs_fused_infer_attention_out(sim, monkeypatch):
    calls = []
    real = sim.npu_fused_infer_attention_score

    class Packet:  # stands in for the op packet; the kernel must call its .out overload
        @staticmethod
        def out(*args, **kwargs):
            calls.append(kwargs)
            return real.out(*args, **kwargs)

    monkeypatch.setattr(sim, "npu_fused_infer_attention_score", Packet)
    case = attention_case()
    q, k, v, table = case
    seq = torch.tensor([5, 9], dtype=torch.int32)
    out = ops.paged_decode_attention(q, k, v, table, seq, [5, 9], SCALE)
    torch.testing.assert_close(out, expected_attention(*case, [5, 9]))
    (kwargs,) = calls
    assert kwargs["actual_seq_lengths_kv"] == [5, 9] and kwargs["input_layout"] == "BNSD"
    assert kwargs["block_size"] == k.shape[1] and kwargs["num_key_value_heads"] == k.shape[2]
    assert kwargs["workspace"] is None  # eager: the op allocates its own workspace


def test_paged_decode_attention_with_strided_out_and_int64_table(npu):
    q, k, v, table = attention_case()
    seq = torch.tensor([5, 9], dtype=torch.int32)
    out = torch.zeros(q.shape[0], q.shape[2], q.shape[1], dtype=q.dtype).transpose(1, 2)  # not contiguous
    ops.paged_decode_attention(q, k, v, table.long(), seq, [5, 9], SCALE, out)
    torch.testing.assert_close(out, expected_attention(q, k, v, table, [5, 9]))


def _bad_call(case, kind):
    """Attention arguments the NPU kernel can only take eagerly: an int64 table, or a strided out."""
    q, table = case[0], case[3]
    if kind == "int64 block_table":
        return table.long(), torch.empty_like(q)
    return table, torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=q.dtype).transpose(1, 2)


@pytest.mark.parametrize("kind", ["int64 block_table", "strided out"])
def test_graph_work_refuses_attention_arguments_that_need_temporaries(npu, kind):
    # Regression: the kernel converted the table / staged the output through per-call temporaries;
    # a task update re-issued the task over new temporaries freed on return (use-after-free).
    case = attention_case()
    q, k, v, _ = case
    table, out = _bad_call(case, kind)
    seq = torch.tensor([5, 9], dtype=torch.int32)
    graph = npu.graph()
    match = "Pass block_table as int32" if kind == "int64 block_table" else "out .* is not contiguous"
    with pytest.raises(ValueError, match=match):
        with graph.capture(auto_update_ops=npu.updatable_ops):
            ops.paged_decode_attention(q, k, v, table, seq, [5, 9], SCALE, out)
    ops.paged_decode_attention(q, k, v, table, seq, [5, 9], SCALE, out)  # eager: converted
    torch.testing.assert_close(out, expected_attention(*case, [5, 9]))


_TEMPORARY = {
    "int64 block_table": "aten::_to_copy writes a new [2, 2] torch.int32 tensor",
    "strided out": "writes a [2, 4, 1, 8] torch.bfloat16 tensor that aten::empty_like allocated",
}


@pytest.mark.parametrize("kind", list(_TEMPORARY))
def test_simulator_catches_a_kernel_that_makes_temporaries_in_a_task_update(npu, monkeypatch, kind):
    fixed = npu_kernels.paged_decode_attention

    def converting(query, key_cache, value_cache, block_table, seq_lens, seq_lens_host, scale, out):
        # The kernel before the fix: a converted table and a staging output, made on every call.
        if block_table.dtype != torch.int32:
            block_table = block_table.to(torch.int32)
        target = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
        fixed(query, key_cache, value_cache, block_table, seq_lens, seq_lens_host, scale, target)
        if target is not out:
            out.copy_(target)

    monkeypatch.setitem(_registry._kernels, ("paged_decode_attention", "PrivateUse1"), converting)
    case = attention_case()
    q, k, v, _ = case
    table, out = _bad_call(case, kind)
    seq = torch.tensor([5, 9], dtype=torch.int32)
    graph = npu.graph()
    with graph.capture(auto_update_ops=npu.updatable_ops):  # capture is fine: graph memory
        ops.paged_decode_attention(q, k, v, table, seq, [5, 9], SCALE, out)
    graph.replay()
    torch.testing.assert_close(out, expected_attention(*case, [5, 9]))
    with pytest.raises(
        DevgraphError, match="simulated NPU task update reads/writes memory allocated during"
    ) as err:
        graph.update({"seq_lens_host": [12, 3]})
    assert _TEMPORARY[kind] in str(err.value)
    # The kernel fails every re-issue, so restoring the previous arguments fails too: poisoned.
    with pytest.raises(DevgraphError, match="cannot replay: restoring task 0"):
        graph.replay()


def test_npu_attention_refuses_float32_with_the_remedy(npu):
    q, k, v, table = attention_case()
    seq = torch.tensor([5, 9], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"takes float16 or bfloat16 .* torch.bfloat16"):
        ops.paged_decode_attention(q.float(), k.float(), v.float(), table, seq, [5, 9], SCALE)


def test_npu_attention_refuses_a_block_size_page_attention_cannot_take(npu):
    q, k, v, table = attention_case(block_size=8)
    with pytest.raises(ValueError, match="block_size 8; page attention needs a multiple of 16"):
        ops.paged_decode_attention(q, k, v, table, torch.tensor([5, 9], dtype=torch.int32), [5, 9], SCALE)


def _raw_ifa(sim, case, **overrides):
    q, k, v, table = case
    nb, bs, hkv, d = k.shape
    kwargs = dict(
        actual_seq_lengths_kv=[5, 9], block_table=table, num_heads=q.shape[1], num_key_value_heads=hkv,
        scale=SCALE, input_layout="BNSD", block_size=bs,
    )  # fmt: skip
    args = [q.unsqueeze(2), k.view(nb, bs, hkv * d), v.view(nb, bs, hkv * d)]
    for name in ("query", "key", "value"):
        if name in overrides:
            args[("query", "key", "value").index(name)] = overrides.pop(name)
    return sim.npu_fused_infer_attention_score(*args, **{**kwargs, **overrides})


_HARDWARE_RULES = {
    "float32 query": (
        lambda c: {"query": c[0].float().unsqueeze(2)},
        "query dtype torch.float32 is not supported",
    ),
    "float32 cache": (
        lambda c: {"key": c[1].float().flatten(2), "value": c[2].float().flatten(2)},
        "key dtype torch.float32 is not supported",
    ),
    "int64 block_table": (
        lambda c: {"block_table": c[3].long()},
        "block_table dtype torch.int64 .* must be int32",
    ),
    "int8 query with page attention": (
        lambda c: {"query": c[0].to(torch.int8).unsqueeze(2)},
        "page attention .* does not support an int8 query",
    ),
    "non-contiguous query": (
        lambda c: {"query": c[0].transpose(0, 1).contiguous().transpose(0, 1).unsqueeze(2)},
        "query is not contiguous",
    ),
}


@pytest.mark.parametrize("rule", list(_HARDWARE_RULES))
def test_simulated_attention_refuses_what_the_hardware_refuses(sim, rule):
    case = attention_case()
    overrides, message = _HARDWARE_RULES[rule]
    with pytest.raises(RuntimeError, match=message):
        _raw_ifa(sim, case, **overrides(case))


def test_simulated_attention_refuses_block_sizes_page_attention_cannot_take(sim):
    with pytest.raises(RuntimeError, match=r"block_size=8: page attention needs .* a multiple of 16"):
        _raw_ifa(sim, attention_case(block_size=8))


def test_simulated_attention_refuses_a_workspace_too_small_for_its_lengths(sim):
    q, k, v, table = case = attention_case()
    nb, bs, hkv, d = k.shape
    args = (q.unsqueeze(2), k.view(nb, bs, hkv * d), v.view(nb, bs, hkv * d))
    kwargs = dict(block_table=table, num_heads=q.shape[1], num_key_value_heads=hkv, scale=SCALE,
                  input_layout="BNSD", block_size=bs)  # fmt: skip
    full = sim._npu_fused_infer_attention_score_get_max_workspace(
        *args, actual_seq_lengths_kv=[5, 9], **kwargs
    )
    out = [torch.empty_like(args[0]), torch.empty(1)]
    sim.npu_fused_infer_attention_score.out(
        *args, actual_seq_lengths_kv=[32, 32], workspace=full, out=out, **kwargs
    )
    torch.testing.assert_close(
        out[0].squeeze(2), expected_attention(*case, [32, 32])
    )  # the max workspace fits any lengths
    with pytest.raises(RuntimeError, match=r"workspace holds .* bytes, this call needs"):
        sim.npu_fused_infer_attention_score.out(
            *args, actual_seq_lengths_kv=[32, 32], workspace=full[: full.numel() // 2], out=out, **kwargs
        )


def test_paged_decode_attention_needs_host_lengths(npu):
    q, k, v, table = attention_case()
    with pytest.raises(ValueError, match="seq_lens_host"):
        ops.paged_decode_attention(q, k, v, table, torch.tensor([5, 9], dtype=torch.int32), None, SCALE)


@pytest.mark.parametrize("layout", ["BSH", "BSND", "BNSD", "BNSD_BSND"])
def test_simulated_fused_infer_attention_matches_sdpa(sim, layout):
    g = torch.Generator().manual_seed(7)
    b, n, nkv, s, skv, d = 2, 4, 2, 3, 6, 8
    q = torch.randn(b, n, s, d, generator=g).to(DTYPE)
    k = torch.randn(b, nkv, skv, d, generator=g).to(DTYPE)
    v = torch.randn(b, nkv, skv, d, generator=g).to(DTYPE)
    mask = torch.ones(s, skv, dtype=torch.bool).triu(skv - s + 1)  # True = masked (torch_npu's convention)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.float(),
        k.repeat_interleave(n // nkv, 1).float(),
        v.repeat_interleave(n // nkv, 1).float(),
        attn_mask=~mask,
        scale=SCALE,
    ).to(DTYPE)
    to = {
        "BSH": lambda t: t.transpose(1, 2).flatten(2),
        "BSND": lambda t: t.transpose(1, 2),
        "BNSD": lambda t: t,
        "BNSD_BSND": lambda t: t,
    }[layout]
    attn, lse = sim.npu_fused_infer_attention_score(
        to(q).contiguous(), to(k).contiguous(), to(v).contiguous(), atten_mask=mask, num_heads=n, num_key_value_heads=nkv, scale=SCALE,
        input_layout=layout, softmax_lse_flag=True,
    )  # fmt: skip
    want = expected.transpose(1, 2) if layout == "BNSD_BSND" else to(expected)
    torch.testing.assert_close(attn, want)
    assert lse.shape == (b, n, s, 1) and lse.dtype == torch.float32


def test_demo_runs_on_the_npu_simulator_in_bfloat16(capsys):
    # Regression: the demo ran its model in float32, which npu_fused_infer_attention_score refuses.
    from devgraph.demo import run_demo

    with simulated_torch_npu():
        assert run_demo("npu", steps=1, batch_sizes=(1,)) == 0
    out = capsys.readouterr().out
    assert "torch.bfloat16" in out and "graphed logits match eager" in out


def test_torchair_pieces_inside_an_acl_graph_capture_are_refused(sim, monkeypatch):
    # Regression: the npu default compiled pieces with torchair (default max-autotune: a GE graph),
    # then captured them into ACL graphs; vllm-ascend treats the two as exclusive.
    import types

    from devgraph.compile import compile_piece

    monkeypatch.setitem(sys.modules, "torchair", types.ModuleType("torchair"))  # importable here
    gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    with pytest.raises(DevgraphError, match="cannot compile pieces that devgraph captures into ACL graphs"):
        compile_piece("torchair", "submod_0", gm, [torch.zeros(2)], npu_device.NpuDevice(0))


def test_npu_default_compile_backend_is_eager_even_with_torchair(sim, monkeypatch):
    import importlib.machinery
    import types

    fake = types.ModuleType("torchair")
    fake.__spec__ = importlib.machinery.ModuleSpec("torchair", None)
    monkeypatch.setitem(sys.modules, "torchair", fake)
    assert npu_device.NpuDevice(0).default_compile_backend == "eager"


def test_update_beyond_the_kv_capacity_is_refused_and_the_task_keeps_its_lengths(npu):
    graph, out, _, case = _capture_attention(npu, [5, 9])
    with pytest.raises(DevgraphError, match=r"actual_seq_lengths_kv\[0\]=999 exceeds the 32 tokens"):
        graph.update({"seq_lens_host": [999, 1]})
    graph.replay()
    torch.testing.assert_close(out, expected_attention(*case, [5, 9]))
