"""The CPU reference backend is never silently wrong: replay equals eager on new inputs, or capture refuses.

Every recording path is checked under ``no_grad``, ``inference_mode`` and grad mode: composite ops
reach the recorder whole under ``inference_mode`` only, so a path that works in one mode proves
nothing about the others.
"""

from __future__ import annotations

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


def _replay_matches_eager(fn, inputs, mode, refill=None):
    """Capture ``fn(*inputs)`` under ``mode``, refill the inputs, replay, compare with eager."""
    graph = devgraph.device("cpu").graph()
    with mode():
        with graph.capture():
            out = fn(*inputs)
    g = torch.Generator().manual_seed(1)
    for t in inputs:
        new = refill(t) if refill else torch.randn(t.shape, generator=g).to(t.dtype)
        t.copy_(new)
    graph.replay()
    with mode():
        expected = fn(*[t.clone() for t in inputs])
    torch.testing.assert_close(out, expected)
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
