"""Bisect inside ``torch.compile``'d code: the graph runs it compiled, eager runs it as written, and
the bisect names the op inside the compiled graph where inductor's value departs from eager.

Inductor fuses ``(x * 3.1).to(bf16)`` with what reads it and keeps the product in float32 (it does
not round it to bf16 between the ops, as eager does): ``y.float()`` on the planted line is where the
compiled value first departs (inductor's is the unrounded product). That holds on any CPU, so the
test plants it; ``emulate_precision_casts`` (the hint's remedy) removes the difference.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from devgraph.debug import BisectOptions, EagerCheck, bisect


class Rounding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        y = (h.float() * 3.1).to(torch.bfloat16)
        z = y.float() * 1.7  # planted: inductor keeps y in float32 here
        return z.to(torch.bfloat16) + 1


class Exact(nn.Module):
    """Nothing inductor computes otherwise: float32 elementwise ops, no reduction."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 2.0 + 1.0).relu()


def _line(fn, text: str) -> int:
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


@pytest.fixture
def rounding() -> nn.Module:
    torch.manual_seed(0)
    return Rounding().eval()


def _x() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(8, 32, dtype=torch.bfloat16)


def test_compiled_module_names_the_op_inside_the_compiled_graph(rounding):
    compiled = torch.compile(rounding)
    x = _x()
    with torch.no_grad():
        assert not torch.equal(compiled(x), rounding(x))  # the difference the bisect must explain
    report = bisect(compiled, x)
    first = report.first
    assert first is not None, str(report)
    assert first.op == "Tensor.float", str(report)
    assert "emulate_precision_casts" in first.hint
    assert first.location.endswith(f"test_bisect_compiled.py:{_line(Rounding.forward, 'planted')}"), str(
        report
    )
    assert "torch.compile'd graph" in first.inside and "inductor" in first.inside
    assert first.max_abs > 0 and first.noise_floor == 0.0
    assert report.output_max_abs > 0
    text = str(report)
    assert "inside" in text and "planted" in text


def test_compiled_code_inside_a_graph_capture_is_bisected(rounding, any_device):
    """A Graph target whose capture calls compiled code: the probe records it whole inside the
    capture (the CPU reference and the simulator's recorder record it whole too; a stream capture
    records its kernels), and the bisect descends into it."""
    compiled = torch.compile(rounding.to(any_device.torch_device))
    x = _x().to(any_device.torch_device)
    graph = any_device.graph()

    def step(inp: torch.Tensor) -> torch.Tensor:
        return compiled(inp) * 2

    report = bisect(graph, step, x)
    assert report.first is not None, str(report)
    assert report.first.location.endswith(f":{_line(Rounding.forward, 'planted')}"), str(report)
    assert report.first.inside


def test_the_hints_remedy_removes_the_difference(rounding):
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    try:
        with inductor_config.patch(emulate_precision_casts=True):
            report = bisect(torch.compile(rounding), _x())
    finally:
        torch._dynamo.reset()
    assert report.identical and report.output_max_abs == 0.0, str(report)


def test_compiled_code_that_agrees_with_eager_reports_no_difference():
    compiled = torch.compile(Exact())
    x = torch.randn(4, 16)
    report = bisect(compiled, x)
    assert report.identical, str(report)
    assert report.output_max_abs == 0.0


def test_compile_mode_is_passed_to_the_descent(rounding, monkeypatch):
    from devgraph.debug import _compiled

    modes = []
    real = _compiled._Cuts.__init__

    def spy(self, gm, inputs, mode):
        modes.append(mode)
        real(self, gm, inputs, mode)

    monkeypatch.setattr(_compiled._Cuts, "__init__", spy)
    bisect(torch.compile(rounding), _x(), bisect_options=BisectOptions(compile_mode="reduce-overhead"))
    assert modes == ["reduce-overhead"]


def test_eager_check_runs_compiled_code_as_written(rounding):
    """The engines' sampled check compares with eager, not with the compiled code run again."""
    compiled = torch.compile(rounding)
    x = _x()
    with torch.no_grad():
        graphed = compiled(x)
    result = EagerCheck("test", 1).compare(graphed, lambda: compiled(x), real_rows=None)
    assert result.max_abs > 0


@torch.compiler.disable
def _between(x: torch.Tensor) -> torch.Tensor:
    return x * 1.0  # runs eagerly between the compiled graphs


class TwoRegions(nn.Module):
    """Two compiled graphs (Dynamo breaks at ``_between``), as SGLang's compiled forward breaks
    around its attention."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(_between(self.inner(x)))


def test_each_compiled_graph_is_one_record_and_eager_ops_between_pair_by_line(rounding):
    """The op run eagerly between two compiled graphs is compared with the same op of eager (paired
    by op and line: by name alone it paired with a ``mul`` eager ran inside the first graph), and the
    descent traces the compiled graphs only, in the order they ran."""
    forward = torch.compile(torch.no_grad()(TwoRegions(rounding).forward))
    x = _x()
    forward(x)  # compiled before the bisect, as an engine compiles at start

    report = bisect(lambda inp: forward(inp), x)
    first = report.first
    assert first is not None and first.location.endswith(f":{_line(Rounding.forward, 'planted')}"), str(
        report
    )
    assert "compiled graph 1 of 2 the call ran" in first.inside, str(report)
    between = _line(_between, "runs eagerly")
    assert report.largest is not None and report.largest.location.endswith(f":{between}"), str(report)
    assert report.largest.max_rel < 0.05  # its input differs by the first graph's rounding, no more


class WritesInPlace(nn.Module):
    """An in-place write after the value is made: the eager value at a cut is the value then, not the
    graph's final one (comparing with the final one named the exact ``x * 2``, off by the ``+ 1``).
    Inductor fuses ``x * 2`` and ``add_(1)`` without rounding the product to bf16: ``y.float()`` reads
    the unrounded sum, where the difference starts."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        y.add_(1)
        h = (y.float() * 3.1).to(torch.bfloat16)  # planted: the fused-away rounding shows here
        return h.float() * 1.7


def test_a_value_written_in_place_is_compared_as_it_is_at_the_cut():
    x = _x()
    report = bisect(torch.compile(WritesInPlace()), x)
    assert report.first is not None, str(report)
    assert report.first.location.endswith(f":{_line(WritesInPlace.forward, 'planted')}"), str(report)
    assert report.first.op == "Tensor.float" and report.first.max_abs < 0.1  # rounding, not the + 1


def test_the_descent_works_every_time_on_the_same_compiled_function(rounding):
    """One graph-keeping backend for the process: a backend per bisect made Dynamo recompile each
    time, and past its recompile limit (8) the descent traced nothing and found nothing."""
    from devgraph.debug._compiled import descend

    compiled = torch.compile(rounding)
    x = _x()
    for _ in range(10):
        found = descend(lambda inp: compiled(inp), (x,), {})
        assert found is not None and found[1].op == "Tensor.float"


def test_every_call_of_a_compiled_graph_is_traced_in_call_order(rounding):
    from devgraph.debug._compiled import trace_graphs

    compiled = torch.compile(rounding)
    x = _x()
    graphs = trace_graphs(lambda inp: compiled(compiled(inp)), (x,), {})
    assert len(graphs) == 2 and graphs[0][0] is graphs[1][0]  # one graph, called twice
    assert not torch.equal(graphs[0][1][-1], graphs[1][1][-1])  # each call's own inputs


def test_a_descent_that_fails_leaves_the_op_level_report_with_a_note(rounding, monkeypatch):
    from devgraph.debug import _bisect

    def broken(*args, **kwargs):
        raise RuntimeError("inductor cannot compile this prefix")

    monkeypatch.setattr(_bisect, "descend", broken)
    report = bisect(torch.compile(rounding), _x())
    assert report.output_max_abs > 0
    assert any(
        "could not look inside the compiled code" in n and "inductor cannot" in n for n in report.notes
    )


def test_bisects_from_two_threads_both_find_the_difference(rounding):
    """An eager side's force_eager stance is process-wide: run concurrently, one bisect's graph side
    ran its compiled code eagerly and reported no difference. Bisects now run one at a time."""
    import threading

    compiled = torch.compile(rounding)
    x = _x()
    reports = {}

    def run(i):
        reports[i] = bisect(compiled, x)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(reports) == [0, 1]
    for report in reports.values():
        assert report.first is not None and report.first.op == "Tensor.float", str(report)


def test_a_wrapped_compiled_model_padded_to_its_bucket_is_descended_on_the_padded_batch(rounding):
    """3 rows served by the graph of 4: the compiled code ran on the padded batch, and the descent
    runs what the graph replayed (and says so)."""
    import devgraph

    # frontend='raw': the graph captures the compiled code as it runs (through Dynamo, the outer
    # trace takes the model's own forward, and inductor's code is not what the graph replays)
    with pytest.warns(UserWarning, match="untraced"):
        wrapped = devgraph.wrap(torch.compile(rounding), device="cpu", batch_sizes=[4], frontend="raw")
    x = _x()[:3]
    report = bisect(wrapped, x)
    assert report.first is not None and report.first.inside, str(report)
    assert report.first.against == "the padded batch"
