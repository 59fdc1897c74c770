"""The backend conformance suite over every backend CI can run (cpu, npu via the simulator)."""

from __future__ import annotations

import pytest

import devgraph
from devgraph.testing.conformance import CHECKS, NotApplicable


def _available():
    return [b.name for b in devgraph.backends() if b.available]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_conformance(any_device, check):
    try:
        check(any_device)
    except NotApplicable as why:
        pytest.skip(str(why))


@pytest.mark.parametrize("backend", [n for n in _available() if n != "cpu"])
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_conformance_on_other_available_backends(backend, check):
    """cuda on a GPU machine, a real npu, or an installed third-party backend."""
    try:
        check(devgraph.device(backend))
    except NotApplicable as why:
        pytest.skip(str(why))
