"""Capture freezes garbage collection and gives the application back exactly the gc state it had.

What is frozen is read from the application's own objects (``_unfrozen``), not from
``gc.get_freeze_count()`` alone: on CPython 3.12 the permanent generation also holds the immortal
objects the collector moved there, so that count is never 0.
"""

from __future__ import annotations

import gc
import threading

import pytest
import torch

import devgraph

#: per Probe (by id), gc's state at each run: kept outside the model, whose own state capture puts back
_SEEN: dict[int, list[tuple[bool, int]]] = {}


class Probe(torch.nn.Module):
    """Records gc's state each time it runs (warm-ups and capture run inside the capture loop)."""

    @property
    def seen(self) -> list[tuple[bool, int]]:
        return _SEEN.setdefault(id(self), [])

    def forward(self, x):
        self.seen.append((gc.isenabled(), gc.get_freeze_count()))
        return x * 2


def _capture(model=None, **options) -> Probe:
    model = model or Probe()
    devgraph.wrap(model, device="cpu", batch_sizes=[1, 2], **options).capture(torch.ones(1, 3))
    return model


@pytest.fixture
def gc_restored():
    """Whatever a test does to gc, the next test starts with it enabled and nothing frozen."""
    yield
    gc.unfreeze()
    gc.enable()


class LongLived:
    """An application object gc tracks (the kind ``gc.freeze()`` exempts from collections)."""


def _unfrozen(objects) -> int:
    """How many of ``objects`` gc would scan again (frozen ones are in no generation)."""
    scanned = {id(o) for o in gc.get_objects()}
    return sum(id(o) in scanned for o in objects)


def test_capture_keeps_the_applications_own_frozen_objects_frozen(gc_restored):
    survivors = [LongLived() for _ in range(100)]
    gc.collect()
    gc.freeze()  # as vLLM and SGLang do after start-up
    assert _unfrozen(survivors) == 0
    _capture()
    assert _unfrozen(survivors) == 0


def test_capture_leaves_a_disabled_gc_disabled(gc_restored):
    gc.disable()
    _capture()
    assert not gc.isenabled()


def test_capture_leaves_an_enabled_gc_enabled_with_nothing_frozen(gc_restored):
    survivors = [LongLived() for _ in range(100)]
    gc.collect()
    before = gc.get_freeze_count()  # the interpreter's own (CPython 3.12), else 0
    _capture()
    assert gc.isenabled() and _unfrozen(survivors) == len(survivors)
    assert gc.get_freeze_count() <= before


class SeesSurvivors(Probe):
    """Records, each time it runs, whether gc is on and how many of ``survivors`` it would scan."""

    def __init__(self, survivors) -> None:
        super().__init__()
        self.survivors = survivors

    def forward(self, x):
        self.seen.append((gc.isenabled(), _unfrozen(self.survivors)))
        return x * 2


def test_capture_runs_with_collection_off_and_live_objects_frozen(gc_restored):
    survivors = [LongLived() for _ in range(100)]
    # raw: every run of the forward is one of the capture loop's (warm-ups and capture); through
    # Dynamo the forward also runs as Python while Dynamo traces it, outside the capture loop
    with pytest.warns(UserWarning, match="untraced"):
        model = _capture(SeesSurvivors(survivors), frontend="raw")
    assert model.seen and all(not enabled and unfrozen == 0 for enabled, unfrozen in model.seen)


def test_overlapping_captures_on_two_threads_restore_gc_once_both_end(gc_restored):
    both_inside = threading.Barrier(2)

    class Waits(Probe):
        def forward(self, x):
            if not self.seen:  # first warm-up: wait until the other thread's capture has begun too
                both_inside.wait(60)
            return super().forward(x)

    errors = []

    def run():
        try:
            _capture(Waits())
        except Exception as exc:  # collected: pytest does not see thread exceptions
            errors.append(exc)

    survivors = [LongLived() for _ in range(100)]
    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and not any(t.is_alive() for t in threads)
    assert gc.isenabled() and _unfrozen(survivors) == len(survivors)


def test_frozen_objects_count_as_the_applications_when_the_interpreters_own_cannot_be_measured(
    gc_restored, monkeypatch
):
    from devgraph.runner import _gc_baseline

    monkeypatch.setattr(_gc_baseline, "_interpreter_frozen", None)
    monkeypatch.setattr(_gc_baseline.sys, "executable", "/nonexistent/python")
    survivors = [LongLived() for _ in range(10)]
    gc.collect()
    gc.freeze()
    assert _gc_baseline.application_froze_objects()  # the safe side: devgraph then freezes nothing more
    _capture()
    assert _unfrozen(survivors) == 0
