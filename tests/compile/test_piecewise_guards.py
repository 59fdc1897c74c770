"""Piecewise mode serves a forward that branches on the token count from a trace per branch.

One Dynamo trace is called at every size without Dynamo's guards, so a Python branch on the token
count would be baked in. The trace's decisions on the token count are kept (its guards); captured
sizes where the first trace goes the other way get a trace of their own, size 1 always does (torch
decides size-1 questions inside its ops without a guard), an uncaptured call runs the trace that
holds at its size or eagerly (a branch failing only above the captured sizes bounds what the pieces
serve), and a forward needing too many traces is refused naming the user's line.

That is ``frontend='raw'``, passed here explicitly. With Dynamo in front (the default) its guards
decide at every call: a branch is taken at the call's real size (a trace of its own), never a
"token_count_branch" fallback; the promises both keep (each call equals eager) are checked on both.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from _tiny_modules import SeededLinear

import devgraph
from devgraph import DevgraphError


@pytest.fixture(scope="module", params=["cpu", "npu-sim"])
def device(request):
    """The CPU reference and the torch_npu simulator (module-scoped, as in test_compile_piecewise)."""
    if request.param == "cpu":
        yield devgraph.device("cpu")
        return
    from devgraph_sim.npu import simulated_torch_npu

    with simulated_torch_npu():
        yield devgraph.device("npu")


class Branching(SeededLinear):
    """A linear layer whose output changes on one side of a branch on the token count."""

    def __init__(self, branch, device="cpu") -> None:
        super().__init__(device=device)
        self.branch = branch

    def forward(self, x):
        y = self.lin(x)
        if self.branch(x.shape[0]):  # the branch under test
            return y * 2 + 1
        return y


class SpecialCasesOne(SeededLinear):
    def forward(self, x):
        if x.shape[0] == 1:  # the branch under test
            return self.lin(x) * 2
        return self.lin(x)


class SmallOnly(SeededLinear):
    def forward(self, x):
        if x.shape[0] <= 64:  # the branch under test
            return self.lin(x)
        return self.lin(x) + 1


class SqueezesTheTokenDim(SeededLinear):
    """No Python branch: ``squeeze(1)`` drops the token dim only at 1 token, a decision inside torch."""

    def forward(self, x):
        return self.lin(x).unsqueeze(0).squeeze(1).sum(0)


def _wrap(model, frontend: str = "raw", **options):
    """``devgraph.wrap(model, mode='piecewise')``: the raw trace (its one warning, what it leaves
    unguarded, filtered) or Dynamo in front."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "devgraph: .*without Dynamo's guards", UserWarning)
        return devgraph.wrap(model, mode="piecewise", frontend=frontend, **options)


def _branch_line(cls: type) -> str:
    lines, first = inspect.getsourcelines(cls.forward)
    offset = next(i for i, line in enumerate(lines) if "the branch under test" in line)
    return f"{inspect.getsourcefile(cls)}:{first + offset}"


def _x(n: int, device: str = "cpu") -> torch.Tensor:
    return torch.randn(n, 4, generator=torch.Generator().manual_seed(n)).to(device)


def _check(graphed, model, sizes, device="cpu") -> None:
    with torch.no_grad():
        for n in sizes:
            got, want = graphed(_x(n, device)), model(_x(n, device))
            assert got.shape == want.shape, f"{n} tokens"
            torch.testing.assert_close(got, want, msg=lambda m, n=n: f"{n} tokens: {m}")


#: Decode fast paths and other small-size specialisations, each a branch the first trace (at the
#: largest size) does not take at some captured size.
BRANCHES = {
    "== 1": lambda n: n == 1,
    "!= 1": lambda n: n != 1,
    "> 1": lambda n: n > 1,
    "< 2": lambda n: n < 2,
    "== 0": lambda n: n == 0,  # never true at a size the pieces run at (0 rows run eagerly)
    "<= 2": lambda n: n <= 2,
    "== 2": lambda n: n == 2,  # pins the count: the trace made at 2 is static
    ">= 3": lambda n: n >= 3,
}


@pytest.mark.parametrize("frontend", ["raw", "dynamo"])
@pytest.mark.parametrize("branch", list(BRANCHES))
def test_every_captured_size_replays_what_eager_computes(device, branch, frontend):
    model = Branching(BRANCHES[branch], device.torch_device)
    graphed = _wrap(model, frontend, device=device, capture_sizes=[1, 2, 3, 4])
    _check(graphed, model, [1, 2, 3, 4, 1, 2], device.torch_device)
    assert graphed.stats.replays == 6 and graphed.stats.fallbacks == {}


def test_a_one_token_branch_gets_a_trace_of_its_own(device):
    model = Branching(BRANCHES["== 1"], device.torch_device)
    graphed = _wrap(model, device=device, capture_sizes=[1, 2, 4])
    _check(graphed, model, [4, 1, 2, 1], device.torch_device)
    pieces = graphed.runner.pieces
    assert graphed.stats.traces == 2
    assert pieces.trace_for(1).static_size == 1 and pieces.trace_for(4) is pieces.traced
    assert all(pieces.graphs(n) for n in (1, 2, 4))


def test_size_one_is_traced_at_one_token_even_without_a_python_branch():
    # A symbolic trace keeps the token dim inductor compiled for: (1, 4) where eager gives (4,).
    model = SqueezesTheTokenDim()
    graphed = _wrap(model, device="cpu", capture_sizes=[1, 2, 4], compile_backend="inductor")
    _check(graphed, model, [1, 2, 4, 3, 1])
    assert graphed.stats.traces == 2 and graphed.stats.replays == 5


@pytest.mark.parametrize("frontend", ["raw", "dynamo"])
def test_eager_pieces_serve_size_one_from_the_one_trace_when_nothing_branches(device, frontend):
    # Eager pieces run the traced aten ops, which decide size-1 questions again at run time.
    model = Branching(lambda n: False, device.torch_device)
    graphed = _wrap(model, frontend, device=device, capture_sizes=[1, 2, 4])
    _check(graphed, model, [1, 2, 4], device.torch_device)
    assert graphed.stats.traces == 1 and graphed.stats.replays == 3


def test_a_region_of_sizes_is_served_by_one_more_trace(device):
    model = SmallOnly().to(device.torch_device)
    graphed = _wrap(model, device=device, capture_sizes=[2, 4, 8, 128])
    _check(graphed, model, [128, 2, 8, 100, 3, 130], device.torch_device)
    # the first trace (at 128) fails at 2, 4 and 8: one more trace, made at 2, holds at all three
    assert graphed.stats.traces == 2
    assert graphed.runner.pieces.trace_for(8) is graphed.runner.pieces.trace_for(2)
    assert graphed.stats.fallbacks == {"size_not_captured": 1}


def test_a_one_token_call_without_size_one_captured_runs_eagerly_where_pieces_are_compiled():
    model = SqueezesTheTokenDim()
    graphed = _wrap(model, device="cpu", capture_sizes=[2, 4], compile_backend="inductor")
    # (the padding check sees the output's shape change: a 1-token call is not padded to 2 either)
    with pytest.warns(UserWarning, match="padding_changes_result"):
        _check(graphed, model, [2, 4, 1])
    assert graphed.stats.traces == 1 and graphed.stats.replays == 2 and graphed.stats.eager_calls == 1
    assert graphed.stats.fallbacks == {"padding_changes_result": 1}


def test_a_one_token_call_without_size_one_captured_runs_eagerly():
    model = SpecialCasesOne()
    graphed = _wrap(model, device="cpu", capture_sizes=[2, 4])
    # The padding check's probe (one row padded to two) takes the one-token branch: padded sizes run
    # uncaptured; a 1-token call has no trace made at 1, so it runs eagerly (the traced pieces would
    # keep the branch of 2 tokens).
    with pytest.warns(UserWarning, match="padding_changes_result"):
        _check(graphed, model, [2, 1, 3, 4, 9, 1])
    assert graphed.stats.replays == 2
    assert graphed.stats.fallbacks == {"padding_changes_result": 3, "size_not_captured": 1}
    assert graphed.stats.eager_calls >= 2


def test_an_uncaptured_size_no_trace_holds_at_runs_eagerly_and_is_counted():
    # 100 is above the captured sizes and between the sizes the capture-time check tries (up to
    # 2 * 4 + 64, then powers of two and their neighbours): each call's size is checked again.
    model = Branching(lambda n: n == 100)
    graphed = _wrap(model, device="cpu", capture_sizes=[1, 2, 4])
    with pytest.warns(UserWarning, match="token_count_branch"):
        _check(graphed, model, [4, 100, 99, 100])
    assert graphed.stats.fallbacks == {"token_count_branch": 2, "size_not_captured": 1}


def test_a_branch_failing_above_the_captured_sizes_bounds_what_the_pieces_serve():
    model = SmallOnly()
    graphed = _wrap(model, device="cpu", capture_sizes=[2, 4])
    with torch.no_grad():
        for n in (3, 64):  # 64: uncaptured, the pieces still hold
            torch.testing.assert_close(graphed(_x(n)), model(_x(n)))
        assert graphed.stats.fallbacks == {"size_not_captured": 1}
        with pytest.warns(UserWarning, match="token_count_branch") as record:
            torch.testing.assert_close(graphed(_x(65)), model(_x(65)))  # the pieces took the <= 64 branch
    assert _branch_line(SmallOnly) in str(record[0].message)
    assert graphed.stats.fallbacks == {"size_not_captured": 1, "token_count_branch": 1}


class IndexesIn32Bits(SeededLinear):
    """The shape of inductor's guard for 32-bit indexing (an H100 run met it: the model was refused), as
    a Python branch."""

    def forward(self, x):
        if x.shape[0] * 2816 <= 2**31 - 1:  # the branch under test
            return self.lin(x)
        return self.lin(x) - 1


def test_a_guard_failing_far_above_the_captured_sizes_serves_up_to_its_exact_bound():
    model = IndexesIn32Bits()
    graphed = _wrap(model, device="cpu", capture_sizes=[2, 4])
    limit = (2**31 - 1) // 2816  # 762600: between two sampled powers of two
    with torch.no_grad():
        x = torch.ones(limit + 1, 4)
        torch.testing.assert_close(graphed(x[:2]), model(x[:2]))
        assert graphed.stats.fallbacks == {}
        torch.testing.assert_close(graphed(x[:limit]), model(x[:limit]))  # the pieces, uncaptured
        with pytest.warns(UserWarning, match="token_count_branch"):
            torch.testing.assert_close(graphed(x), model(x))  # eager: the pieces would not subtract 1
    assert graphed.stats.fallbacks == {"size_not_captured": 1, "token_count_branch": 1}


@pytest.mark.parametrize("frontend", ["raw", "dynamo"])
def test_a_branch_between_captured_sizes_is_served_by_a_trace_per_side(frontend):
    model = SmallOnly()
    graphed = _wrap(model, frontend, device="cpu", capture_sizes=[2, 128])
    with torch.no_grad():
        for n in (2, 3, 64, 65, 128):
            torch.testing.assert_close(graphed(_x(n)), model(_x(n)))
    assert graphed.stats.traces == 2


class BranchesAtFewSizes(Branching):
    def forward(self, x):
        n = x.shape[0]
        if n == 2:  # the branch under test
            return self.lin(x) + 1
        if n == 3:
            return self.lin(x) + 2
        if n == 5:
            return self.lin(x) + 3
        if n == 7:
            return self.lin(x) + 4
        return self.lin(x)


def test_a_branch_needing_too_many_traces_is_refused_naming_the_line():
    # traces at 8, and at 2, 3 and 5 (each pinned): 7 would need a fifth
    graphed = _wrap(BranchesAtFewSizes(None), device="cpu", capture_sizes=[1, 2, 3, 5, 7, 8])
    with pytest.raises(DevgraphError, match="branches on the token count") as info:
        graphed.capture(_x(2))
    assert _branch_line(BranchesAtFewSizes) in str(info.value)
    assert "capture_sizes without 2" in str(info.value)
    assert not graphed.runner.captured


def test_a_pinned_size_is_traced_at_that_size():
    model = Branching(BRANCHES["== 2"])
    graphed = _wrap(model, device="cpu", capture_sizes=[2, 4, 8])
    with pytest.warns(UserWarning, match="padding_changes_result"):  # 2 rows padded to 4 differ
        _check(graphed, model, [8, 2, 4, 3])
    assert graphed.stats.traces == 2 and graphed.runner.pieces.trace_for(2).static_size == 2
    assert graphed.stats.replays == 3 and graphed.stats.fallbacks == {"padding_changes_result": 1}


def test_full_mode_captures_each_branch_per_batch_size():
    model = SpecialCasesOne()
    graphed = devgraph.wrap(model, device="cpu", batch_sizes=[1, 2, 4])
    with torch.no_grad():
        for n in (1, 2, 3):
            torch.testing.assert_close(graphed(_x(n)), model(_x(n)))


@pytest.mark.parametrize(
    ("make", "sizes", "capture_sizes"),
    [
        (SpecialCasesOne, [2, 1, 3, 4, 9, 1], [2, 4]),
        (SmallOnly, [3, 64, 65], [2, 4]),
        (lambda: Branching(lambda n: n == 100), [4, 100, 99, 100], [1, 2, 4]),
        (lambda: BranchesAtFewSizes(None), [2, 3, 5, 7, 8, 4], [1, 2, 3, 5, 7, 8]),
    ],
    ids=["one_token", "above_the_captured_sizes", "uncaptured_size", "many_branches"],
)
def test_with_dynamo_in_front_each_call_takes_the_branch_of_its_own_size(make, sizes, capture_sizes):
    # What the raw trace's tests above refuse or run eagerly (token_count_branch): Dynamo's guards
    # fail at the call's size, which gets a trace of its own; nothing is baked in, nothing refused.
    model = make()
    graphed = _wrap(model, "dynamo", device="cpu", capture_sizes=capture_sizes)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _check(graphed, model, sizes)
    assert "token_count_branch" not in graphed.stats.fallbacks
    assert not [w for w in record if "token_count_branch" in str(w.message)]
