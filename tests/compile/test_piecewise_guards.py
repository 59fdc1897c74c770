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


def test_a_branch_failing_above_the_captured_sizes_is_refused():
    graphed = devgraph.wrap(SmallOnly(), device="cpu", mode="piecewise", capture_sizes=[2, 4])
    with pytest.raises(DevgraphError, match="branches on the token count") as info:
        graphed(_x(3))  # a 100-token call would run the pieces uncaptured, with the <= 64 branch
    assert _branch_line(SmallOnly) in str(info.value)
    assert "mode='full'" in str(info.value)


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
