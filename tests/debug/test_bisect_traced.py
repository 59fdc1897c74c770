"""The bisect of a ``devgraph.wrap(..., frontend="dynamo")`` model looks at the graphs that served the
call (Dynamo's, captured by devgraph), and names each op at the user's line its FX node came from."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import devgraph
from devgraph.debug import bisect


@torch.library.custom_op("bisect_traced::rows_kernel", mutates_args=("out",))
def rows_kernel(out: torch.Tensor, x: torch.Tensor, valid: torch.Tensor) -> None:
    """Writes only the rows marked valid (padding rows are left as they were)."""
    out.copy_(torch.where(valid[:, None] != 0, x * 2, out))


@torch.library.custom_op("bisect_traced::rowsum", mutates_args=())
def rowsum(x: torch.Tensor) -> torch.Tensor:
    """A reduction whose order depends on the batch size (a tiling chosen by the row count)."""
    order = reversed(range(x.shape[1])) if x.shape[0] >= 8 else range(x.shape[1])
    acc = torch.zeros_like(x[:, 0])
    for i in order:
        acc = acc + x[:, i]
    return acc


@rowsum.register_fake
def _(x):
    return x.new_empty(x.shape[0])


def _exact_linear(n: int) -> nn.Linear:
    torch.manual_seed(0)
    layer = nn.Linear(n, n)
    with torch.no_grad():  # small integers: exact at any row count, on any CPU
        layer.weight.copy_(torch.randint(-2, 3, (n, n)).float())
        layer.bias.copy_(torch.randint(-2, 3, (n,)).float())
    return layer


class PaddedRows(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = _exact_linear(16)

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        out = torch.empty_like(h)
        rows_kernel(out, h, valid)  # planted: padding rows unwritten
        return out


class BatchDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = _exact_linear(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.proj(x) * 0.05)
        torch._dynamo.graph_break()  # two graphs: the planted op is in the second
        return rowsum(h * 100) * 2  # planted: reduction order depends on the batch size


def _line(fn, text: str) -> int:
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _ints(*shape: int) -> torch.Tensor:
    return torch.randint(-3, 4, shape).float()


def test_the_served_graph_is_bisected_and_the_op_named_at_the_users_line():
    graphed = devgraph.wrap(PaddedRows().eval(), device="cpu", frontend="dynamo", batch_sizes=[4])
    x, valid = _ints(3, 16), torch.ones(3, dtype=torch.int64)
    with torch.no_grad():
        graphed(x, valid)
    report = bisect(graphed, x, valid)
    first = report.first
    assert first is not None, report.text()
    assert first.op == "bisect_traced::rows_kernel"
    assert first.location.endswith(f"test_bisect_traced.py:{_line(PaddedRows.forward, 'rows_kernel(out')}")
    assert first.against == "the padded batch" and first.where[0] == 3
    assert report.output_max_abs == 0 and report.reproduces
    assert "through Dynamo" in report.subject


def test_each_graph_of_a_call_is_bisected_in_order_and_the_first_that_differs_reported():
    graphed = devgraph.wrap(BatchDependent().eval(), device="cpu", frontend="dynamo", batch_sizes=[8])
    x = _ints(5, 32)
    report = bisect(graphed, x)
    first = report.first
    assert first is not None, report.text()
    assert first.op == "bisect_traced::rowsum" and first.against == "the call"
    assert first.location.endswith(f":{_line(BatchDependent.forward, 'rowsum(h')}")
    assert "graph 2 of 2" in report.subject


def test_a_call_no_graph_served_is_refused_by_name():
    graphed = devgraph.wrap(nn.Linear(4, 4).eval(), device="cpu", frontend="dynamo", batch_sizes=[2])
    with pytest.raises(devgraph.DevgraphError, match="not served from a graph"):
        bisect(graphed, torch.ones(3, 4))  # beyond the largest bucket: eager
