"""Capture is visible by default: a one-line summary on stderr, a progress bar on a terminal or in a
notebook; quiet with ``DEVGRAPH_QUIET=1``, a level above INFO on the ``devgraph`` logger, or ``devgraph -q``."""

from __future__ import annotations

import logging

import pytest
import torch

import devgraph
from devgraph import _console
from devgraph.runner._progress import progress


@pytest.fixture
def no_logging_configured(monkeypatch):
    """A process whose application configured no logging (pytest's own capture handlers are removed
    in ``_capture``: pytest adds them again when the test's call phase starts)."""
    monkeypatch.delenv("DEVGRAPH_QUIET", raising=False)
    return monkeypatch


def _capture(no_logging=None) -> None:
    if no_logging is not None:
        no_logging.setattr(logging.root, "handlers", [])
        no_logging.setattr(logging.getLogger("devgraph"), "handlers", [])
    graphed = devgraph.wrap(torch.nn.Linear(4, 4).eval(), device="cpu", batch_sizes=[1, 2])
    with torch.no_grad():
        # 2 rows: Dynamo keeps a 1-row call's trace to 1 row (its graph would capture that size alone)
        graphed(torch.randn(2, 4))


def test_the_capture_summary_is_one_line_on_stderr_by_default(no_logging_configured, capsys):
    _capture(no_logging_configured)
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and captured.out == ""
    assert (
        lines[0].startswith("devgraph: captured 2 graphs (batch sizes 1, 2) on cpu") and "s, pool" in lines[0]
    )


@pytest.mark.parametrize("value", ["1", "yes", "true"])
def test_devgraph_quiet_silences_the_summary(no_logging_configured, capsys, monkeypatch, value):
    monkeypatch.setenv("DEVGRAPH_QUIET", value)
    _capture(no_logging_configured)
    assert capsys.readouterr().err == ""


def test_a_warning_level_on_the_devgraph_logger_silences_the_summary(
    no_logging_configured, capsys, monkeypatch
):
    monkeypatch.setattr(logging.getLogger("devgraph"), "level", logging.WARNING)
    _capture(no_logging_configured)
    assert capsys.readouterr().err == ""


def test_where_logging_is_configured_the_summary_is_an_info_record_of_devgraph(caplog, capsys):
    with caplog.at_level(logging.INFO, logger="devgraph"):
        _capture()
    (record,) = [r for r in caplog.records if "captured 2 graphs" in r.getMessage()]
    assert record.name == "devgraph" and record.levelno == logging.INFO
    assert "captured" not in capsys.readouterr().err  # not written twice


def test_progress_is_a_tqdm_auto_bar_on_a_terminal(monkeypatch):
    tqdm_auto = pytest.importorskip("tqdm.auto")
    monkeypatch.delenv("DEVGRAPH_QUIET", raising=False)
    monkeypatch.setattr("sys.stderr.isatty", lambda: True, raising=False)
    bar = progress([4, 2, 1], "capturing")
    assert isinstance(bar, tqdm_auto.tqdm) and list(bar) == [4, 2, 1]


def test_progress_is_a_bar_in_a_notebook(monkeypatch):
    tqdm_auto = pytest.importorskip("tqdm.auto")
    monkeypatch.delenv("DEVGRAPH_QUIET", raising=False)
    monkeypatch.setattr(_console, "in_notebook", lambda: True)
    assert isinstance(progress([2, 1], "capturing"), tqdm_auto.tqdm)


def test_progress_is_off_when_quiet_or_when_not_shown_to_a_person(monkeypatch):
    monkeypatch.setattr(_console, "in_notebook", lambda: False)
    assert progress([2, 1], "capturing") == [2, 1]  # pytest's stderr is no terminal
    monkeypatch.setattr(_console, "in_notebook", lambda: True)
    monkeypatch.setenv("DEVGRAPH_QUIET", "1")
    assert progress([2, 1], "capturing") == [2, 1]


def test_cli_quiet_sets_devgraph_quiet(monkeypatch):
    from devgraph.cli import main

    monkeypatch.delenv("DEVGRAPH_QUIET", raising=False)
    assert main(["-q", "info", "--json"]) == 0
    assert _console.quiet()


def test_the_piecewise_summary_counts_the_trace_in_its_seconds(caplog):
    # It gave the capture loop's seconds alone: the trace and compile before it were left out.
    import re

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)).eval()
    with caplog.at_level(logging.INFO, logger="devgraph"):
        graphed = devgraph.wrap(model, device="cpu", mode="piecewise", capture_sizes=[2, 4])
        with torch.no_grad():
            graphed(torch.randn(3, 4))
    line = next(r.getMessage() for r in caplog.records if "pieces x" in r.getMessage())
    found = re.search(r" in ([0-9.]+) s \(tracing and compiling ([0-9.]+) s, capturing ([0-9.]+) s\)", line)
    assert found, line
    total, traced, captured = (float(x) for x in found.groups())
    stats = graphed.stats
    assert stats.compile_seconds > 0 and traced == pytest.approx(stats.compile_seconds, abs=0.006)
    assert captured == pytest.approx(stats.capture_seconds, abs=0.006)
    assert total == pytest.approx(stats.compile_seconds + stats.capture_seconds, abs=0.006)
