"""Fixtures of the SGLang adapter's tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def fresh_stats():
    """The devgraph SGLang backend's counters, reset before and after the test; yields the function
    that reads them (``_stats.stats``)."""
    from devgraph.adapters.sglang import _stats

    _stats.reset()
    yield _stats.stats
    _stats.reset()
