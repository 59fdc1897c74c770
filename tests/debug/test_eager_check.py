"""DEVGRAPH_COMPARE_EAGER: the adapters' sampled graphed-vs-eager check, and its hooks on their own."""

from __future__ import annotations

import dataclasses
import importlib
import types

import pytest
import torch

import devgraph
from devgraph import DevgraphError
from devgraph.debug import eager_check_from_env


@pytest.mark.parametrize("value", ["", "0", "off"])
def test_off_by_default(value):
    assert eager_check_from_env("x", {}) is None
    assert eager_check_from_env("x", {"DEVGRAPH_COMPARE_EAGER": value}) is None


@pytest.mark.parametrize("value", ["-1", "two", "1.5"])
def test_bad_values_name_the_variable(value):
    with pytest.raises(DevgraphError, match="DEVGRAPH_COMPARE_EAGER"):
        eager_check_from_env("x", {"DEVGRAPH_COMPARE_EAGER": value})


def test_every_nth_step_is_sampled():
    check = eager_check_from_env("x", {"DEVGRAPH_COMPARE_EAGER": "3"})
    assert [check.due() for _ in range(6)] == [False, False, True, False, False, True]


def test_a_flipped_row_is_reported_with_its_margins(caplog):
    check = eager_check_from_env("x", {"DEVGRAPH_COMPARE_EAGER": "1"})
    graphed = torch.tensor([[3.0, 0.0], [1.0, 1.001]])
    eager = torch.tensor([[3.0, 0.0], [1.001, 1.0]])
    check.due()
    with caplog.at_level("WARNING", logger="devgraph.debug"):
        result = check.compare(graphed, lambda: eager, real_rows=None)
    assert result.rows == 2 and [row for row, _ in result.flips] == [1]
    assert result.flips[0][1].near_tie is True
    assert result.max_abs == pytest.approx(0.001, abs=1e-6)
    assert "row 1" in caplog.text and "near-tie" in caplog.text
    assert list(check.results) == [result]


def test_identical_steps_report_no_flips():
    check = eager_check_from_env("x", {"DEVGRAPH_COMPARE_EAGER": "1"})
    out = torch.tensor([[1.0, 2.0]])
    result = check.compare(out, lambda: out.clone(), real_rows=None)
    assert result.flips == () and result.max_abs == 0


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_adapter_hook_is_off_unless_asked(engine, monkeypatch):
    hook = importlib.import_module(f"devgraph.adapters.{engine}._compare_eager")
    monkeypatch.delenv("DEVGRAPH_COMPARE_EAGER", raising=False)
    assert hook.configure() is None and hook.CHECK is None


class _Model(torch.nn.Module):
    """A decode step standing in for vLLM's model (its output is the logits)."""

    def forward(self, x, shift):
        return x * 1.0 + shift

    def compute_logits(self, hidden):
        return hidden


def test_vllm_hook_runs_the_runnable_eagerly_and_bisects_a_real_flip(monkeypatch):
    hook = importlib.import_module("devgraph.adapters.vllm._compare_eager")
    model = _Model()
    calls = []
    model.register_forward_pre_hook(lambda m, a: calls.append(a))
    wrapper = types.SimpleNamespace(runnable=model, device=devgraph.device("cpu"))
    x = torch.tensor([[0.0, 1.0], [2.0, 1.0]])
    monkeypatch.setenv("DEVGRAPH_COMPARE_EAGER", "2")
    try:
        check = hook.configure()
        replayed = torch.tensor([[0.0, 1.0], [0.9, 1.0]])  # row 1 flips its greedy token, far from a tie
        hook.replayed(wrapper, replayed, (x, 0.0), {})
        assert calls == []  # step 1 is not sampled
        hook.replayed(wrapper, replayed, (x, 0.0), {})
        (result,) = check.results
        assert [row for row, _ in result.flips] == [1]
        assert result.flips[0][1].near_tie is False
        assert result.bisect is not None and result.bisect.ops_compared > 0  # the step was bisected
        assert "devgraph bisect" in result.text()
    finally:
        monkeypatch.delenv("DEVGRAPH_COMPARE_EAGER")
        hook.configure()


def test_a_near_tie_flip_is_not_bisected():
    check = eager_check_from_env("x", {"DEVGRAPH_COMPARE_EAGER": "1"})
    bisected = []
    result = check.compare(
        torch.tensor([[1.0, 1.001]]),
        lambda: torch.tensor([[1.001, 1.0]]),
        bisect=lambda: bisected.append(1),
        real_rows=None,
    )
    assert result.flips and result.bisect is None and bisected == []


@pytest.mark.parametrize(
    ("bisect_on", "graphed", "eager", "bisected"),
    [
        ("difference", [[1.0, 2.0]], [[1.0, 2.5]], True),  # no flip, but a difference
        ("difference", [[1.0, 2.0]], [[1.0, 2.0]], False),  # identical: nothing to explain
        ("flip", [[1.0, 2.0]], [[1.0, 2.5]], False),  # the default: only a flip that is no near-tie
        ("never", [[0.0, 5.0]], [[5.0, 0.0]], False),
    ],
)
def test_bisect_on_says_which_steps_are_bisected(bisect_on, graphed, eager, bisected):
    env = {"DEVGRAPH_COMPARE_EAGER": "1", "DEVGRAPH_COMPARE_EAGER_BISECT": bisect_on}
    check = eager_check_from_env("x", env)
    calls = []
    check.compare(
        torch.tensor(graphed), lambda: torch.tensor(eager), bisect=lambda: calls.append(1), real_rows=None
    )
    assert bool(calls) is bisected


def test_bad_bisect_on_names_the_variable_and_the_choices():
    with pytest.raises(
        DevgraphError, match=r"DEVGRAPH_COMPARE_EAGER_BISECT='sometimes'.*flip.*difference.*never"
    ):
        eager_check_from_env(
            "x", {"DEVGRAPH_COMPARE_EAGER": "1", "DEVGRAPH_COMPARE_EAGER_BISECT": "sometimes"}
        )


def test_a_failing_bisect_is_logged_not_raised(caplog):
    check = eager_check_from_env("x", {"DEVGRAPH_COMPARE_EAGER": "1"})

    def broken():
        raise RuntimeError("no capture here")

    with caplog.at_level("WARNING", logger="devgraph"):
        result = check.compare(
            torch.tensor([[0.0, 5.0]]), lambda: torch.tensor([[5.0, 0.0]]), bisect=broken, real_rows=None
        )
    assert result.bisect is None and "no capture here" in caplog.text


def test_sglang_hook_reruns_the_captured_forward_of_the_shape(monkeypatch):
    hook = importlib.import_module("devgraph.adapters.sglang._compare_eager")

    @dataclasses.dataclass
    class Output:  # SGLang's LogitsProcessorOutput is a dataclass
        next_token_logits: torch.Tensor

    class Backend:
        device = devgraph.device("cpu")

    backend = Backend()
    eager = Output(torch.tensor([[1.0, 0.0]]))
    monkeypatch.setenv("DEVGRAPH_COMPARE_EAGER", "1")
    try:
        check = hook.configure()
        hook.remember(backend, 4, lambda: eager)
        hook.replayed(backend, 4, Output(torch.tensor([[0.0, 1.0]])))
        hook.replayed(backend, 8, Output(torch.tensor([[0.0, 1.0]])))  # no forward kept: skipped
        (result,) = check.results
        assert result.flips and result.flips[0][1].graphed_token == 1
        from devgraph.adapters.sglang import _stats

        entry = _stats.stats().eager_checks[-1]
        assert {k: entry[k] for k in ("step", "max_abs", "rows", "flips")} == {
            "step": 1,
            "max_abs": 1.0,
            "rows": 1,
            "flips": 1,
        }
        assert entry["margins"] == [[1.0, 1.0, False]]  # graphed and eager margins, not a near-tie
    finally:
        monkeypatch.delenv("DEVGRAPH_COMPARE_EAGER")
        hook.configure()


def test_padding_rows_are_left_out_only_when_the_caller_names_the_real_rows():
    """Every caller says which rows are real (``real_rows`` has no default): padding rows an eager
    kernel leaves unwritten would otherwise show as differences (vLLM's FULL steps did)."""
    check = eager_check_from_env("x", {"DEVGRAPH_COMPARE_EAGER": "1"})
    graphed = torch.tensor([[0.0, 5.0], [5.0, 0.0], [7.0, 7.0]])  # row 2: padding, garbage
    eager = torch.tensor([[0.0, 5.0], [5.0, 0.0], [0.0, 0.0]])
    assert check.compare(graphed, lambda: eager, real_rows=2).max_abs == 0
    assert check.compare(graphed, lambda: eager, real_rows=None).max_abs == 7
    with pytest.raises(TypeError, match="real_rows"):
        check.compare(graphed, lambda: eager)
