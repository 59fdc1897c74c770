"""The bisect names the op and line where a planted graph-vs-eager difference starts."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from torch import nn

import devgraph
from devgraph.debug import BisectOptions, bisect

# -- planted kernels: each one a known way a replay differs from eager ----------------------------


@torch.library.custom_op("bisect_plant::rows_kernel", mutates_args=("out",))
def rows_kernel(out: torch.Tensor, x: torch.Tensor, valid: torch.Tensor) -> None:
    """A kernel that writes only the rows marked valid (padding rows are left as they were)."""
    out.copy_(torch.where(valid[:, None] != 0, x * 2, out))


@torch.library.custom_op("bisect_plant::rowsum", mutates_args=())
def rowsum(x: torch.Tensor) -> torch.Tensor:
    """A reduction whose order depends on the batch size (a tiling chosen by the row count)."""
    columns = range(x.shape[1])
    order = reversed(columns) if x.shape[0] >= 8 else columns
    acc = torch.zeros_like(x[:, 0])
    for i in order:
        acc = acc + x[:, i]
    return acc


@torch.library.custom_op("bisect_plant::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """Attention over each row's first ``lens[i]`` keys, the lengths read on the host."""
    scores = torch.einsum("bd,btd->bt", q, k)
    for i, n in enumerate(lens):  # the kernel reads each row's length on the host
        scores[i, n:] = -1e9
    return scores.softmax(-1)


@rowsum.register_fake
def _(x):
    return x.new_empty(x.shape[0])


@attention.register_fake
def _(q, k, lens):
    return q.new_empty(k.shape[:2])


def _line(fn, text: str) -> int:
    """The line number of ``text`` in ``fn``'s source (what the report must name)."""
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


def _first_difference(report, op: str, fn, text: str):
    """The report's first difference, checked to be ``op`` at the line of ``fn`` that holds ``text``."""
    first = report.first
    assert first is not None, report.text()
    assert first.op == op
    assert first.location.endswith(f":{_line(fn, text)}")
    return first


class PaddedRows(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        out = torch.empty_like(h)
        rows_kernel(out, h, valid)  # planted: padding rows unwritten
        return self.head(out)


class BatchDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.proj(x) * 0.05)
        s = rowsum(h * 100)  # planted: reduction order depends on the batch size
        return s * 2


def attention_step(q: torch.Tensor, k: torch.Tensor, lens: list[int]) -> torch.Tensor:
    q = q * 0.5
    p = attention(q, k, lens)  # planted: host lengths frozen at capture
    return p * 3


def _seeded(model: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    for p in model.parameters():
        nn.init.normal_(p)
    return model.eval().requires_grad_(False)


# Exact on every machine: a CPU's float32 GEMM may round a row otherwise by the batch's row count
# (oneDNN on an AMD EPYC rounds 3 rows and the same 3 padded to 4 apart; tests/_machines.py), and a
# bisect rightly names that GEMM first. A model whose planted op must come first has small-integer
# weights and takes small-integer inputs before it: every sum is exact, whatever the kernel.
def _exact(model: nn.Module) -> nn.Module:
    model = _seeded(model)
    for p in model.parameters():
        p.round_()
    return model


def _ints(*shape: int, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.randn(*shape).mul(2).round().to(device)


def test_uninitialised_padded_rows_are_named_at_the_kernel(any_device):
    # Eager runs fill unwritten memory with this bisect run's marked NaN; whatever the capture was
    # handed (NaN an earlier poisoned run freed, or anything else) differs from it bit for bit.
    dev = any_device
    model = _exact(PaddedRows()).to(dev.torch_device)
    graphed = _raw(model, device=dev, batch_sizes=[4])
    x = _ints(3, 16, device=dev.torch_device)
    valid = torch.ones(3, dtype=torch.int64, device=dev.torch_device)
    report = bisect(graphed, x, valid)
    first = report.first
    assert first is not None, report.text()
    assert first.op == "bisect_plant::rows_kernel"
    assert first.location.endswith(f"test_bisect_planted.py:{_line(PaddedRows.forward, 'rows_kernel(out')}")
    assert first.against == "the padded batch"
    assert first.where[0] == 3  # the padding row
    assert first.max_abs == float("inf")  # eager's unwritten row reads its poison: memory no op wrote
    assert report.output_max_abs == 0  # the real rows agree: only the padding row differs


def test_batch_size_dependent_reduction_is_named(any_device):
    dev = any_device
    model = _exact(BatchDependent()).to(dev.torch_device)
    graphed = devgraph.wrap(model, device=dev, batch_sizes=[8])
    x = _ints(5, 32, device=dev.torch_device)
    report = bisect(graphed, x)
    first = _first_difference(report, "bisect_plant::rowsum", BatchDependent.forward, "rowsum(h")
    assert first.against == "the call"
    assert 0 < first.max_rel < 1e-5  # rounding, not a wrong value
    assert report.reproduces  # the served graph gives what the bisect's capture gives


def test_host_lengths_frozen_at_capture_are_named(any_device):
    dev = any_device
    torch.manual_seed(0)
    q = torch.randn(2, 8, device=dev.torch_device)
    k = torch.randn(2, 6, 8, device=dev.torch_device)
    options = BisectOptions(capture_args=(q, k, [6, 6]))
    report = bisect(attention_step, q, k, [3, 5], bisect_options=options)
    first = _first_difference(report, "bisect_plant::attention", attention_step, "attention(q, k")
    assert first.max_rel > 0.01  # a wrong value, not rounding
    assert any("[6, 6]" in note and "[3, 5]" in note for note in report.notes)


def test_same_host_lengths_at_capture_and_call_agree():
    q, k = torch.randn(2, 8), torch.randn(2, 6, 8)
    report = bisect(attention_step, q, k, [3, 5])
    assert report.identical, report.text()
    assert report.ops_compared == 3


class TwoLinears(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, width)
        self.down = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.up(x))
        return self.down(h)


def test_float32_gemm_rounding_with_the_row_count_is_named_where_it_starts():
    """A real difference: CPU float32 GEMM rounds a row differently by the number of rows."""
    model = _seeded(TwoLinears(64))
    x = torch.randn(1, 64)
    padded = torch.cat([x, torch.zeros(1, 64)])
    up_differs = not torch.equal(model.up(x), model.up(padded)[:1])
    if not up_differs and torch.equal(model(x), model(padded)[:1]):
        pytest.skip("this machine's float32 GEMM rounds 1 and 2 rows alike")
    # frontend='raw': the 1-row call runs padded to bucket 2 (Dynamo keeps a 1-row call's trace to
    # 1 row: its graph captures that size alone, unpadded, so there is no rounding to find)
    graphed = _raw(model, device="cpu", batch_sizes=[2])
    report = bisect(graphed, x)
    expected = "self.up(x)" if up_differs else "self.down(h)"
    first = _first_difference(report, "aten::addmm", TwoLinears.forward, expected)
    assert first.module == ("up" if up_differs else "down")
    assert first.against == "the call"
    traced = devgraph.wrap(model, device="cpu", batch_sizes=[2])
    assert bisect(traced, x).identical and torch.equal(traced(x), model(x))


def _raw(model, **options):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*captures the forward as it runs, untraced")
        return devgraph.wrap(model, frontend="raw", **options)


@pytest.mark.parametrize("frontend", ["raw", "dynamo"])
def test_piecewise_pieces_are_bisected(frontend):
    model = _exact(BatchDependent())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "devgraph: .*without Dynamo's guards", UserWarning)  # raw
        graphed = devgraph.wrap(model, device="cpu", mode="piecewise", frontend=frontend, capture_sizes=[8])
    report = bisect(graphed, _ints(5, 32))
    _first_difference(report, "bisect_plant::rowsum", BatchDependent.forward, "rowsum(h")
    assert "piecewise" in report.subject and report.reproduces


def test_piecewise_splitting_ops_run_eagerly_and_are_listed_not_compared():
    from devgraph.testing.models import KVBlockManager, make_decoder

    model = make_decoder()
    graphed = devgraph.wrap(model, device="cpu", mode="piecewise", capture_sizes=[2])
    kwargs = KVBlockManager(model.config).decode_batch([0, 1], [5, 7])  # a size captured: no padding
    report = bisect(graphed, **kwargs)
    assert report.identical, report.text()
    attention = "eager: devgraph::paged_decode_attention"
    assert report.unmatched == (attention,) * model.config.num_layers


@pytest.mark.parametrize("frontend", ["raw", "dynamo"])
def test_against_the_cpu_reference_runs_eager_on_a_cpu_copy(any_device, frontend):
    dev = any_device
    selves = []

    class Counted(BatchDependent):
        def forward(self, x):
            selves.append(self)
            return super().forward(x)

    model = _exact(Counted()).to(dev.torch_device)
    graphed = _raw(model, device=dev, batch_sizes=[8]) if frontend == "raw" else None
    graphed = graphed or devgraph.wrap(model, device=dev, batch_sizes=[8])
    x = _ints(5, 32, device=dev.torch_device)
    graphed(x)  # captured here: what follows is the bisect's own runs
    selves.clear()
    report = bisect(graphed, x, bisect_options=BisectOptions(reference="cpu"))
    first = report.first
    assert first is not None and first.against == "the call on the CPU"
    if dev.torch_device.type == "cpu":  # the reference and the simulator compute as the CPU does
        assert first.op == "bisect_plant::rowsum"
        # an op of the root forward is named by the model's class; Dynamo's graph names no module
        assert first.module == ("Counted" if frontend == "raw" else None)
    else:  # a GPU's GEMM rounds otherwise than the CPU's, before the planted reduction (H200)
        assert first.op == "aten::addmm" and first.module == "proj"
    if frontend == "dynamo":  # the bisect runs the graph Dynamo traced, not the forward's Python
        return
    copies = [m for m in selves if m is not model]
    assert len(copies) == 4 and all(m is copies[0] for m in copies)  # eager twice, call and padded
    assert all(p.device.type == "cpu" for p in copies[0].parameters())


def test_an_unknown_reference_is_refused():
    with pytest.raises(devgraph.DevgraphError, match=r"'eager'.*'cpu'"):
        BisectOptions(reference="gpu")


def test_breakable_segments_are_bisected(any_device):
    dev = any_device
    model = _exact(BatchDependent()).to(dev.torch_device)
    graphed = devgraph.wrap(model, device=dev, mode="breakable", batch_sizes=[8])
    report = bisect(graphed, _ints(5, 32, device=dev.torch_device))
    _first_difference(report, "bisect_plant::rowsum", BatchDependent.forward, "rowsum(h")
    assert "breakable graph of bucket 8" in report.subject and report.reproduces


def test_breakable_breaks_run_eagerly_and_are_listed_not_compared():
    from devgraph.testing.models import KVBlockManager, make_decoder

    model = make_decoder()
    graphed = devgraph.wrap(model, device="cpu", mode="breakable", batch_sizes=[2])
    kwargs = KVBlockManager(model.config).decode_batch([0, 1], [5, 7])
    report = bisect(graphed, **kwargs)
    assert report.identical, report.text()
    assert "breakable" in report.subject
    assert report.unmatched == ("eager: devgraph::paged_decode_attention",) * model.config.num_layers


def test_breakable_padded_rows_are_named_at_the_kernel():
    model = _exact(PaddedRows())
    graphed = devgraph.wrap(model, device="cpu", mode="breakable", batch_sizes=[4])
    report = bisect(graphed, _ints(3, 16), torch.ones(3, dtype=torch.int64))
    first = report.first
    assert first is not None, report.text()
    assert first.op == "bisect_plant::rows_kernel" and first.against == "the padded batch"
    assert first.where[0] == 3
