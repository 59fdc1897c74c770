"""The conformance suite catches broken backends: each one fails the check named for what it breaks.

``tests/broken_backends.py`` holds the CPU reference backend with one contract property broken per
class. A check no broken backend fails proves nothing, so every check must be failed by at least
one of them (``UNPROVEN`` would list an exception, with the reason).
"""

from __future__ import annotations

import pytest
from broken_backends import (
    BROKEN,
    CorrectDevice,
    DeferredWrites,
    IgnoresPool,
    PoolNeverReuses,
    ReplayDoesNothing,
    ReplaySnapshotsInputs,
    WaitIgnored,
)

from devgraph.testing import conformance

_BY_NAME = {check.__name__: check for check in conformance.CHECKS}

#: Checks that need the replayed work to read new inputs and land in the captured outputs.
_REPLAY_CHECKS = {
    "check_elementwise",
    "check_matmul",
    "check_inplace_cache_update",
    "check_view_chain",
    "check_input_rebinding_by_copy",
    "check_output_memory_reuse",
    "check_pool_sharing",
    "check_host_args_frozen",
}
#: Checks that observe weak references through the memory a later capture into the pool reuses.
_REUSE_CHECKS = {"check_graph_holds_outputs_weakly", "check_tasks_hold_arguments_weakly"}

#: A broken backend fails its named check and, where another check rests on the same property, these.
ALSO_FAILS: dict[type, set[str]] = {
    IgnoresPool: _REUSE_CHECKS,
    PoolNeverReuses: _REUSE_CHECKS,
    # an update writes nothing either (a device's update only rewrites parameters): replay must
    ReplayDoesNothing: _REPLAY_CHECKS | {"check_task_update"},
    ReplaySnapshotsInputs: _REPLAY_CHECKS,
    WaitIgnored: {"check_wait_stream_orders_streams"},  # wait_stream is an event record + wait
}

#: Checks no broken backend fails, and why (none today).
UNPROVEN: dict[str, str] = {}


def _name(cls: type) -> str:
    return cls.__name__


@pytest.mark.parametrize("broken", list(BROKEN), ids=_name)
def test_named_check_rejects_the_broken_backend(broken: type) -> None:
    check = _BY_NAME[BROKEN[broken]]
    with pytest.raises(AssertionError):
        check(broken())


@pytest.mark.parametrize("broken", list(BROKEN), ids=_name)
def test_suite_fails_the_broken_backend_only_where_it_is_broken(broken: type) -> None:
    failed = conformance.failures(broken())
    assert set(failed) == {BROKEN[broken]} | ALSO_FAILS.get(broken, set())
    assert all(isinstance(err, AssertionError) for err in failed.values()), failed


@pytest.mark.parametrize("correct", [CorrectDevice, DeferredWrites], ids=_name)
def test_unbroken_scaffolding_passes_every_check(correct: type) -> None:
    assert conformance.failures(correct()) == {}


def test_every_check_is_failed_by_some_broken_backend() -> None:
    proven = set(BROKEN.values()).union(*ALSO_FAILS.values())
    unproven = set(_BY_NAME) - proven
    assert unproven == set(UNPROVEN), f"checks no broken backend fails: {sorted(unproven - set(UNPROVEN))}"
