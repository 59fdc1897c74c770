"""A pytest plugin for the GPU one-shot's test steps: a hard time limit per test, and a line per result.

Loaded with ``-p oneshot_pytest`` (``tools/`` on ``PYTHONPATH``); configured by environment variables
so that pytest-xdist's workers, which inherit them, behave alike:

* ``ONESHOT_TEST_TIMEOUT`` (seconds): a test still running after that long has every thread's Python
  stack written to ``ONESHOT_DUMP_DIR/hang-<pid>.txt`` and its process ends (``faulthandler``'s
  ``dump_traceback_later(exit=True)``). Under xdist the worker is replaced and the run goes on, the
  test reported as crashed; without xdist the run ends there. pytest's own ``faulthandler_timeout``
  only dumps: one hung test would otherwise hold the step until the step's own time limit.
* ``ONESHOT_TEST_LOG``: a JSON line per test outcome (``nodeid``, ``outcome``, ``seconds``), appended
  as each test ends, so a step killed before pytest writes its junit XML still leaves its results.
"""

from __future__ import annotations

import faulthandler
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

_dump_file: Any = None
_xdist_worker = False  # under xdist the controller logs every worker's reports


def _timeout() -> float:
    return float(os.environ.get("ONESHOT_TEST_TIMEOUT", "0") or 0)


def pytest_configure(config: pytest.Config) -> None:
    global _dump_file, _xdist_worker
    _xdist_worker = hasattr(config, "workerinput")
    folder = os.environ.get("ONESHOT_DUMP_DIR")
    if _timeout() > 0 and folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        _dump_file = open(Path(folder) / f"hang-{os.getpid()}.txt", "w")  # open for the whole run


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if _dump_file is not None:
        _dump_file.write(f"-- {item.nodeid}: still running after {_timeout():.0f} s, ending the process\n")
        _dump_file.flush()
        faulthandler.dump_traceback_later(_timeout(), exit=True, file=_dump_file)
    try:
        yield
    finally:
        if _dump_file is not None:
            faulthandler.cancel_dump_traceback_later()
            _dump_file.seek(0)
            _dump_file.truncate()  # the file keeps a dump only: a test that ended needs none


def pytest_unconfigure(config: pytest.Config) -> None:
    global _dump_file
    if _dump_file is not None:
        _dump_file.close()
        path = Path(_dump_file.name)
        if path.stat().st_size == 0:
            path.unlink()
        _dump_file = None


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = os.environ.get("ONESHOT_TEST_LOG")
    if not path or _xdist_worker:
        return
    if report.when == "call":
        outcome = report.outcome
    elif report.skipped and report.when == "setup":
        outcome = "skipped"
    elif report.failed:
        outcome = "error"  # setup or teardown failed
    else:
        return
    line = {
        "nodeid": report.nodeid,
        "when": report.when,
        "outcome": outcome,
        "seconds": round(report.duration, 3),
    }
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
