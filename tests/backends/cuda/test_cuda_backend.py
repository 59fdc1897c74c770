"""The CUDA backend: probe and import hygiene (run everywhere), graphs on a real GPU (``-m cuda``)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch

import devgraph
from devgraph import BackendUnavailable, CaptureError, DevgraphError, MemoryPool, TaskGroup
from devgraph.backends import cuda as cuda_plugin
from devgraph.backends.cuda._device import DEVICE_METADATA_OPS, CudaDevice, CudaGraph
from devgraph.testing.conformance import CHECKS, NotApplicable

# -- everywhere: probe, import hygiene, task-update policy ---------------------------------------


@pytest.mark.skipif(
    torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None,
    reason="this torch is a CUDA (or ROCm) build",
)
def test_probe_reports_cpu_only_build() -> None:
    probe = cuda_plugin.probe()
    assert not probe.available
    assert "CPU-only build" in probe.reason and torch.__version__ in probe.reason


def test_probe_reports_torch_not_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)
    probe = cuda_plugin.probe()
    assert not probe.available and "torch is not importable" in probe.reason


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is visible")
def test_device_cuda_raises_backend_unavailable_with_reason() -> None:
    with pytest.raises(BackendUnavailable) as info:
        devgraph.device("cuda")
    assert info.value.reason == cuda_plugin.probe().reason


def test_cuda_backend_is_listed_by_list_backends() -> None:
    rows = {row.name: row for row in devgraph.list_backends()}
    assert "cuda" in rows
    assert rows["cuda"].available == torch.cuda.is_available()


def test_importing_and_probing_cuda_backend_does_not_initialise_cuda() -> None:
    # A fresh interpreter: another test in this process may have initialised CUDA already.
    code = textwrap.dedent(
        """
        import torch
        import devgraph
        import devgraph.backends.cuda._device
        from devgraph.backends import cuda
        cuda.probe()
        devgraph.list_backends()
        print("initialised:", torch.cuda.is_initialized())
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "initialised: False" in result.stdout


def test_cuda_updatable_ops_read_metadata_from_device_tensors() -> None:
    # Every op the runner captures as an updatable task on CUDA must take the no-op update path.
    assert set(CudaDevice.updatable_ops) <= DEVICE_METADATA_OPS


def test_update_of_paged_attention_needs_no_reissue_on_cuda() -> None:
    graph = CudaGraph(CudaDevice(0))  # constructing makes no CUDA call
    assert not graph._needs_reissue(TaskGroup(0, "devgraph::paged_decode_attention"))
    assert graph._needs_reissue(TaskGroup(0, "aten::add"))


@pytest.mark.parametrize("op", ["<explicit>", "aten::add", "devgraph::paged_decode_attention"])
def test_reissuing_a_task_on_cuda_raises_with_remedy(op: str) -> None:
    graph = CudaGraph(CudaDevice(0))
    with pytest.raises(DevgraphError, match="device tensor"):
        graph._task_update_begin(TaskGroup(0, op))


def _raised(exc: BaseException) -> BaseException:
    """``exc`` with a traceback through this file, as a capture block raising it would give it."""
    try:
        raise exc
    except BaseException as raised:
        return raised


def test_cuda_capture_violation_becomes_capture_error() -> None:
    graph = CudaGraph(CudaDevice(0))  # constructing makes no CUDA call; translating makes none
    cause = _raised(RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore"))
    err = graph._translate_capture_error(cause)
    assert isinstance(err, CaptureError)
    assert "operation not permitted when stream is capturing" in str(err) and "more" not in err.message
    assert err.source and "test_cuda_backend.py" in err.source and "raise exc" in err.source
    assert err.remedy and "warm-up" in err.remedy


def test_failed_capture_end_error_becomes_capture_error() -> None:
    graph = CudaGraph(CudaDevice(0))
    cause = _raised(RuntimeError("CUDA error: operation failed due to a previous error during capture"))
    assert isinstance(graph._translate_capture_error(cause), CaptureError)


@pytest.mark.parametrize(
    "exc",
    [RuntimeError("shape mismatch"), ValueError("stream capture"), DevgraphError("stream capture")],
    ids=["other RuntimeError", "not a RuntimeError", "devgraph's own error"],
)
def test_other_errors_in_capture_are_not_translated(exc: BaseException) -> None:
    assert CudaGraph(CudaDevice(0))._translate_capture_error(_raised(exc)) is None


# -- on a CUDA GPU -------------------------------------------------------------------------------

_needs_gpu = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _capture(dev: Any, fn: Any, pool: MemoryPool | None = None, **kwargs: Any) -> tuple[Any, Any]:
    """Warm ``fn`` up on the capture stream (as torch.cuda.graph's docs ask), then capture it."""
    stream = dev.capture_stream()
    stream.wait_stream(dev.current_stream())
    with stream:
        fn()
    dev.current_stream().wait_stream(stream)
    graph = dev.graph()
    with graph.capture(pool=pool, **kwargs):
        out = fn()
    dev.synchronize()
    return graph, out


def _reference_paged_attention(q, key_cache, value_cache, block_table, lens, scale):
    block_size, hkv = key_cache.shape[1], key_cache.shape[2]
    rep = q.shape[1] // hkv
    outs = []
    for b, length in enumerate(lens):
        pos = torch.arange(length, device=q.device)
        blocks = block_table[b, pos // block_size].long()
        k = key_cache[blocks, pos % block_size].repeat_interleave(rep, dim=1)  # [L, Hq, D]
        v = value_cache[blocks, pos % block_size].repeat_interleave(rep, dim=1)
        p = (torch.einsum("hd,lhd->hl", q[b], k) * scale).softmax(-1)
        outs.append(torch.einsum("hl,lhd->hd", p, v))
    return torch.stack(outs)


class TestOnGpu:
    pytestmark = _needs_gpu

    @pytest.fixture
    def dev(self) -> Any:
        return devgraph.device("cuda")

    def test_replay_equals_eager(self, dev: Any) -> None:
        x = torch.randn(8, 64, device="cuda")
        w = torch.randn(64, 64, device="cuda") / 8

        def fn() -> torch.Tensor:
            return torch.nn.functional.gelu(x @ w + 1.0).sigmoid() * x

        graph, out = _capture(dev, fn)
        for _ in range(3):
            x.copy_(torch.randn_like(x))
            graph.replay()
            dev.synchronize()
            torch.testing.assert_close(out, fn())

    @pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
    def test_conformance(self, dev: Any, check: Any) -> None:
        try:
            check(dev)
        except NotApplicable as why:
            pytest.skip(str(why))

    def test_capture_runs_on_the_capture_stream_and_restores_current(self, dev: Any) -> None:
        before = torch.cuda.current_stream()
        seen = []
        graph = dev.graph()
        x = torch.ones(4, device="cuda")
        with graph.capture():
            seen.append(dev.current_stream())
            y = x + 1
        assert seen == [dev.capture_stream()]
        assert torch.cuda.current_stream() == before
        graph.replay()
        dev.synchronize()
        torch.testing.assert_close(y, x + 1)

    @pytest.mark.parametrize("mode", ["default", "global", "thread_local", "relaxed"])
    def test_capture_error_mode_reaches_cuda_graph(self, dev: Any, mode: str) -> None:
        # torch.cuda.CUDAGraph.capture_begin rejects names it does not know, so a wrong mapping
        # ("default" passed through) fails here; each mode captures and replays like eager.
        graph = dev.graph()
        x = torch.ones(4, device="cuda")
        with graph.capture(capture_error_mode=mode):
            y = x * 3
        x.fill_(2.0)
        graph.replay()
        dev.synchronize()
        torch.testing.assert_close(y, torch.full_like(x, 6.0))

    def test_graphs_sharing_a_pool_reuse_its_memory(self, dev: Any) -> None:
        big, small = torch.randn(256, 256, device="cuda"), torch.randn(64, 64, device="cuda")

        def fn(x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x @ x) + x

        for x in (big, small):  # warm up both before measuring
            _capture(dev, lambda x=x: fn(x))
        before = dev.memory_stats().reserved
        g_big, out_big = _capture(dev, lambda: fn(big))
        after_big = dev.memory_stats().reserved
        g_small, out_small = _capture(dev, lambda: fn(small), pool=g_big.pool())
        after_small = dev.memory_stats().reserved
        assert g_small.pool() is g_big.pool()
        assert after_big > before, "the first capture into a fresh pool should reserve memory"
        assert after_small == after_big, "the smaller graph should fit in the larger graph's freed blocks"
        g_big.replay()
        g_small.replay()
        dev.synchronize()
        torch.testing.assert_close(out_big, fn(big))
        torch.testing.assert_close(out_small, fn(small))

    def test_memory_stats_follow_allocations(self, dev: Any) -> None:
        dev.synchronize()
        before = dev.memory_stats()
        block = torch.empty(4 << 20, dtype=torch.uint8, device="cuda")
        during = dev.memory_stats()
        assert during.allocated - before.allocated >= block.numel()
        assert during.reserved >= during.allocated and during.peak_allocated >= during.allocated
        del block
        assert dev.memory_stats().allocated == before.allocated

    def test_weak_ref_does_not_keep_memory_alive(self, dev: Any) -> None:
        dev.synchronize()
        before = torch.cuda.memory_allocated()
        x = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
        weak = dev.weak_ref(x)
        assert weak.data_ptr() == x.data_ptr() and weak.shape == x.shape and weak.device == x.device
        x.add_(1)
        torch.testing.assert_close(weak, x)
        del x
        assert torch.cuda.memory_allocated() == before

    def test_paged_attention_update_is_a_no_op_reading_device_lengths(self, dev: Any) -> None:
        ops = pytest.importorskip("devgraph.ops")
        gen = torch.Generator(device="cuda").manual_seed(0)
        batch, hq, hkv, dim, block_size, num_blocks = 2, 4, 2, 16, 4, 8
        q = torch.randn(batch, hq, dim, device="cuda", generator=gen)
        key_cache = torch.randn(num_blocks, block_size, hkv, dim, device="cuda", generator=gen)
        value_cache = torch.randn(num_blocks, block_size, hkv, dim, device="cuda", generator=gen)
        block_table = torch.arange(num_blocks, dtype=torch.int32, device="cuda").view(batch, -1)
        seq_lens = torch.tensor([3, 5], dtype=torch.int32, device="cuda")
        out = torch.empty(batch, hq, dim, device="cuda")
        scale = dim**-0.5

        def step() -> torch.Tensor:
            return ops.paged_decode_attention(
                q, key_cache, value_cache, block_table, seq_lens, [3, 5], scale=scale, out=out
            )

        graph, _ = _capture(dev, step, auto_update_ops=dev.updatable_ops)
        assert [t.op for t in graph.tasks] == ["devgraph::paged_decode_attention"]
        seq_lens.copy_(torch.tensor([7, 2], dtype=torch.int32))
        graph.replay(host_args={"seq_lens_host": [7, 2]})  # records the host values, re-issues nothing
        dev.synchronize()
        assert graph.tasks[0].host_args["seq_lens_host"] == [7, 2]
        expected = _reference_paged_attention(q, key_cache, value_cache, block_table, [7, 2], scale)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)

    def test_explicit_task_update_raises(self, dev: Any) -> None:
        x = torch.ones(4, device="cuda")
        graph = dev.graph()
        with graph.capture():
            with graph.task_group() as group:
                y = x * 2
        with pytest.raises(DevgraphError, match="cannot be re-issued"):
            with graph.task_update(group):
                pass
        graph.replay()  # the graph still works
        dev.synchronize()
        torch.testing.assert_close(y, x * 2)

    def test_update_of_an_op_with_host_arguments_raises(self, dev: Any) -> None:
        x, z = torch.ones(4, device="cuda"), torch.ones(4, device="cuda")
        graph, _ = _capture(dev, lambda: torch.add(x, z, alpha=2), auto_update_ops=["aten::add"])
        assert graph.tasks and graph.tasks[0].host_args == {"alpha": 2}
        with pytest.raises(DevgraphError, match="device tensors"):
            graph.update({"alpha": 3})

    def test_failed_capture_end_leaves_graph_uncaptured(self, dev: Any) -> None:
        graph = dev.graph()
        x = torch.ones(4, device="cuda")
        with pytest.raises(CaptureError, match="previous error during capture"):
            with graph.capture():
                _ = x + 1
                with contextlib.suppress(RuntimeError):
                    torch.cuda.synchronize()  # refused, and the capture is invalidated: capture_end fails
        assert not graph.is_captured()
        with pytest.raises(DevgraphError, match="never captured"):
            graph.replay()
        torch.cuda.empty_cache()  # torch 2.11 asserts here unless the backend cleaned up (#180395)
        again, out = _capture(dev, lambda: x * 3)  # the device is still usable
        again.replay()
        dev.synchronize()
        torch.testing.assert_close(out, x * 3)

    def test_cuda_refusal_inside_capture_is_a_capture_error(self, dev: Any) -> None:
        graph = dev.graph()
        x = torch.ones(4, device="cuda")
        with pytest.raises(CaptureError) as info:
            with graph.capture():
                _ = x + 1
                torch.cuda.synchronize()
        assert "test_cuda_backend.py" in (info.value.source or "")
        assert not graph.is_captured()
        torch.cuda.empty_cache()  # torch 2.11 asserts here unless the backend cleaned up (#180395)
        again, out = _capture(dev, lambda: x * 3)  # the device is still usable
        again.replay()
        dev.synchronize()
        torch.testing.assert_close(out, x * 3)
