"""GraphRunner / devgraph.wrap on simple modules (the decoder tests live in test_decoder_runner.py)."""

from __future__ import annotations

import logging
import threading
import warnings

import pytest
import torch

import devgraph
from devgraph import CaptureError, DevgraphError


class Cached(torch.nn.Module):
    """A linear layer that also writes its output row into a state cache at ``slot`` (slot 0 = scratch)."""

    def __init__(self, slots: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("cache", torch.zeros(slots, 8))

    def forward(self, x, slot):
        y = torch.tanh(self.lin(x))
        self.cache.index_copy_(0, slot, y)
        return y, y.sum(-1)


def _wrap(dev, **kw):
    model = Cached().to(dev.torch_device)
    reference = Cached().to(dev.torch_device)
    kw.setdefault("batch_sizes", [1, 2, 4, 8])
    kw.setdefault("pad_values", {"slot": 0})
    return _untraced_ok(devgraph.wrap, model, device=dev, **kw), model, reference


def _runners(graphed):
    """The wrapper's runners: the raw path's one, or one per graph Dynamo handed over."""
    return graphed.graphs.runners if isinstance(graphed, devgraph.frontend.TracedModule) else [graphed.runner]


def _raw(model, **options):
    """``devgraph.wrap(model, frontend="raw", ...)``: the test's subject is the raw path's own mechanism."""
    return _untraced_ok(devgraph.wrap, model, frontend="raw", **options)


def _untraced_ok(fn, *args, **kwargs):
    """Call ``fn`` with the raw path's one warning (what it leaves unchecked) expected, not counted."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*captures the forward as it runs, untraced")
        return fn(*args, **kwargs)


#: Through Dynamo, a second call of the same size above the largest bucket traces again (a second
#: graph, whose runner warns batch_too_large again; the retrace emits torch's own non-leaf .grad warning).
def _inputs(dev, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g).to(dev.torch_device)
    slot = (torch.randperm(31, generator=g)[:n] + 1).to(dev.torch_device)
    return x, slot


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8])
def test_graphed_equals_eager_for_buckets_and_padded_sizes(any_device, n):
    graphed, _model, reference = _wrap(any_device)
    x, slot = _inputs(any_device, n, seed=n)
    y, s = graphed(x, slot)
    ry, rs = reference(x, slot)
    assert y.shape == (n, 8) and s.shape == (n,)
    torch.testing.assert_close(y, ry)
    torch.testing.assert_close(s, rs)
    assert graphed.stats.replays == 1 and graphed.stats.eager_calls == 0


def test_padded_rows_never_touch_real_state(any_device):
    graphed, model, reference = _wrap(any_device)
    x, slot = _inputs(any_device, 3)
    graphed(x, slot)
    reference(x, slot)
    torch.testing.assert_close(model.cache[1:], reference.cache[1:])


def test_batch_above_largest_bucket_falls_back_to_eager(any_device):
    graphed, _model, reference = _wrap(any_device)
    x, slot = _inputs(any_device, 12)
    with pytest.warns(UserWarning, match=r"batch_too_large.*batch 12"):
        y, _ = graphed(x, slot)
    torch.testing.assert_close(y, reference(x, slot)[0])
    assert graphed.stats.fallbacks == {"batch_too_large": 1}


@pytest.mark.parametrize("frontend", ["raw", "dynamo"])
def test_fallback_warns_once_per_reason(any_device, frontend):
    graphed, _, _ = _wrap(any_device, frontend=frontend)
    x, slot = _inputs(any_device, 10)
    # Without grad: in grad mode the eager fallback makes the cache buffer require grad (as eager does),
    # and Dynamo rightly traces again for it (torch then warns about the buffer's .grad).
    with pytest.warns(UserWarning), torch.no_grad():
        graphed(x, slot)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error")
        graphed(x, slot)
    assert graphed.stats.fallbacks["batch_too_large"] == 2


def test_strict_raises_instead_of_falling_back(any_device):
    graphed, _, _ = _wrap(any_device, strict=True)
    graphed(*_inputs(any_device, 2))
    with pytest.raises(DevgraphError, match=r"strict=True.*batch 9"):
        graphed(*_inputs(any_device, 9))


def test_different_non_tensor_argument_falls_back():
    class Scaled(torch.nn.Module):
        def forward(self, x, scale: float = 1.0):
            return x * scale

    graphed = _raw(Scaled(), device="cpu", batch_sizes=[4])
    x = torch.randn(3, 2)
    torch.testing.assert_close(graphed(x), x)
    torch.testing.assert_close(graphed(x, scale=1.0), x)
    with pytest.warns(UserWarning, match=r"signature_mismatch.*'scale'"):
        torch.testing.assert_close(graphed(x, scale=3.0), x * 3)
    # Through Dynamo the other constant is another trace and graph: served, equal to eager
    traced = devgraph.wrap(Scaled(), device="cpu", batch_sizes=[4])
    for scale in (1.0, 1.0, 3.0):
        torch.testing.assert_close(traced(x, scale=scale), x * scale)
    assert traced.stats.fallbacks == {} and traced.stats.replays == 3


def test_changed_feature_shape_falls_back():
    graphed = _raw(torch.nn.Identity(), device="cpu", batch_sizes=[4])
    graphed(torch.randn(2, 3))
    with pytest.warns(UserWarning, match="signature_mismatch"):
        graphed(torch.randn(2, 5))
    traced = devgraph.wrap(torch.nn.Identity(), device="cpu", batch_sizes=[4])  # Dynamo: another trace
    for cols in (3, 5):
        x = torch.randn(2, cols)
        torch.testing.assert_close(traced(x), x)


def test_tensors_inside_containers_fall_back():
    class Pair(torch.nn.Module):
        def forward(self, pair):
            return pair[0] + pair[1]

    graphed = _raw(Pair(), device="cpu", batch_sizes=[2])
    with pytest.warns(UserWarning, match=r"unsupported_call.*'pair' holds tensors"):
        graphed((torch.ones(2), torch.ones(2)))
    traced = devgraph.wrap(Pair(), device="cpu", batch_sizes=[2])  # Dynamo reads inside the tuple
    torch.testing.assert_close(traced((torch.ones(2), torch.ones(2))), torch.full((2,), 2.0))


def test_outputs_are_overwritten_by_the_next_call_unless_cloned(any_device):
    graphed, _, _ = _wrap(any_device)
    first, _ = graphed(*_inputs(any_device, 2, seed=1))
    kept = first.clone()
    graphed(*_inputs(any_device, 2, seed=2))
    assert not torch.equal(first, kept)
    cloned, _, _ = _wrap(any_device, clone_outputs=True)
    first, _ = cloned(*_inputs(any_device, 2, seed=1))
    kept = first.clone()
    cloned(*_inputs(any_device, 2, seed=2))
    assert torch.equal(first, kept)


def test_explicit_capture_from_example_inputs(any_device):
    graphed, _, _ = _wrap(any_device, frontend="raw")
    graphed.capture(*_inputs(any_device, 1))
    assert graphed.runner.captured
    assert graphed.stats.captured_sizes == (1, 2, 4, 8)
    assert graphed.stats.capture_seconds > 0


def test_capture_logs_one_summary_line(any_device, caplog):
    # raw: capture() from a 1-row example captures every bucket (Dynamo keeps a 1-row call's trace
    # to 1 row, so its graph captures that size alone)
    graphed, _, _ = _wrap(any_device, frontend="raw")
    with caplog.at_level(logging.INFO, logger="devgraph"):
        graphed.capture(*_inputs(any_device, 1))
    lines = [r.getMessage() for r in caplog.records if "captured" in r.getMessage()]
    assert len(lines) == 1 and "batch sizes 1, 2, 4, 8" in lines[0] and "MiB" in lines[0]


def test_pool_bytes_are_counted_on_the_reference_backend():
    graphed, _, _ = _wrap(devgraph.device("cpu"))
    graphed.capture(*_inputs(devgraph.device("cpu"), 1))
    assert graphed.stats.pool_bytes > 0


def test_capture_error_names_batch_size_and_remedy():
    class Syncs(torch.nn.Module):
        def forward(self, x):
            if x.sum() > 0:  # a host sync: data-dependent Python control flow
                return x
            return -x

    graphed = _raw(Syncs(), device="cpu", batch_sizes=[1, 4])
    with pytest.raises(CaptureError) as info:
        graphed(torch.ones(2, 2))
    # Dynamo breaks the graph at the sync and runs the branch as Python: eager's result
    traced = devgraph.wrap(Syncs(), device="cpu", batch_sizes=[1, 4])
    for x in (torch.ones(2, 2), -torch.ones(2, 2)):
        torch.testing.assert_close(traced(x), x if x.sum() > 0 else -x)
    err = info.value
    assert err.batch_size == 4  # the largest is captured first
    assert "test_runner.py" in err.source and "x.sum() > 0" in err.source
    assert "max_batch_size" in err.remedy and "Tensor.__bool__" == err.op


def test_debug_names_a_moved_parameter(any_device):
    # raw: its debug check names the parameter (Dynamo's graphs take it as an input and capture
    # again: tests/test_wrap_promise.py::test_param_data_replaced_is_captured_again_through_dynamo)
    graphed, model, _ = _wrap(any_device, debug=True, frontend="raw")
    graphed(*_inputs(any_device, 2))
    model.lin.weight.data = model.lin.weight.data.clone()
    with pytest.raises(DevgraphError, match=r"parameter 'lin.weight'.*capture address.*capture\(\) again"):
        graphed(*_inputs(any_device, 2))


def test_debug_from_environment(monkeypatch):
    monkeypatch.setenv("DEVGRAPH_DEBUG", "1")
    assert _raw(torch.nn.Identity(), device="cpu").runner.config.debug
    assert devgraph.wrap(torch.nn.Identity(), device="cpu").graphs.config.debug  # Dynamo's graphs too


def test_unknown_option_lists_valid_ones():
    with pytest.raises(DevgraphError, match=r"unknown option\(s\) \['max_batch'\].*max_batch_size"):
        devgraph.wrap(torch.nn.Identity(), device="cpu", max_batch=4)


def test_host_args_without_an_updatable_op_is_a_clear_error():
    class NoOp(torch.nn.Module):
        def forward(self, x, lens):
            return x + 1

    graphed = _raw(NoOp(), device="cpu", batch_sizes=[2], host_args=["lens"])  # raw only
    with pytest.raises(DevgraphError, match="no updatable task in the captured graph takes 'lens'"):
        graphed(torch.ones(2, 2), [1, 2])


def test_concurrent_calls_are_serialised(any_device):
    graphed, _, reference = _wrap(any_device, clone_outputs=True)
    graphed.capture(*_inputs(any_device, 1))
    errors = []

    def worker(seed):
        for i in range(5):
            x, slot = _inputs(any_device, 1 + (seed + i) % 8, seed=seed * 10 + i)
            y, _ = graphed(x, slot)
            expected = torch.tanh(reference.lin(x))
            if not torch.allclose(y, expected, atol=1e-5):
                errors.append((seed, i))

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_batch_dim_other_than_zero_cuts_outputs_on_that_dim():
    class SeqFirst(torch.nn.Module):
        def forward(self, x):  # x: [seq, batch, hidden]
            return x * 2

    graphed = devgraph.wrap(SeqFirst(), device="cpu", batch_sizes=[1, 4], batch_dims={"x": 1})
    x = torch.randn(3, 2, 5)
    out = graphed(x)
    assert out.shape == (3, 2, 5)
    torch.testing.assert_close(out, x * 2)


def test_unbatched_outputs_are_returned_whole():
    table = torch.randn(4, 3)

    class WithTable(torch.nn.Module):
        def forward(self, x):
            return x + 1, table * 1  # the second output does not grow with the batch

    graphed = devgraph.wrap(WithTable(), device="cpu", batch_sizes=[2, 4])
    y, t = graphed(torch.randn(2, 3))
    assert y.shape == (2, 3) and t.shape == (4, 3)


def test_a_failed_bucket_capture_leaves_nothing_half_captured():
    class SyncsWhenSmall(torch.nn.Module):
        def forward(self, x):
            if x.shape[0] == 1:  # shape-dependent Python is fine; the sync below is not
                return x * x.sum().item()
            return x * 2

    graphed = _raw(SyncsWhenSmall(), device="cpu", batch_sizes=[1, 4])
    with pytest.raises(CaptureError) as info:
        graphed(torch.ones(3, 2))
    assert info.value.batch_size == 1
    assert not graphed.runner.captured
    with pytest.raises(CaptureError):  # tried again, fails the same way, never a KeyError
        graphed(torch.ones(1, 2))


@pytest.mark.parametrize("frontend", ["raw", "dynamo"])
def test_a_call_of_zero_rows_falls_back_as_an_empty_batch_without_capturing(frontend):
    graphed, _, _ = _wrap(devgraph.device("cpu"), frontend=frontend)
    x, slot = _inputs(devgraph.device("cpu"), 0)
    with pytest.warns(UserWarning, match="empty_batch"):
        y, _ = graphed(x, slot)
    assert y.shape == (0, 8) and not any(getattr(r, "captured", False) for r in _runners(graphed))
    assert graphed.stats.fallbacks == {"empty_batch": 1}


def test_note_fallback_counts_warns_once_and_raises_when_strict():
    graphed, _, _ = _wrap(devgraph.device("cpu"), frontend="raw")  # the raw path's runner
    runner = graphed.runner
    with pytest.warns(UserWarning, match=r"running eagerly \(too_long\): 40 tokens"):
        runner.note_fallback("too_long", "40 tokens")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        runner.note_fallback("too_long", "41 tokens")
    assert runner.stats.fallbacks == {"too_long": 2} and runner.stats.eager_calls == 2
    strict, _, _ = _wrap(devgraph.device("cpu"), strict=True, frontend="raw")
    with pytest.raises(DevgraphError, match=r"strict=True.*40 tokens"):
        strict.runner.note_fallback("too_long", "40 tokens")


def test_rollback_clears_capture_stats():
    class SyncsWhenSmall(torch.nn.Module):
        def forward(self, x):
            return x * x.sum().item() if x.shape[0] == 1 else x * 2

    graphed = _raw(SyncsWhenSmall(), device="cpu", batch_sizes=[1, 4])
    with pytest.raises(CaptureError):
        graphed(torch.ones(3, 2))
    assert graphed.stats.captured_sizes == () and graphed.stats.pool_bytes == 0


def test_captures_from_two_threads_keep_each_threads_stream():
    dev = devgraph.device("cpu")
    seen, errors = {}, []
    barrier = threading.Barrier(2)

    def work(name):
        try:
            barrier.wait()
            for _ in range(20):
                graph, x = dev.graph(), torch.ones(4)
                with graph.capture():
                    y = x + 1
                graph.replay()
                assert torch.equal(y, x + 1)
            seen[name] = dev.current_stream()
        except Exception as exc:  # collected: pytest does not see thread exceptions
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert seen["a"] is seen["b"] is dev.current_stream()  # every thread is back on the default stream
