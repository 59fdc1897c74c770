"""The backend conformance suite: the graph contract, checked against any devgraph device.

Every check is a plain function ``check_x(device)`` that raises ``AssertionError`` on a violation.
Run them from pytest, one test per check::

    import devgraph, pytest
    from devgraph.testing.conformance import CHECKS

    @pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
    def test_conformance(check):
        try:
            check(devgraph.device("mybackend"))
        except NotApplicable as why:
            pytest.skip(str(why))

or all at once with ``run(device)``, which returns the names of the checks that passed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from devgraph._contract import Device
from devgraph._errors import CaptureError, DevgraphError

__all__ = ["CHECKS", "NotApplicable", "run"]


def _t(device: Device, *shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device.torch_device)


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert torch.allclose(a.float().cpu(), b.float().cpu(), rtol=1e-4, atol=1e-5), f"{what}: replay != eager"


def _capture(device: Device, fn: Callable[[], torch.Tensor], pool=None):
    graph = device.graph()
    fn()  # warm-up outside capture, as runners do (lazy init must not be captured)
    device.synchronize()
    with graph.capture(pool=pool):
        out = fn()
    device.synchronize()
    return graph, out


def _replay_matches(device: Device, fn, inputs: list[torch.Tensor], what: str) -> None:
    graph, out = _capture(device, lambda: fn(*inputs))
    for seed in (1, 2):
        for x in inputs:
            x.copy_(_t(device, *x.shape, seed=seed))
        graph.replay()
        device.synchronize()
        _close(out, fn(*inputs), what)


def check_elementwise(device: Device) -> None:
    """Replay of an elementwise chain equals eager."""
    _replay_matches(
        device,
        lambda x, y: torch.sigmoid(x * 2 + y).exp() - y.abs(),
        [_t(device, 64), _t(device, 64)],
        "elementwise",
    )


def check_matmul(device: Device) -> None:
    """Replay of matmul + bias + activation equals eager."""
    w = _t(device, 32, 16, seed=5)
    _replay_matches(device, lambda x: torch.nn.functional.gelu(x @ w + 1.0), [_t(device, 8, 32)], "matmul")


def check_inplace_cache_update(device: Device) -> None:
    """In-place writes into a cache tensor (index_copy_) happen again at every replay."""
    cache = torch.zeros(16, 4, device=device.torch_device)
    slots = torch.tensor([3, 7], device=device.torch_device)
    x = _t(device, 2, 4)
    graph, _ = _capture(device, lambda: cache.index_copy_(0, slots, x * 2))
    cache.zero_()
    slots.copy_(torch.tensor([1, 9], device=device.torch_device))
    x.copy_(_t(device, 2, 4, seed=3))
    graph.replay()
    device.synchronize()
    expected = torch.zeros(16, 4, device=device.torch_device)
    expected[1], expected[9] = x[0] * 2, x[1] * 2
    _close(cache, expected, "in-place cache update")


def check_view_chain(device: Device) -> None:
    """Views (view, transpose, slice, select) of inputs and intermediates replay correctly."""

    def fn(x):
        y = (x + 1).view(4, 8).t()[1:5].contiguous()
        return y.select(1, 2) * x.view(32)[:4]

    _replay_matches(device, fn, [_t(device, 32)], "view chain")


def check_input_rebinding_by_copy(device: Device) -> None:
    """Replay reads the capture-time input tensor: new data is copied in; a new tensor is ignored."""
    x = _t(device, 16)
    graph, out = _capture(device, lambda: x * 3)
    fresh = _t(device, 16, seed=9)
    x.copy_(fresh)
    graph.replay()
    device.synchronize()
    _close(out, fresh * 3, "input rebinding")


def check_output_memory_reuse(device: Device) -> None:
    """Replay writes into the capture-time output tensor, overwriting the previous result."""
    x = _t(device, 16)
    graph, out = _capture(device, lambda: x + 1)
    ptr = out.data_ptr()
    x.fill_(1.0)
    graph.replay()
    x.fill_(5.0)
    graph.replay()
    device.synchronize()
    assert out.data_ptr() == ptr, "output moved"
    _close(out, torch.full_like(out, 6.0), "output reuse")


def check_pool_sharing(device: Device) -> None:
    """Two graphs share one pool (largest first); both replay correctly; the smaller reuses memory."""
    big_x, small_x = _t(device, 256, 256), _t(device, 64, 64, seed=1)
    fn = lambda x: torch.relu(x @ x) + x  # noqa: E731
    before = device.memory_stats().reserved
    g_big, out_big = _capture(device, lambda: fn(big_x))
    after_big = device.memory_stats().reserved
    g_small, out_small = _capture(device, lambda: fn(small_x), pool=g_big.pool())
    after_small = device.memory_stats().reserved
    assert g_small.pool() is g_big.pool(), "graph.pool() must return the pool it captured into"
    g_big.replay()
    g_small.replay()
    device.synchronize()
    _close(out_big, fn(big_x), "shared pool (big)")
    _close(out_small, fn(small_x), "shared pool (small)")
    grew_big, grew_small = after_big - before, after_small - after_big
    assert grew_small <= max(grew_big, 0), (
        f"capturing the smaller graph into the shared pool reserved {grew_small} more bytes, "
        f"more than the larger graph's {grew_big}"
    )


def check_stream_event_ordering(device: Device) -> None:
    """Work ordered by an event across two streams sees the producer's result; events time."""
    producer, consumer = device.stream(), device.stream()
    start, end = device.event(enable_timing=True), device.event(enable_timing=True)
    x = _t(device, 1024)
    with producer:
        start.record()
        y = x * 2
        done = producer.record_event()
    consumer.wait_event(done)
    with consumer:
        z = y + 1
        end.record()
    end.synchronize()
    device.synchronize()
    _close(z, x * 2 + 1, "stream ordering")
    assert end.query() and start.elapsed_time(end) >= 0.0
    assert device.current_stream() is not producer, "leaving `with stream:` must restore the previous stream"


def check_capture_error_on_host_sync(device: Device) -> None:
    """.item(), .tolist(), .cpu() and data-dependent shapes inside capture raise CaptureError."""
    x = _t(device, 8)
    for name, fn in [
        ("item", lambda: x.sum().item()),
        ("tolist", lambda: x.tolist()),
        ("cpu", lambda: x.cpu()),
        ("nonzero", lambda: torch.nonzero(x > 0)),
    ]:
        graph = device.graph()
        try:
            with graph.capture():
                fn()
        except CaptureError as err:
            assert err.op and err.source and err.remedy, f"{name}: CaptureError must name op, line, remedy"
            assert __file__.rstrip("c") in err.source or "conformance" in err.source, err.source
        else:
            raise AssertionError(f"{name} inside capture did not raise CaptureError")
        assert not graph.is_captured(), f"{name}: a failed capture must leave the graph un-captured"


def check_reset_and_recapture(device: Device) -> None:
    """reset() drops the captured work; the graph can be captured again with other work."""
    x = _t(device, 16)
    graph, _ = _capture(device, lambda: x + 1)
    try:
        with graph.capture():
            pass
    except DevgraphError:
        pass
    else:
        raise AssertionError("capturing an already captured graph must raise until reset()")
    graph.reset()
    with graph.capture():
        out = x * 10
    graph.replay()
    device.synchronize()
    _close(out, x * 10, "re-capture")


def check_replay_without_capture(device: Device) -> None:
    """replay() of a graph that was never captured raises DevgraphError."""
    try:
        device.graph().replay()
    except DevgraphError as err:
        assert "never captured" in str(err)
    else:
        raise AssertionError("replay() of a never-captured graph must raise")


def check_weak_ref(device: Device) -> None:
    """weak_ref() gives a tensor over the same memory with the same values."""
    x = _t(device, 8)
    w = device.weak_ref(x)
    assert w.data_ptr() == x.data_ptr() and w.shape == x.shape
    x.add_(1)
    _close(w, x, "weak ref")


def check_task_update(device: Device) -> None:
    """Host arguments given at replay reach the updatable attention task (contract point 3).

    Raises ``NotApplicable`` on a device that declares no ``updatable_ops``.
    """
    import devgraph.ops as ops

    op = "devgraph::paged_decode_attention"
    if op not in device.updatable_ops:
        raise NotApplicable(f"{device} declares no updatable ops")
    dev = device.torch_device
    q, k, v = _t(device, 2, 4, 8), _t(device, 16, 4, 2, 8, seed=1), _t(device, 16, 4, 2, 8, seed=2)
    table = torch.arange(1, 7, dtype=torch.int32).view(2, 3).to(dev)
    lens = torch.tensor([5, 9], dtype=torch.int32, device=dev)
    ops.paged_decode_attention(q, k, v, table, lens, [5, 9])  # warm-up
    graph = device.graph()
    with graph.capture(auto_update_ops=[op]):
        out = ops.paged_decode_attention(q, k, v, table, lens, [5, 9])
    assert [t.op for t in graph.tasks] == [op], f"expected one updatable task, got {graph.tasks}"
    for new in ([3, 11], [12, 1]):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay(host_args={"seq_lens_host": new})
        device.synchronize()
        _close(out, ops.paged_decode_attention(q, k, v, table, lens, new), "task update")


class NotApplicable(Exception):
    """A check that does not apply to this device (a test runner reports it as skipped)."""


CHECKS: list[Callable[[Device], None]] = [
    check_elementwise,
    check_matmul,
    check_inplace_cache_update,
    check_view_chain,
    check_input_rebinding_by_copy,
    check_output_memory_reuse,
    check_pool_sharing,
    check_stream_event_ordering,
    check_capture_error_on_host_sync,
    check_reset_and_recapture,
    check_replay_without_capture,
    check_weak_ref,
    check_task_update,
]


def run(device: Device) -> list[str]:
    """Run every check against ``device``; return the names of those that passed (raise on the
    first failure; checks that do not apply are left out)."""
    passed = []
    for check in CHECKS:
        try:
            check(device)
        except NotApplicable:
            continue
        passed.append(check.__name__)
    return passed
