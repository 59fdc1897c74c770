"""Bucket choice and padding arithmetic (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from devgraph import DevgraphError
from devgraph.runner import choose_bucket, default_batch_sizes, normalise_batch_sizes


@given(st.integers(1, 2048))
def test_default_sizes_are_sorted_unique_and_end_at_max(max_bs):
    sizes = default_batch_sizes(max_bs)
    assert sizes == sorted(set(sizes))
    assert sizes[-1] == max_bs and sizes[0] == 1


@given(st.integers(9, 2048))
def test_default_sizes_start_like_sglang(max_bs):
    assert default_batch_sizes(max_bs)[:4] == [1, 2, 4, 8]


@given(st.lists(st.integers(1, 512), min_size=1, max_size=20), st.integers(1, 600))
def test_chosen_bucket_is_the_smallest_that_fits(sizes, n):
    sizes = normalise_batch_sizes(sizes, None)
    bucket = choose_bucket(n, sizes)
    if n > sizes[-1]:
        assert bucket is None
    else:
        assert bucket is not None and bucket >= n
        assert all(s < n for s in sizes if s < bucket)


def test_max_batch_size_is_always_captured():
    assert normalise_batch_sizes([1, 2, 4], 6) == [1, 2, 4, 6]


def test_max_batch_size_below_buckets_is_an_error():
    with pytest.raises(DevgraphError, match="max_batch_size=2 is below"):
        normalise_batch_sizes([1, 4], 2)


@pytest.mark.parametrize("bad", [[], [0, 1], [-3]])
def test_non_positive_buckets_are_an_error(bad):
    with pytest.raises(DevgraphError, match="positive"):
        normalise_batch_sizes(bad, None)


def test_zero_rows_choose_no_bucket():
    assert choose_bucket(0, [1, 2]) is None
