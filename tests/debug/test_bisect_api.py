"""devgraph.bisect's targets, options, report and command line."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

import devgraph
from devgraph import DevgraphError
from devgraph.cli import main
from devgraph.debug import BisectOptions, bisect


def step(x: torch.Tensor, scale: float) -> torch.Tensor:
    y = x * scale
    return y + 1


def test_a_graph_and_its_capture_function(any_device):
    dev = any_device
    x = torch.randn(4, device=dev.torch_device)
    report = bisect(dev.graph(), step, x, 2.0)
    assert report.identical and report.ops_compared == 2
    assert dev.name in report.subject


def test_a_graph_without_its_capture_function_is_refused():
    with pytest.raises(DevgraphError, match="capture function next"):
        bisect(devgraph.device("cpu").graph(), torch.randn(2))


def test_frozen_scale_is_named_at_the_line_that_uses_it():
    x = torch.randn(4)
    report = bisect(step, x, 3.0, bisect_options=BisectOptions(capture_args=(x, 2.0)))
    assert report.first is not None and report.first.op == "aten::mul"
    assert "y = x * scale" in report.first.source
    assert "host argument 1 is 2.0 at capture and 3.0 in the call" in report.text()


def test_capture_args_of_another_shape_are_refused():
    with pytest.raises(DevgraphError, match="replays the shapes it captured"):
        bisect(step, torch.randn(4), 2.0, bisect_options=BisectOptions(capture_args=(torch.randn(5), 2.0)))


@pytest.mark.parametrize("field", ["atol", "rtol"])
def test_negative_tolerance_is_refused(field):
    with pytest.raises(DevgraphError, match=field):
        BisectOptions(**{field: -1.0})


def test_tolerance_raises_the_floor():
    x = torch.randn(4)
    options = BisectOptions(capture_args=(x, 2.0), rtol=1.0)
    assert bisect(step, x, 2.0000001, bisect_options=options).identical


def test_something_not_callable_is_refused():
    with pytest.raises(DevgraphError, match=r"wrapped by devgraph\.wrap"):
        bisect(42)


def test_a_wrapped_call_no_graph_serves_is_refused():
    graphed = devgraph.wrap(torch.nn.Linear(4, 4).eval(), device="cpu", batch_sizes=[2])
    with (
        pytest.raises(DevgraphError, match="not served from a graph"),
        pytest.warns(UserWarning, match=r"running eagerly \(batch_too_large\).*Fix: wrap with a larger"),
    ):
        bisect(graphed, torch.randn(3, 4))  # above the largest bucket: eager


def test_report_saves_both_tensors(tmp_path):
    x = torch.randn(4)
    report = bisect(step, x, 3.0, bisect_options=BisectOptions(capture_args=(x, 2.0)))
    paths = report.save(tmp_path)
    graph_value, eager_value = torch.load(tmp_path / "graph.pt"), torch.load(tmp_path / "eager.pt")
    assert torch.equal(graph_value, x * 2.0) and torch.equal(eager_value, x * 3.0)
    assert (tmp_path / "report.txt").read_text().startswith("devgraph bisect")
    assert len(paths) == 3


def _case():
    x = torch.ones(3)
    return step, (x, 3.0)


def test_cli_runs_a_factory(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "bisect_case", types.SimpleNamespace(make=_case))
    assert main(["bisect", "bisect_case:make", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["identical"] is True and out["ops_compared"] == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bisect", "nomodule"], "MODULE:FACTORY"),
        (["bisect", "no_such_module_xyz:make"], "cannot import"),
        (["bisect", "bisect_case:missing"], "no callable 'missing'"),
        (["bisect", "bisect_case:bad"], r"must return \(target, args\)"),
        (["bisect", "demo", "--batch", "0"], "--batch: expected a positive integer"),
        (["bisect", "demo", "--batch", "4", "--bucket", "2"], "smaller than --batch"),
        (["bisect", "demo", "--device", "nosuchbackend"], "nosuchbackend"),
    ],
)
def test_cli_bad_values_exit_2_with_a_message(argv, message, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "bisect_case", types.SimpleNamespace(make=_case, bad=lambda: 3))
    try:
        code = main(argv)
    except SystemExit as refused:  # a bad option value: argparse's one-line error, status 2
        code = refused.code
    assert code == 2
    import re

    assert re.search(message, capsys.readouterr().err)


def _raises_type_error():
    def forward(x):
        raise TypeError("forward() got an unexpected keyword argument 'attention_mask'")

    return forward, (torch.ones(2),)


def test_cli_a_model_that_raises_exits_2_could_not_run_not_1_differs(monkeypatch, capsys):
    """Exit 1 means an op differs; an error of the model's own call is 'could not run' (2), with its
    traceback and a one-line error."""
    monkeypatch.setitem(sys.modules, "bisect_case", types.SimpleNamespace(make=_raises_type_error))
    assert main(["bisect", "bisect_case:make"]) == 2
    err = capsys.readouterr().err
    assert "error: the bisect could not run: TypeError" in err and "Traceback" in err


def test_cli_demo_names_the_first_differing_op_or_none(capsys):
    code = main(["bisect", "demo", "--device", "cpu", "--batch", "1", "--bucket", "2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == (0 if out["identical"] else 1)
    if not out["identical"]:
        assert out["op"].startswith("aten::") and "models.py:" in out["location"]


def test_the_copies_hold_the_replayed_values_not_the_captured_ones(any_device):
    """Capture on other tensor values than the call's: only copies refilled by the replay agree."""
    dev = any_device
    x, other = torch.randn(4, device=dev.torch_device), torch.randn(4, device=dev.torch_device)
    report = bisect(step, x, 2.0, bisect_options=BisectOptions(capture_args=(other, 2.0)))
    assert report.identical, report.text()
    assert report.ops_compared == 2 and report.output_max_abs == 0


@pytest.mark.parametrize(
    ("source", "location"),
    [
        ("/a/model.py:12: z = x[:3]", "/a/model.py:12"),
        ("C:/a/model.py:3: y: int = 1", "C:/a/model.py:3"),
        ("/a/model.py:7", "/a/model.py:7"),
        (None, "<unknown line>"),
    ],
)
def test_location_is_file_and_line(source, location):
    from devgraph.debug import OpDifference

    diff = OpDifference(0, "aten::mm", source, None, 1.0, 1.0, 0.0, "the call", (0,), None, None)
    assert diff.location == location


def test_what_two_eager_runs_differ_by_is_the_noise_floor():
    """An op whose eager runs differ (a host counter) is held to that difference, not to zero."""
    import itertools

    counter = itertools.count()

    def drifting(x):
        return x + float(next(counter))  # 0 warm-up, 1 capture (frozen), 2 and 3 the eager runs

    report = bisect(drifting, torch.zeros(3, dtype=torch.float64))
    assert report.identical, report.text()  # the replay is 1 off eager, as the two eager runs are
    assert "up to 1 on some ops" in report.noise


def test_capture_options_are_refused_for_a_wrapped_model():
    graphed = devgraph.wrap(torch.nn.Linear(4, 4).eval(), device="cpu", batch_sizes=[2])
    x = torch.randn(2, 4)
    with pytest.raises(DevgraphError, match=r"\['capture_args'\] apply to a callable or a Graph"):
        bisect(graphed, x, bisect_options=BisectOptions(capture_args=(x,)))
