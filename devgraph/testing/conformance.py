"""The backend conformance suite: the graph contract, checked against any devgraph device.

Every check is a plain function ``check_x(device)`` that raises ``AssertionError`` on a violation
and is named for the property it checks (README "The graph contract", DESIGN.md items 1-7). Run
them from pytest, one test per check::

    import devgraph, pytest
    from devgraph.testing.conformance import CHECKS, NotApplicable

    @pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
    def test_conformance(check):
        try:
            check(devgraph.device("mybackend"))
        except NotApplicable as why:
            pytest.skip(str(why))

or all at once with ``run(device)`` (the names of the checks that passed; raises on the first
failure) or ``failures(device)`` (``{check name: error}`` of every check that failed).

Every check is proven: ``tests/broken_backends.py`` holds backends that each break one property,
and ``tests/testing/test_conformance_broken.py`` asserts the suite fails each of them with that check.

What a check can and cannot see: the CPU reference backend and the torch_npu simulator run work
synchronously, so stream ordering holds trivially there (see ``check_event_orders_streams``).
Pool membership and weak references are observed through addresses: a tensor allocated during a
capture that overlaps memory an earlier capture used can only sit there because that memory was
freed back to the pool both were captured into (live memory cannot be handed out twice).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import torch

from devgraph._errors import CaptureError, DevgraphError
from devgraph.graph import Device

__all__ = ["CHECKS", "NotApplicable", "failures", "run"]

#: How long a thread waits to see another thread get in where it must not (two captures at once, a
#: replay during a task update). A conforming backend always pays it; a broken one gets in at once.
OVERLAP_WAIT_S = 0.5

_ATTENTION = "devgraph::paged_decode_attention"


class NotApplicable(Exception):
    """A check that does not apply to this device (a test runner reports it as skipped)."""


def _t(device: Device, *shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device.torch_device)


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert torch.allclose(a.float().cpu(), b.float().cpu(), rtol=1e-4, atol=1e-5), f"{what}: replay != eager"


def _capture(device: Device, fn: Callable[[], torch.Tensor], pool=None, **kwargs):
    graph = device.graph()
    fn()  # warm-up outside capture, as runners do (lazy init must not be captured)
    device.synchronize()
    with graph.capture(pool=pool, **kwargs):
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


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The address range ``t``'s elements occupy."""
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def _overlaps(spans: list[tuple[int, int]], span: tuple[int, int]) -> bool:
    return any(lo < span[1] and span[0] < hi for lo, hi in spans)


# -- capture: side stream, pools ---------------------------------------------------------------------


def check_capture_runs_on_capture_stream(device: Device) -> None:
    """Capture runs on a side stream: the one ``device.capture_stream()`` when given none (graphs
    sharing a pool must share it), the given stream otherwise; the previous stream is restored."""
    before = device.current_stream()
    x = _t(device, 4)
    explicit = device.stream()
    seen = []
    for stream in (None, None, explicit):
        with device.graph().capture(stream=stream):
            seen.append(device.current_stream())
            x + 1
        assert device.current_stream() == before, "leaving a capture must restore the previous stream"
    capture_stream = device.capture_stream()
    assert capture_stream == device.capture_stream(), "device.capture_stream() must be one stream per device"
    assert capture_stream != before, "the capture stream must be a side stream, not the current one"
    assert seen[0] == capture_stream and seen[1] == capture_stream, (
        f"captures without a stream ran on {seen[:2]}, not on device.capture_stream() ({capture_stream})"
    )
    assert seen[2] == explicit, f"capture(stream=s) ran on {seen[2]}, not on s ({explicit})"


def check_capture_refuses_default_stream(device: Device) -> None:
    """Capture on the default stream is refused (CUDA refuses it): graphs capture on a side stream.

    Run it with the default stream current (outside any ``with stream:``).
    """
    x = _t(device, 4)
    graph = device.graph()
    try:
        with graph.capture(stream=device.current_stream()):
            x + 1
    except RuntimeError:  # DevgraphError; torch_npu raises its own RuntimeError
        pass
    else:
        raise AssertionError("capture(stream=<the default stream>) must be refused")
    assert not graph.is_captured(), "a refused capture must leave the graph un-captured"


def check_pool_sharing(device: Device) -> None:
    """Two graphs share one pool (largest first) and both replay correctly."""
    big_x, small_x = _t(device, 256, 256), _t(device, 64, 64, seed=1)
    fn = lambda x: torch.relu(x @ x) + x  # noqa: E731
    g_big, out_big = _capture(device, lambda: fn(big_x))
    g_small, out_small = _capture(device, lambda: fn(small_x), pool=g_big.pool())
    assert g_small.pool() is g_big.pool(), "graph.pool() must return the pool it captured into"
    for seed in (2, 3):
        big_x.copy_(_t(device, 256, 256, seed=seed))
        small_x.copy_(_t(device, 64, 64, seed=seed + 10))
        g_big.replay()
        g_small.replay()
        device.synchronize()
        _close(out_big, fn(big_x), "shared pool (big)")
        _close(out_small, fn(small_x), "shared pool (small)")


def _doubled_plus_one(x: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    doubled = x * 2  # an intermediate: dead once the capture ends
    spans.append(_span(doubled))
    out = doubled + 1
    spans.append(_span(out))
    return out


def check_capture_allocates_in_given_pool(device: Device) -> None:
    """``capture(pool=p)`` allocates in ``p``: a smaller graph captured into a larger graph's pool
    reuses the memory the larger one's intermediates freed (where CUDA's allocator puts it too)."""
    big_x, small_x = _t(device, 16384), _t(device, 4096, seed=1)
    big: list[tuple[int, int]] = []
    small: list[tuple[int, int]] = []
    g_big, _out_big = _capture(device, lambda: _doubled_plus_one(big_x, big))
    _capture(device, lambda: _doubled_plus_one(small_x, small), pool=g_big.pool())
    dead_intermediate = big[-2]  # the warm-up ran first; the captured call's spans come last
    assert _overlaps([dead_intermediate], small[-2]), (
        "a graph captured into another graph's pool did not reuse the memory that graph's dead "
        "intermediate left free: capture(pool=...) must allocate in that pool, reusing its free blocks"
    )


def check_graph_holds_outputs_weakly(device: Device) -> None:
    """A graph does not keep its outputs alive: once the caller drops them, the next capture into
    the same pool may reuse their memory (what lets all of a runner's buckets share one pool)."""
    x, y = _t(device, 16384), _t(device, 16384, seed=1)
    first: list[tuple[int, int]] = []
    second: list[tuple[int, int]] = []
    graph, out = _capture(device, lambda: _doubled_plus_one(x, first))
    dropped_output = _span(out)
    del out
    _capture(device, lambda: _doubled_plus_one(y, second), pool=graph.pool())
    assert _overlaps(second[-2:], dropped_output), (
        "the memory of a graph output the caller dropped was not reused by the next capture into the "
        "same pool: the graph keeps its outputs alive; hold them weakly"
    )


# -- replay: same memory ---------------------------------------------------------------------------


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
    """Replay reads the capture-time input tensor: new data is copied in and is what replay sees."""
    x = _t(device, 16)
    graph, out = _capture(device, lambda: x * 3)
    for seed in (9, 10):
        fresh = _t(device, 16, seed=seed)
        x.copy_(fresh)
        graph.replay()
        device.synchronize()
        _close(out, fresh * 3, "input rebinding")


def check_output_memory_reuse(device: Device) -> None:
    """Replay writes into the capture-time output tensor, overwriting the previous result."""
    x = _t(device, 16)
    graph, out = _capture(device, lambda: x + 1)
    ptr = out.data_ptr()
    for value in (1.0, 5.0):
        x.fill_(value)
        graph.replay()
        device.synchronize()
        assert out.data_ptr() == ptr, "output moved"
        _close(out, torch.full_like(out, value + 1), "output reuse")


# -- host arguments and task update ------------------------------------------------------------------


def _attention_inputs(device: Device, lens: list[int], num_blocks: int = 16):
    """Paged-attention inputs every backend's kernel accepts: bfloat16 with 16-token blocks (Ascend's
    fused attention takes no float32 and needs a block size that is a multiple of 16)."""
    dev = device.torch_device
    bf16 = torch.bfloat16
    q = _t(device, 2, 4, 8).to(bf16)
    k, v = (
        _t(device, num_blocks, 16, 2, 8, seed=1).to(bf16),
        _t(device, num_blocks, 16, 2, 8, seed=2).to(bf16),
    )
    table = torch.arange(1, 7, dtype=torch.int32).view(2, 3).to(dev)
    seq = torch.tensor(lens, dtype=torch.int32, device=dev)
    return q, k, v, table, seq


def _needs_updatable_attention(device: Device) -> None:
    if _ATTENTION not in device.updatable_ops:
        raise NotApplicable(f"{device} declares no updatable ops")


def check_host_args_frozen(device: Device) -> None:
    """Host (Python) arguments are frozen at capture: changing a list the caller passed, after
    capture, does not change what replay computes -- through an op, or through
    ``graph.call_opaque`` (only a task update changes host arguments; contract point 3)."""
    x = _t(device, 2, 4)
    dims, scale = [1], [2.0]
    graph = device.graph()
    with graph.capture():
        summed = torch.sum(x, dim=dims)
        scaled = graph.call_opaque(lambda t, s: t * s[0], x, scale, name="scale")
    dims[:], scale[:] = [0], [5.0]  # the caller reuses its lists
    x.copy_(_t(device, 2, 4, seed=4))
    graph.replay()
    device.synchronize()
    _close(summed, x.sum(dim=1), "op with a host list changed after capture (must stay frozen)")
    _close(scaled, x * 2.0, "call_opaque with a host list changed after capture (must stay frozen)")


def check_task_update(device: Device) -> None:
    """Host arguments given at replay reach the updatable attention task (contract point 3).

    Raises ``NotApplicable`` on a device that declares no ``updatable_ops``.
    """
    import devgraph.ops as ops

    _needs_updatable_attention(device)
    q, k, v, table, lens = _attention_inputs(device, [5, 9])
    ops.paged_decode_attention(q, k, v, table, lens, [5, 9])  # warm-up
    graph = device.graph()
    with graph.capture(auto_update_ops=[_ATTENTION]):
        out = ops.paged_decode_attention(q, k, v, table, lens, [5, 9])
    assert [t.op for t in graph.tasks] == [_ATTENTION], f"expected one updatable task, got {graph.tasks}"
    for new in ([3, 11], [12, 1]):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay(host_args={"seq_lens_host": new})
        device.synchronize()
        _close(out, ops.paged_decode_attention(q, k, v, table, lens, new), "task update")


def check_tasks_hold_arguments_weakly(device: Device) -> None:
    """An updatable task does not keep its tensor arguments alive: an intermediate it read is free
    for the next capture into the pool once the capture ends (contract point 6)."""
    import devgraph.ops as ops

    _needs_updatable_attention(device)
    q, k, v, table, seq = _attention_inputs(device, [5, 9], num_blocks=512)
    first: list[tuple[int, int]] = []
    second: list[tuple[int, int]] = []

    def step(spans):
        keys = k * 1.0  # an intermediate only the task reads: the largest allocation of the step
        spans.append(_span(keys))
        return ops.paged_decode_attention(q, keys, v, table, seq, [5, 9])

    graph, _ = _capture(device, lambda: step(first), auto_update_ops=[_ATTENTION])
    assert graph.tasks, "the attention call was not captured as an updatable task"
    _capture(device, lambda: step(second), pool=graph.pool(), auto_update_ops=[_ATTENTION])
    assert _overlaps([first[-1]], second[-1]), (
        "the memory of a tensor only an updatable task referenced was not reused by the next capture "
        "into the same pool: the task keeps its arguments alive; hold them weakly"
    )


# -- host syncs, lifecycle ---------------------------------------------------------------------------


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


def check_reset_pool_not_captured_into(device: Device) -> None:
    """A pool whose graphs were all reset is refused for new captures (CUDA's allocator asserts on
    it; mint a fresh one with ``device.pool()``); while one graph holds a pool, others may join it."""
    x = _t(device, 16)
    first, _ = _capture(device, lambda: x + 1)
    pool = first.pool()
    second, _ = _capture(device, lambda: x * 2, pool=pool)
    second.reset()
    third, _ = _capture(device, lambda: x * 3, pool=pool)  # `first` still holds the pool
    third.reset()
    first.reset()
    try:
        _capture(device, lambda: x - 1, pool=pool)
    except DevgraphError as err:
        assert "device.pool()" in str(err), f"the error must say to mint a fresh pool: {err}"
    else:
        raise AssertionError(
            "capturing into a pool whose graphs were all reset must raise DevgraphError (CUDA's "
            "allocator asserts on it)"
        )
    graph, out = _capture(device, lambda: x - 1, pool=device.pool())
    graph.replay()
    device.synchronize()
    _close(out, x - 1, "capture into a fresh pool")


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


# -- threads and streams -----------------------------------------------------------------------------


def check_captures_serialised_per_device(device: Device) -> None:
    """Two threads capturing on one device take turns: the second capture's block starts only once
    the first capture has ended (captures share the capture stream; contract point 6)."""
    x = _t(device, 8)
    first_inside, second_inside = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def second() -> None:
        try:
            first_inside.wait(30)
            with device.graph().capture():
                second_inside.set()
                x + 1
        except BaseException as exc:  # reported below, on the checking thread
            errors.append(exc)

    thread = threading.Thread(target=second, name="devgraph-conformance-capture")
    thread.start()
    try:
        with device.graph().capture():
            x * 2
            first_inside.set()
            overlapped = second_inside.wait(OVERLAP_WAIT_S)
    finally:
        first_inside.set()
        thread.join(60)
    _check_took_turns(
        errors,
        overlapped,
        second_inside,
        failed="the second thread's capture failed",
        overlap="a second thread entered a capture on this device while the first was still capturing: "
        "captures must be serialised per device (Device.capture_lock)",
        never="the second thread never captured",
    )


def check_update_and_replay_serialised(device: Device) -> None:
    """update and replay of one graph take turns (the per-graph lock): a replay from another thread
    waits while a task update of that graph is open.

    Raises ``NotApplicable`` where explicit task groups cannot be re-issued (CUDA).
    """
    x = _t(device, 8)
    out = torch.zeros(8, device=device.torch_device)
    graph = device.graph()
    with graph.capture():
        with graph.task_group() as group:
            torch.mul(x, 2, out=out)
    replay_started, replayed = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def replay() -> None:
        try:
            replay_started.set()
            graph.replay()
            replayed.set()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=replay, name="devgraph-conformance-replay")
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(graph.task_update(group))
        except DevgraphError as why:
            raise NotApplicable(f"{device} cannot re-issue explicit task groups: {why}") from why
        torch.mul(x, 3, out=out)  # re-issue the captured call
        thread.start()
        replay_started.wait(30)
        overlapped = replayed.wait(OVERLAP_WAIT_S)
    thread.join(60)
    _check_took_turns(
        errors,
        overlapped,
        replayed,
        failed="the replaying thread failed",
        overlap="a replay from another thread ran while a task update of the same graph was open: "
        "update() and replay() must be serialised by the graph's lock",
        never="the replaying thread never replayed",
    )


def _check_took_turns(
    errors: list[BaseException],
    overlapped: bool,
    done: threading.Event,
    *,
    failed: str,
    overlap: str,
    never: str,
) -> None:
    """The verdict of a two-thread check: the other thread raised nothing (``failed``), did not run
    while this one held the lock (``overlap``), and did run once it was released (``never``)."""
    assert not errors, f"{failed}: {errors[0]!r}"
    assert not overlapped, overlap
    assert done.is_set(), never


def _stream_work_size(device: Device) -> int:
    # Host-memory backends run synchronously: a small matrix will do. On a real device the producer
    # must still be running when the consumer is queued: a 4096^2 matmul takes milliseconds.
    return 64 if device.torch_device.type == "cpu" else 4096


def check_event_orders_streams(device: Device) -> None:
    """Work ordered by an event across two streams sees the producer's result; events time.

    On a backend whose tensors live on the host (the CPU reference, the torch_npu simulator) work
    is synchronous, so the order holds whatever a wait does: this check cannot tell a wait from a
    no-op there. On a real device the producer queues enough work (a large matmul) that a consumer
    that did not wait would read the buffer while it still holds zeros; ``tests/broken_backends.py``
    proves it on a CPU backend whose streams write late (``DeferredWrites`` vs ``WaitIgnored``).
    """
    n = _stream_work_size(device)
    producer, consumer = device.stream(), device.stream()
    start, end = device.event(enable_timing=True), device.event(enable_timing=True)
    x = _t(device, n, n) / n**0.25  # entries of x @ x are of order 1
    y = torch.zeros(n, n, device=device.torch_device)
    producer.wait_stream(device.current_stream())  # x and y were written on the current stream
    with producer:
        start.record()
        y.copy_(x @ x)
        done = producer.record_event()
    consumer.wait_event(done)
    with consumer:
        z = y + 1
        end.record()
    end.synchronize()
    device.synchronize()
    _close(z, y + 1, "a stream waiting on an event read the producer's buffer before it was written")
    assert end.query() and start.elapsed_time(end) >= 0.0
    assert device.current_stream() is not producer, "leaving `with stream:` must restore the previous stream"


def check_wait_stream_orders_streams(device: Device) -> None:
    """``stream.wait_stream(other)`` orders the stream's later work after ``other``'s queued work
    (the same caveat as ``check_event_orders_streams`` on synchronous backends)."""
    n = _stream_work_size(device)
    producer, consumer = device.stream(), device.stream()
    x = _t(device, n, n) / n**0.25
    y = torch.zeros(n, n, device=device.torch_device)
    producer.wait_stream(device.current_stream())
    with producer:
        y.copy_(x @ x)
    consumer.wait_stream(producer)
    with consumer:
        z = y + 1
    device.synchronize()
    _close(z, y + 1, "a stream that waited on another read its buffer before it was written")


CHECKS: list[Callable[[Device], None]] = [
    check_capture_runs_on_capture_stream,
    check_capture_refuses_default_stream,
    check_elementwise,
    check_matmul,
    check_inplace_cache_update,
    check_view_chain,
    check_input_rebinding_by_copy,
    check_output_memory_reuse,
    check_pool_sharing,
    check_capture_allocates_in_given_pool,
    check_graph_holds_outputs_weakly,
    check_host_args_frozen,
    check_task_update,
    check_tasks_hold_arguments_weakly,
    check_capture_error_on_host_sync,
    check_reset_and_recapture,
    check_reset_pool_not_captured_into,
    check_replay_without_capture,
    check_weak_ref,
    check_captures_serialised_per_device,
    check_update_and_replay_serialised,
    check_event_orders_streams,
    check_wait_stream_orders_streams,
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


def failures(device: Device) -> dict[str, BaseException]:
    """Run every check against ``device``; return ``{check name: error}`` for those that failed."""
    failed: dict[str, BaseException] = {}
    for check in CHECKS:
        try:
            check(device)
        except NotApplicable:
            continue
        except Exception as exc:  # a check fails with AssertionError; anything else is reported too
            failed[check.__name__] = exc
    return failed
