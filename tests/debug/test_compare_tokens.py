"""compare_tokens: identical, or the first flip with both runs' margins and whether it is a near-tie."""

from __future__ import annotations

import math

import pytest
import torch

import devgraph
from devgraph import DevgraphError
from devgraph.debug import compare_tokens, top2_margin


def test_identical_tokens():
    c = devgraph.compare_tokens([1, 2, 3], torch.tensor([1, 2, 3]))
    assert c.identical and c.position is None
    assert c.text() == "tokens identical"


def test_first_flip_reports_margins_of_both_runs():
    eager_logits = torch.tensor([[5.0, 0.0, 0.0], [0.0, 2.0, 2.01]])
    graphed_logits = torch.tensor([[5.0, 0.0, 0.0], [0.0, 2.02, 2.0]])
    c = compare_tokens([0, 1], [0, 2], graphed_logits=graphed_logits, eager_logits=eager_logits)
    assert not c.identical and c.position == 1
    assert (c.graphed_token, c.eager_token) == (1, 2)
    assert c.graphed_margin == pytest.approx(0.02, abs=1e-5)
    assert c.eager_margin == pytest.approx(0.01, abs=1e-5)
    assert c.near_tie is True
    assert "position 1" in c.text() and "near-tie" in c.text()


def test_a_decided_run_is_not_a_near_tie():
    c = compare_tokens(
        [0, 1], [0, 2], graphed_logits=[[9, 0, 0], [0, 9, 0]], eager_logits=[[9, 0, 0], [0, 2.0, 2.01]]
    )
    assert c.near_tie is False


def test_a_shorter_sequence_differs_where_it_ends():
    c = compare_tokens([4, 5], [4, 5, 6])
    assert c.position == 2 and c.graphed_token is None and c.eager_token == 6
    assert c.near_tie is None  # no logits, no verdict


def test_margin_is_top1_minus_top2_log_probability():
    logits = torch.tensor([1.0, 3.0, 2.0])
    assert top2_margin(logits) == pytest.approx(1.0)
    assert math.isclose(top2_margin([0.0, 0.0]), 0.0)


@pytest.mark.parametrize("bad", [["a"], [[1, 2]], None])
def test_tokens_that_are_not_ids_are_refused(bad):
    with pytest.raises(DevgraphError, match="sequence of token ids"):
        compare_tokens(bad, [1])


def test_negative_threshold_is_refused():
    with pytest.raises(DevgraphError, match="threshold"):
        compare_tokens([1], [2], threshold=-1)
