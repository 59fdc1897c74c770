"""The padding check's own parts, each needed: a broken version of any of them serves a wrong value.

Each test here fails for one deliberately broken padding check or load (issue 32's mutants): trying
only the largest padded bucket, ignoring either fill (the pad values, copies of the first row), a
float32 tolerance loosened from 1e-5 to 1e-1, a model's write of its input without a version bump
not seen, and rows above the current bucket forgotten.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import devgraph


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def _served_like_eager(model, sizes, rows, make=None, **options):
    graphed = _quiet(devgraph.wrap, model, device="cpu", batch_sizes=sizes, **options)
    for n in rows:
        x = make(n) if make else torch.randn(n, 4, generator=torch.Generator().manual_seed(n))
        torch.testing.assert_close(_quiet(graphed, x), model(x), msg=f"{n} rows")
    return graphed


class MixesWhenSmall(torch.nn.Module):
    """Rows mix only in batches of at most 2: only the smallest padded bucket shows it."""

    def forward(self, x):
        return x - x.mean(0) if x.shape[0] <= 2 else x * 1.0


@pytest.mark.parametrize("frontend", ["raw", "dynamo"])
def test_the_smallest_padded_bucket_is_checked_too(frontend):
    graphed = _served_like_eager(MixesWhenSmall(), [2, 8], [1, 5], frontend=frontend)
    if frontend == "raw":
        assert graphed.stats.fallbacks == {"padding_changes_result": 2}  # padded calls run eagerly
    else:  # Dynamo takes the branch on the call's real size (1 row: a graph of its own; 5: x * 1.0)
        assert graphed.stats.fallbacks == {} and graphed.stats.replays == 2


class AddsColumnSums(torch.nn.Module):
    """Zero pad rows add nothing to a sum over the batch; copies of the first row do."""

    def forward(self, x):
        return x + x.sum(0)


class ScalesByColumnMin(torch.nn.Module):
    """Copies of the first row leave the batch minimum as it is; zero pad rows (below the positive
    inputs) change it."""

    def forward(self, x):
        return x * x.min(0).values


def test_padding_with_copies_of_the_first_row_is_checked():
    graphed = _served_like_eager(AddsColumnSums(), [4], [3])
    assert graphed.stats.fallbacks == {"padding_changes_result": 1}


def test_padding_with_the_pad_values_is_checked():
    graphed = _served_like_eager(ScalesByColumnMin(), [4], [3], make=lambda n: torch.rand(n, 4) + 1)
    assert graphed.stats.fallbacks == {"padding_changes_result": 1}


class CountsRowsSlightly(torch.nn.Module):
    """Each row's output moves by 1e-3 per row of the batch: within 1e-1, far outside float32's 1e-5."""

    def forward(self, x):
        return x + 1e-3 * x.shape[0]


def test_a_float32_difference_of_1e_3_is_caught():
    graphed = _served_like_eager(CountsRowsSlightly(), [4], [3])
    assert graphed.stats.fallbacks == {"padding_changes_result": 1}


class BumpsItsSlots(torch.nn.Module):
    """Writes a cache at each row's slot, then moves its slot input on by one through ``.data`` (no
    version bump, as an extension kernel writes): the static buffer's padding rows then point at a
    real slot unless the runner, having seen the write at capture, pads them again every call."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.arange(8.0))

    def forward(self, x, slot):
        self.cache.index_copy_(0, slot, x)
        slot.data.add_(1)
        return x * 2


def test_an_input_written_without_a_version_bump_is_padded_every_call():
    model = BumpsItsSlots()
    graphed = devgraph.wrap(model, device="cpu", batch_sizes=[4], pad_values={"slot": 0})
    graphed(torch.tensor([50.0, 60.0]), torch.tensor([5, 6]))  # rows 2 and 3 are padding: slot 0
    assert model.cache.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 50.0, 60.0, 7.0]
