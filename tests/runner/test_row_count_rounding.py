"""Row-count rounding: measured at capture, kept in ``stats``, reported once, never a fallback.

The models round by row count by construction (``+ 1 - 1`` from 4 rows up drops low bits, as a GEMM
kernel chosen by the row count rounds otherwise), so the tests do not depend on which kernels this
CPU picks (they pass with and without ``ATEN_CPU_CAPABILITY=avx2``). Each fails for a deliberately
broken version: the report dropped or logged at every capture, ``stats`` not kept, the rounding
counted as a padding refusal, one fill measured only, a tolerance in place of bit for bit, NaN on
both sides counted as a difference (and, with tests/test_docs.py, the report's promise reworded).
"""

from __future__ import annotations

import logging
import warnings

import torch

import devgraph
from devgraph.runner import RowCountRounding
from devgraph.runner._rounding import PROMISE, measure


class RoundsByRowCount(torch.nn.Module):
    """Rows stay independent, but from 4 rows up each value is rounded once more."""

    def forward(self, x):
        y = x * 2
        return (y + 1) - 1 if x.shape[0] >= 4 else y


class MixesRowsSlightly(torch.nn.Module):
    """Each row moves by 1e-6 of the batch's column sums: rows mix, below float32's tolerance 1e-5."""

    def forward(self, x):
        return x + 1e-6 * x.sum(0)


class AddsColumnSums(torch.nn.Module):
    def forward(self, x):
        return x + x.sum(0)


def _rows(n: int) -> torch.Tensor:
    return torch.randn(n, 5, generator=torch.Generator().manual_seed(n))


def _reports(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "row-count rounding" in r.getMessage()]


def test_planted_rounding_is_measured_kept_in_stats_reported_once_and_still_replayed(caplog):
    model = RoundsByRowCount()
    # raw: the forward runs as written on the padded batch, so the planted branch on the row count
    # rounds (Dynamo takes the branch on the call's real size: see the test below)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*captures the forward as it runs, untraced")
        graphed = devgraph.wrap(model, device="cpu", batch_sizes=[4], frontend="raw")
    x = _rows(3)
    with caplog.at_level(logging.INFO, logger="devgraph"), torch.no_grad():
        out = graphed(x).clone()
        graphed(x)
        graphed.capture(x)  # captured again: measured again, not reported again
        graphed(x)
    padded, copies = torch.cat([x, torch.zeros(1, 5)]), torch.cat([x, x[:1]])
    worst = max(float((model(p)[:3] - model(x)).abs().max()) for p in (padded, copies))
    assert worst > 0
    assert graphed.stats.row_count_rounding == (RowCountRounding(3, 4, worst, 0, 0.0),)
    assert graphed.stats.fallbacks == {} and graphed.stats.replays == 3  # not a refusal
    assert torch.equal(out, model(padded)[:3])  # bit for bit eager on the padded batch...
    assert not torch.equal(out, model(x))  # ...not on the call's own rows
    (record,) = _reports(caplog)
    message = record.getMessage()
    assert record.levelno == logging.INFO and record.name == "devgraph"
    assert f"3 rows padded to 4: up to {worst:.2g} (output leaf 0)" in message
    assert "depend on the padding rows' count, not on their values" in message
    assert PROMISE[:-1] + " (batch_sizes=[...])" in message


def test_a_branch_on_the_row_count_is_taken_on_the_calls_rows_through_dynamo(caplog):
    model = RoundsByRowCount()
    graphed = devgraph.wrap(model, device="cpu", batch_sizes=[4])
    x = _rows(3)
    with caplog.at_level(logging.INFO, logger="devgraph"), torch.no_grad():
        out = graphed(x)
    assert torch.equal(out, model(x))  # the 3-row branch, bit for bit
    assert graphed.stats.row_count_rounding == () and graphed.stats.fallbacks == {} and not _reports(caplog)


def test_buckets_equal_to_the_sizes_called_are_bitwise_and_report_nothing(caplog):
    model = RoundsByRowCount()
    graphed = devgraph.wrap(model, device="cpu", batch_sizes=[2, 3, 4])  # 1 row in 2 is still checked
    with caplog.at_level(logging.INFO, logger="devgraph"), torch.no_grad():
        for n in (3, 4, 2):
            x = _rows(n)
            assert torch.equal(graphed(x), model(x)), n
    assert graphed.stats.replays == 3 and graphed.stats.fallbacks == {}
    assert graphed.stats.row_count_rounding == () and _reports(caplog) == []


def test_a_padded_call_of_a_model_that_does_not_round_by_row_count_is_bitwise_and_reports_nothing(caplog):
    model = torch.nn.ReLU()
    graphed = devgraph.wrap(model, device="cpu", batch_sizes=[4, 8])
    with caplog.at_level(logging.INFO, logger="devgraph"), torch.no_grad():
        for n in (3, 5):
            x = _rows(n)
            assert torch.equal(graphed(x), model(x)), n
    assert graphed.stats.row_count_rounding == () and _reports(caplog) == []


def test_rows_that_mix_below_the_tolerance_are_reported_as_such_not_as_rounding(caplog):
    graphed = devgraph.wrap(MixesRowsSlightly(), device="cpu", batch_sizes=[4])
    with caplog.at_level(logging.INFO, logger="devgraph"), torch.no_grad():
        graphed(_rows(3))
    (found,) = graphed.stats.row_count_rounding
    assert (found.rows, found.bucket) == (3, 4) and found.from_pad_values > 0  # copies of row 0 add to it
    assert graphed.stats.fallbacks == {}  # within the padding check's tolerance, as before
    (record,) = _reports(caplog)
    assert "the real rows also change with the padding rows' values" in record.getMessage()


def test_a_model_whose_padding_changes_the_result_runs_padded_calls_eagerly_and_reports_no_rounding(caplog):
    graphed = devgraph.wrap(AddsColumnSums(), device="cpu", batch_sizes=[4])
    with caplog.at_level(logging.INFO, logger="devgraph"), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graphed(_rows(3))
    assert graphed.stats.fallbacks == {"padding_changes_result": 1}
    assert graphed.stats.row_count_rounding == () and _reports(caplog) == []


def test_measure_counts_nan_on_both_sides_and_equal_infinities_as_equal_in_the_outputs_dtype():
    row = torch.tensor([[float("nan"), float("inf"), 1.0]], dtype=torch.bfloat16)
    pad = torch.cat([row, torch.zeros(1, 3, dtype=torch.bfloat16)])
    assert measure([row], ([pad], [torch.cat([row, row])]), [0], 1, 2) is None
    moved = pad.clone()
    moved[0, 2] = 1.0078125  # one bfloat16 step above 1
    found = measure([row, 7], ([moved, 7], [pad, 7]), [0, None], 1, 2)
    assert found == RowCountRounding(1, 2, 0.0078125, 0, 0.0078125)
