"""The CPU reference backend is never silently wrong: replay equals eager on new inputs, or capture refuses.

Every recording path is checked under ``no_grad``, ``inference_mode`` and grad mode: composite ops
reach the recorder whole under ``inference_mode`` only, so a path that works in one mode proves
nothing about the others.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import devgraph
from devgraph import ops

GRAD_MODES = {
    "no_grad": torch.no_grad,
    "inference_mode": torch.inference_mode,
    "grad": torch.enable_grad,
}


@pytest.fixture(params=list(GRAD_MODES))
def grad_mode(request):
    return GRAD_MODES[request.param]


def _replay_matches_eager(fn, inputs, mode, refill=None, eager=None):
    """Capture ``fn(*inputs)`` under ``mode``, refill the inputs, replay, compare with eager
    (``eager(*inputs)``, ``fn`` itself by default)."""
    graph = devgraph.device("cpu").graph()
    with mode():
        with graph.capture():
            out = fn(*inputs)
    g = torch.Generator().manual_seed(1)
    for t in inputs:
        new = refill(t) if refill else torch.randn(t.shape, generator=g).to(t.dtype)
        t.copy_(new)
    fresh = [t.clone() for t in inputs]  # before replay: fn may write its inputs
    graph.replay()
    with mode():
        expected = (eager or fn)(*fresh)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(inputs, fresh)  # and writes them as eager does
    return graph


# Composite ops that return an alias when they can and a copy when they must. Under inference_mode
# they reach the recorder whole; the copies must be recorded.
MAY_ALIAS = {
    "to_dtype": lambda x: x.to(torch.float64) * 2,
    "to_same_dtype": lambda x: x.to(torch.float32) * 2,
    "long": lambda x: (x * 10).long() + 1,
    "half": lambda x: x.half().float() + 1,
    "reshape_of_transpose": lambda x: x.t().reshape(-1) + 1,
    "reshape_of_contiguous": lambda x: x.reshape(-1) + 1,
    "contiguous_of_transpose": lambda x: x.t().contiguous() + 1,
    "flatten_of_transpose": lambda x: x.t().flatten() + 1,
    "type_as": lambda x: x.type_as(torch.zeros((), dtype=torch.float64)) + 1,
    "to_returned_directly": lambda x: x.t().to(torch.float64),
    "contiguous_returned_directly": lambda x: x.t().contiguous(),
}


@pytest.mark.parametrize("op", list(MAY_ALIAS))
def test_ops_that_may_copy_replay_the_copy_under_every_grad_mode(op, grad_mode):
    _replay_matches_eager(MAY_ALIAS[op], [torch.randn(4, 3)], grad_mode)


def test_inference_mode_records_the_copy_a_composite_makes():
    graph = _replay_matches_eager(lambda x: x.t().contiguous(), [torch.randn(4, 3)], torch.inference_mode)
    assert "aten::clone" in graph.recorded_ops


def test_true_views_leave_no_entry_under_every_grad_mode(grad_mode):
    graph = _replay_matches_eager(
        lambda x: x.reshape(4, 3)[1:].t().expand(2, 3, 3).contiguous() + 1, [torch.randn(3, 4)], grad_mode
    )
    assert graph.recorded_ops == ["aten::clone", "aten::add"]  # the contiguous copy, the add


def test_writes_through_a_view_replay_under_every_grad_mode(grad_mode):
    def fn(x, buf):
        buf.view(-1)[:3].copy_(x.reshape(-1)[:3].to(torch.float32))
        return buf * 2

    _replay_matches_eager(fn, [torch.randn(2, 2), torch.zeros(2, 2)], grad_mode)


def test_a_module_forward_replays_under_every_grad_mode(grad_mode):
    torch.manual_seed(0)
    emb, lin = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4)

    def fn(ids, x):
        h = emb(ids.long()) + lin(x.to(torch.float32).contiguous())
        return h.reshape(-1).softmax(-1)

    ids = torch.tensor([1, 2, 3], dtype=torch.int32)
    _replay_matches_eager(
        fn,
        [ids, torch.randn(3, 4)],
        grad_mode,
        refill=lambda t: t.flip(0) if t is ids else torch.randn(t.shape),
    )


def test_auto_update_task_replays_under_every_grad_mode(grad_mode):
    q = torch.randn(2, 2, 4)
    k_cache = torch.randn(4, 2, 2, 4)
    v_cache = torch.randn(4, 2, 2, 4)
    block_table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    seq_lens = torch.tensor([3, 4], dtype=torch.int32)
    graph = devgraph.device("cpu").graph()
    with grad_mode():
        with graph.capture(auto_update_ops=["devgraph::paged_decode_attention"]):
            out = ops.paged_decode_attention(
                q.to(torch.float32), k_cache, v_cache, block_table, seq_lens, seq_lens_host=[3, 4]
            ).contiguous()
    q.copy_(torch.randn(2, 2, 4))
    seq_lens.copy_(torch.tensor([2, 4], dtype=torch.int32))
    graph.replay(host_args={"seq_lens_host": [2, 4]})
    with grad_mode():
        expected = ops.paged_decode_attention(
            q, k_cache, v_cache, block_table, seq_lens, seq_lens_host=[2, 4]
        )
    torch.testing.assert_close(out, expected)


def test_graph_runner_replays_integer_conversions_under_every_grad_mode(grad_mode):
    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.emb = torch.nn.Embedding(16, 8)
            self.lin = torch.nn.Linear(8, 16)

        def forward(self, ids):
            return self.lin(self.emb(ids.long())).float().argmax(-1).to(torch.int32)

    model = Model()
    graphed = devgraph.wrap(model, device="cpu", batch_sizes=[4])
    with grad_mode():
        for seed in range(3):
            ids = torch.randint(0, 16, (4,), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)
            torch.testing.assert_close(graphed(ids), model(ids))
    assert graphed.stats.replays >= 2


def _capture_under(mode, fn):
    graph = devgraph.device("cpu").graph()
    with mode():
        with graph.capture():
            return fn()


# -- data-dependent shapes: refused at capture, never a crash at replay ---------------------------

DATA_DEPENDENT_SHAPES = {
    "boolean_mask_index": (lambda y: y[y > 0], "aten::index"),
    "boolean_mask_index_2d": (lambda y: y.view(2, 3)[y.view(2, 3)[:, 0] > 0], "aten::index"),
    "argwhere": (lambda y: torch.argwhere(y), ("aten::argwhere", "aten::nonzero")),
    "nonzero_as_tuple": (
        lambda y: torch.nonzero(y > 0, as_tuple=True),
        ("aten::nonzero", "aten::nonzero_numpy"),
    ),
    "masked_assign_of_a_count_sized_tensor": (
        lambda y: y.clone().index_put_((y > 0,), y[:4] * 0 + 1),
        "aten::index_put_",
    ),
    "repeat_interleave_without_output_size": (
        lambda y: torch.repeat_interleave(torch.arange(3), (y[:3] > 0).long() + 1),
        "aten::repeat_interleave",
    ),
    "bincount": (lambda y: torch.bincount((y > 0).long()), "aten::bincount"),
    "one_hot_without_num_classes": (lambda y: torch.nn.functional.one_hot((y > 0).long()), None),
}


@pytest.mark.parametrize("case", list(DATA_DEPENDENT_SHAPES))
def test_data_dependent_shapes_are_refused_at_capture_under_every_grad_mode(case, grad_mode):
    fn, op = DATA_DEPENDENT_SHAPES[case]
    y = torch.tensor([1.0, -2.0, 3.0, 4.0, -5.0, 6.0])
    with pytest.raises(devgraph.CaptureError) as info:
        _capture_under(grad_mode, lambda: fn(y))
    if op is not None:
        assert info.value.op in ((op,) if isinstance(op, str) else op)
    assert "test_reference_strict.py" in info.value.source
    assert "data-dependent" in str(info.value) or "host" in str(info.value)


FIXED_SHAPES = {
    "integer_index": lambda y, idx: y[idx] * 2,
    "masked_fill_by_assignment": lambda y, idx: y.clone().index_put_((y > 0,), torch.tensor(0.0)),
    "where": lambda y, idx: torch.where(y > 0, y, 0.0),
    "repeat_interleave_with_output_size": lambda y, idx: torch.repeat_interleave(y[:3], idx, output_size=7),
    "nonzero_static": lambda y, idx: torch.nonzero_static(y > 0, size=6),
}


@pytest.mark.parametrize("case", list(FIXED_SHAPES))
def test_fixed_shape_forms_of_those_ops_capture_and_replay(case, grad_mode):
    idx = torch.tensor([5, 0, 2])
    _replay_matches_eager(
        FIXED_SHAPES[case],
        [torch.tensor([1.0, -2.0, 3.0, 4.0, -5.0, 6.0]), idx],
        grad_mode,
        refill=lambda t: t.flip(0) if t is idx else -t,
    )


def test_linalg_error_checks_are_refused_with_the_ex_variant_as_remedy(grad_mode):
    a = torch.eye(3) * 2
    with pytest.raises(devgraph.CaptureError) as info:
        _capture_under(grad_mode, lambda: torch.linalg.inv(a))
    assert info.value.op == "aten::_linalg_check_errors" and "inv_ex" in info.value.remedy


def test_linalg_ex_variants_capture_and_replay(grad_mode):
    _replay_matches_eager(
        lambda a: torch.linalg.inv_ex(a).inverse, [torch.eye(3) * 2], grad_mode, refill=lambda t: t * 3
    )


def test_a_replayed_result_of_another_shape_is_never_broadcast_into_the_output():
    from devgraph.backends.cpu._pool import BlockPool, PoolBytes
    from devgraph.backends.cpu._recorder import Entry, _Ref

    pool = BlockPool(PoolBytes())
    block = pool.allocate(64)
    x = torch.ones(2, 3)
    entry = Entry(torch.ops.aten.sum.dim_IntList, "aten::sum", (x, [1]), {})
    out = torch.empty(3, device="meta")
    ref = _Ref(block, out)
    entry.outs.append((0, ref))  # the captured output had 3 elements; sum over dim 1 gives 2
    with pytest.raises(devgraph.DevgraphError, match="depends on data"):
        entry.run()


# -- reading a device tensor on the host inside capture ------------------------------------------

HOST_READS = {
    "print": (lambda y: print(y), "Tensor.__repr__"),
    "repr": (lambda y: repr(y), "Tensor.__repr__"),
    "str": (lambda y: str(y), "Tensor.__repr__"),
    "f_string": (lambda y: f"{y}", "Tensor.__format__"),
    "format_of_an_element": (lambda y: f"{y[0]:.3f}", "Tensor.__format__"),
    "numpy": (lambda y: y.numpy(), "Tensor.numpy"),
    "numpy_asarray": (lambda y: __import__("numpy").asarray(y), "Tensor.__array__"),
    "contains": (lambda y: 1.0 in y, "Tensor.__contains__"),
}


@pytest.mark.parametrize("case", list(HOST_READS))
def test_reading_a_tensor_on_the_host_inside_capture_is_refused(case, grad_mode, capsys):
    fn, op = HOST_READS[case]
    with pytest.raises(devgraph.CaptureError) as info:
        _capture_under(grad_mode, lambda: fn(torch.randn(3)))
    assert info.value.op == op and "test_reference_strict.py" in info.value.source
    assert capsys.readouterr().out == ""  # refused before anything was printed


def test_shapes_and_dtypes_stay_readable_inside_capture():
    y = torch.randn(3)
    text = _capture_under(torch.no_grad, lambda: f"{tuple(y.shape)} {y.dtype} {y.size(0)} {len(y)}")
    assert text == "(3,) torch.float32 3 3"


# -- on CUDA: host syncs are refused for device tensors; host computation over CPU tensors that
# existed before the capture is refused as frozen (graph/_host_compute.py); views and reads that
# run no op pass ---------------------------------------------------------------------------------


def _cuda_guard():
    """The capture check as a CUDA capture builds it: device type "cuda" (no GPU needed for CPU tensors)."""
    from types import SimpleNamespace

    from devgraph.graph import _capture

    check_cls, dispatch_cls = _capture._modes()
    graph = SimpleNamespace(device=SimpleNamespace(torch_device=torch.device("cuda")), _open_group=None)
    return check_cls("cuda"), dispatch_cls(graph, ())


CPU_READS = {
    "item": lambda t: t.sum().item(),
    "tolist": lambda t: t.tolist(),
    "bool": lambda t: bool(t.sum() > 0),
    "cpu": lambda t: t.cpu(),
    "numpy": lambda t: t.numpy(),
    "int": lambda t: int(t[0]),
    "repr": lambda t: repr(t),
    "nonzero": lambda t: torch.nonzero(t),
    "boolean_mask": lambda t: t[t > 0],
}
#: The reads that compute on the CPU from the pre-capture tensor (the rest run no op, or a view).
FROZEN = {"item", "bool", "int", "nonzero", "boolean_mask"}


@pytest.mark.parametrize("name", list(CPU_READS))
def test_a_cuda_capture_refuses_host_computation_over_pre_capture_cpu_tensors(name):
    fn = CPU_READS[name]
    t = torch.tensor([1.0, -2.0, 3.0])
    guard, dispatch = _cuda_guard()
    if name in FROZEN:
        with (
            pytest.raises(devgraph.CaptureError, match="computes on the CPU from a CPU tensor") as err,
            guard,
            dispatch,
        ):
            fn(t)
        assert "synchron" not in str(err.value)  # not the device host-sync refusal: no device is involved
        return
    with guard, dispatch:
        got = fn(t)
    expected = fn(t)
    if name == "repr":
        assert got == expected
    else:
        torch.testing.assert_close(torch.as_tensor(got), torch.as_tensor(expected))


def test_a_cuda_capture_lets_the_host_compute_on_what_it_made():
    guard, dispatch = _cuda_guard()
    with guard, dispatch:
        made = torch.arange(4.0)
        assert (made * 2).sum().item() == 12.0


# -- metadata a rebuilt pool tensor must keep, layouts the recorder cannot replay ------------------


def test_a_lazily_conjugated_intermediate_replays_conjugated(grad_mode):
    # hfft2 conjugates an intermediate lazily (aten::_conj, a view that only sets a bit).
    _replay_matches_eager(
        lambda x: torch.fft.hfft2(x, s=(6, 8)),
        [torch.randn(5, 6, dtype=torch.complex64)],
        grad_mode,
        refill=lambda t: t * 0.7 + 0.1j,
    )


def test_sparse_tensors_are_refused_at_capture(grad_mode):
    x = torch.randn(3, 3)
    with pytest.raises(devgraph.CaptureError) as info:
        _capture_under(grad_mode, lambda: x.to_sparse() * 2)
    assert "sparse" in str(info.value) and "test_reference_strict.py" in info.value.source


def test_split_points_in_a_tensor_are_refused_at_capture(grad_mode):
    x, points = torch.randn(6), torch.tensor([1, 4])
    with pytest.raises(devgraph.CaptureError) as info:
        _capture_under(grad_mode, lambda: torch.tensor_split(x, points))
    assert info.value.op in ("torch.tensor_split", "aten::_local_scalar_dense")
    assert "list" in info.value.remedy or "host" in str(info.value)


# -- Python-bodied custom ops: the reference freezes what a device graph freezes --------------------

_FORWARD_CONTEXT = {"scale": 2.0, "bias": None}


@torch.library.custom_op("devgraph_strict_test::scaled", mutates_args=())
def _scaled(x: torch.Tensor) -> torch.Tensor:
    """Reads live Python state, like vLLM's attention reading its forward context."""
    return x * _FORWARD_CONTEXT["scale"] + _FORWARD_CONTEXT["bias"]


@_scaled.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("devgraph_strict_test::accumulate", mutates_args=("acc",))
def _accumulate(acc: torch.Tensor, x: torch.Tensor) -> None:
    acc.add_(x * _FORWARD_CONTEXT["scale"])


@pytest.fixture
def forward_context():
    _FORWARD_CONTEXT.update(scale=2.0, bias=torch.ones(3))
    yield _FORWARD_CONTEXT
    _FORWARD_CONTEXT.update(scale=2.0, bias=None)


def test_python_bodied_custom_op_replays_what_it_launched_at_capture(forward_context, grad_mode):
    x = torch.randn(3)
    graph = devgraph.device("cpu").graph()
    with grad_mode():
        with graph.capture():
            out = torch.ops.devgraph_strict_test.scaled(x) + 0
    captured_bias = forward_context["bias"]
    forward_context.update(scale=5.0, bias=torch.full((3,), 7.0))  # live state a device never sees
    x.copy_(torch.randn(3))
    graph.replay()
    torch.testing.assert_close(out, x * 2.0 + captured_bias)
    assert "aten::mul" in graph.recorded_ops and "devgraph_strict_test::scaled" not in graph.recorded_ops


def test_python_bodied_custom_op_equals_eager_on_new_inputs(forward_context, grad_mode):
    _replay_matches_eager(lambda x: torch.ops.devgraph_strict_test.scaled(x), [torch.randn(3)], grad_mode)


def test_python_bodied_mutating_custom_op_replays_its_writes(forward_context, grad_mode):
    def fn(acc, x):
        torch.ops.devgraph_strict_test.accumulate(acc, x)
        return acc * 1

    _replay_matches_eager(fn, [torch.zeros(3), torch.randn(3)], grad_mode)


# -- lifetimes: inputs are held as a device holds them, by address ---------------------------------


def _capture_doubling_of_a_dropped_input():
    graph = devgraph.device("cpu").graph()
    x = torch.randn(5, 2)
    with graph.capture():
        out = x * 2
    return graph, out, weakref.ref(x)


def test_a_graph_does_not_keep_its_inputs_alive():
    _graph, _out, x_ref = _capture_doubling_of_a_dropped_input()
    gc.collect()
    assert x_ref() is None


def test_replay_after_an_input_was_freed_raises_naming_it():
    graph, _out, _ = _capture_doubling_of_a_dropped_input()
    gc.collect()
    with pytest.raises(
        devgraph.DevgraphError, match=r"freed: a \[5, 2\] torch.float32 tensor read by aten::mul"
    ):
        graph.replay()


def test_an_input_held_only_through_a_view_is_still_alive():
    graph = devgraph.device("cpu").graph()
    base = torch.randn(4, 4)
    view = base[1:3]
    with graph.capture():
        out = view.t() * 2
    del base  # the view keeps the memory alive, as it would on a device
    view.copy_(torch.randn(2, 4))
    graph.replay()
    torch.testing.assert_close(out, view.t() * 2)


def test_a_temporary_made_inside_capture_outside_the_pool_is_refused_at_capture():
    import numpy as np

    x = torch.randn(3)
    graph = devgraph.device("cpu").graph()
    with pytest.raises(devgraph.CaptureError, match="freed when the capture ended") as info:
        with graph.capture():
            _ = x + torch.from_numpy(np.ones(3, dtype=np.float32))
    assert info.value.op == "aten::add"
    assert not graph.is_captured()


def test_weights_held_by_the_model_keep_a_runner_graph_valid(grad_mode):
    model = torch.nn.Linear(4, 4)
    graphed = devgraph.wrap(model, device="cpu", batch_sizes=[2])
    x = torch.randn(2, 4)
    with grad_mode():
        first = graphed(x).clone()
        gc.collect()
        torch.testing.assert_close(graphed(x), first)
        torch.testing.assert_close(first, model(x))


UPLOADS = {
    "to": lambda t: t.to("cuda"),
    "cuda": lambda t: t.cuda(),
    "to_device": lambda t: t.to(device="cuda"),
}


@pytest.mark.parametrize("name", list(UPLOADS))
def test_a_cuda_capture_refuses_a_pageable_host_to_device_copy(name):
    upload = UPLOADS[name]
    guard, dispatch = _cuda_guard()
    with pytest.raises(devgraph.CaptureError) as info:
        with guard, dispatch:
            upload(torch.randn(4))
    assert info.value.op.startswith("Tensor.") and "pinned" in info.value.remedy


def test_a_cuda_capture_may_move_host_scalars_and_stay_on_the_host():
    guard, dispatch = _cuda_guard()
    with guard, dispatch:
        t = torch.randn(4)  # made inside the capture: the host may compute on it
        same = t.to("cpu") + t.to(torch.float64).float()
    torch.testing.assert_close(same, t * 2)


def test_opaque_calls_replay_on_the_captured_tensors_under_every_grad_mode(grad_mode):
    """``Graph.call_opaque`` (inductor's dispatcher-free code) is one task over the captured tensors."""

    def kernel(a, o):
        o.copy_(a.to(torch.float64).float() * 2)  # runs unrecorded: the task replays it whole
        return o + 1

    def fn(x, o):
        return devgraph.graph._contract.current_graph().call_opaque(kernel, x, o, name="kernel") * 3

    graph = _replay_matches_eager(
        fn, [torch.randn(3), torch.zeros(3)], grad_mode, eager=lambda x, o: (kernel(x, o)) * 3
    )
    assert "kernel" in graph.recorded_ops
