"""Eager's poison for memory no op wrote is told from every other NaN, bit for bit."""

from __future__ import annotations

import pytest
import torch

from devgraph.debug._compare import diff_tensors
from devgraph.debug._poison import fill_poison, new_run

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_graph_row_holding_an_earlier_runs_poison_or_a_plain_nan_differs(dtype):
    # The flake this closes: the capture was handed memory an earlier poisoned eager run had freed,
    # so the graph's unwritten row read NaN as eager's did, and the op passed unseen.
    earlier, run = new_run(), new_run()
    eager = torch.ones(4, 3, dtype=dtype)
    fill_poison(eager[3], run)  # the padding row eager left unwritten
    for held in ("earlier poison", "plain nan"):
        graph = torch.ones(4, 3, dtype=dtype)
        if held == "earlier poison":
            fill_poison(graph[3], earlier)
        else:
            graph[3] = float("nan")
        d = diff_tensors(graph, eager)
        assert d.max_abs == float("inf") and d.where[0] == 3, held


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_same_runs_poison_and_computed_nans_count_as_equal(dtype):
    run = new_run()
    a, b = torch.ones(2, 3, dtype=dtype), torch.ones(2, 3, dtype=dtype)
    fill_poison(a[1], run)
    fill_poison(b[1], run)  # the noise floor: two eager runs left the same row unwritten
    assert diff_tensors(a, b).max_abs == 0
    a[1], b[1] = float("nan"), float("nan")  # both computed NaN there: no poison on either side
    assert diff_tensors(a, b).max_abs == 0


def test_integer_outputs_are_left_as_they_are():
    t = torch.arange(4)
    fill_poison(t, new_run())
    assert t.tolist() == [0, 1, 2, 3]
