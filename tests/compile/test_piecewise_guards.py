"""Piecewise mode refuses a forward that branches on the token count where the pieces run.

One Dynamo trace serves every size, called without Dynamo's guards; a Python branch on the token
count would be baked in. The trace is refused, naming the user's line, when the branch goes the
other way at a size the pieces run at (a captured size, or any size above the largest).
"""

from __future__ import annotations

import inspect

import pytest
import torch

import devgraph
from devgraph import DevgraphError


class SpecialCasesOne(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        if x.shape[0] == 1:  # the branch under test
            return self.lin(x) * 2
        return self.lin(x)


class SmallOnly(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        if x.shape[0] <= 64:  # the branch under test
            return self.lin(x)
        return self.lin(x) + 1


def _branch_line(cls: type) -> str:
    lines, first = inspect.getsourcelines(cls.forward)
    offset = next(i for i, line in enumerate(lines) if "the branch under test" in line)
    return f"{inspect.getsourcefile(cls)}:{first + offset}"


def _x(n: int) -> torch.Tensor:
    return torch.randn(n, 4, generator=torch.Generator().manual_seed(n))


def test_a_branch_on_one_token_is_refused_when_one_token_is_captured():
    graphed = devgraph.wrap(SpecialCasesOne(), device="cpu", mode="piecewise", capture_sizes=[1, 2, 4])
    with pytest.raises(DevgraphError, match="branches on the token count") as info:
        graphed(_x(3))
    assert _branch_line(SpecialCasesOne) in str(info.value)
    assert "x.shape[0] == 1" in str(info.value) and "capture_sizes without 1" in str(info.value)


def test_a_branch_failing_above_the_captured_sizes_bounds_the_trace():
    model = SmallOnly()
    graphed = devgraph.wrap(model, device="cpu", mode="piecewise", capture_sizes=[2, 4])
    with torch.no_grad():
        for n in (3, 64):  # 64: uncaptured, the pieces still hold
            torch.testing.assert_close(graphed(_x(n)), model(_x(n)))
        assert graphed.stats.fallbacks == {"size_not_captured": 1}
        with pytest.warns(UserWarning, match="size_beyond_trace") as record:
            torch.testing.assert_close(graphed(_x(65)), model(_x(65)))  # the pieces took the <= 64 branch
    bound = graphed.runner.pieces.bound
    assert bound is not None and bound.tokens == 64 and _branch_line(SmallOnly) in bound.where
    assert "tokens <= 64" in str(record[0].message)
    assert graphed.stats.fallbacks == {"size_not_captured": 1, "size_beyond_trace": 1}


class IndexesIn32Bits(torch.nn.Module):
    """The shape of inductor's guard for 32-bit indexing (a CUDA run met it), as a Python branch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        if x.shape[0] * 2816 <= 2**31 - 1:  # the branch under test
            return self.lin(x)
        return self.lin(x) - 1


def test_the_bound_is_the_exact_last_count_the_guard_holds_for():
    model = IndexesIn32Bits()
    graphed = devgraph.wrap(model, device="cpu", mode="piecewise", capture_sizes=[2, 4])
    limit = (2**31 - 1) // 2816  # 762600: between two sampled powers of two
    with torch.no_grad():
        graphed(_x(2))
        assert graphed.runner.pieces.bound.tokens == limit
        x = torch.ones(limit + 1, 4)
        assert graphed.stats.fallbacks == {}
        torch.testing.assert_close(graphed(x[:limit]), model(x[:limit]))  # the pieces, uncaptured
        with pytest.warns(UserWarning, match="size_beyond_trace"):
            torch.testing.assert_close(graphed(x), model(x))  # eager: the pieces would not subtract 1
    assert graphed.stats.fallbacks == {"size_not_captured": 1, "size_beyond_trace": 1}


def test_a_bound_below_a_captured_size_is_refused():
    graphed = devgraph.wrap(SmallOnly(), device="cpu", mode="piecewise", capture_sizes=[2, 128])
    with pytest.raises(DevgraphError, match="branches on the token count") as info:
        graphed(_x(3))
    assert _branch_line(SmallOnly) in str(info.value) and "mode='full'" in str(info.value)


def test_refused_when_capturing_explicitly_too():
    graphed = devgraph.wrap(SpecialCasesOne(), device="cpu", mode="piecewise", capture_sizes=[1, 4])
    with pytest.raises(DevgraphError, match="branches on the token count"):
        graphed.capture(_x(2))
    assert not graphed.runner.captured


def test_a_branch_at_sizes_the_pieces_never_run_at_is_accepted():
    model = SpecialCasesOne()
    graphed = devgraph.wrap(model, device="cpu", mode="piecewise", capture_sizes=[2, 4])
    # The padding check's probe (one row padded to two) takes the one-token branch, so the padded
    # size 3 is served eagerly, correctly and with a warning; the captured sizes replay.
    with torch.no_grad(), pytest.warns(UserWarning, match="padding_changes_result"):
        for n in (2, 3, 4, 9):  # 9: above the captured sizes, uncaptured
            torch.testing.assert_close(graphed(_x(n)), model(_x(n)))
    assert graphed.stats.replays == 2
    assert graphed.stats.fallbacks == {"padding_changes_result": 1, "size_not_captured": 1}


def test_full_mode_captures_each_branch_per_batch_size():
    model = SpecialCasesOne()
    graphed = devgraph.wrap(model, device="cpu", batch_sizes=[1, 2, 4])
    with torch.no_grad():
        for n in (1, 2, 3):
            torch.testing.assert_close(graphed(_x(n)), model(_x(n)))
