"""A third-party devgraph backend for tests: the CPU reference semantics under another name.

Available only when DEVGRAPH_TOY_BACKEND=1, so installing it does not change which backend
``devgraph.device()`` picks in the rest of the test suite.
"""

from __future__ import annotations

import os

import devgraph


def _probe() -> devgraph.Probe:
    if os.environ.get("DEVGRAPH_TOY_BACKEND") == "1":
        return devgraph.Probe(True, "toy backend for tests", "0.0.1", 1)
    return devgraph.Probe(False, "set DEVGRAPH_TOY_BACKEND=1 to enable")


@devgraph.hookimpl
def devgraph_register_backends(register):
    register(devgraph.BackendSpec("toy", _probe, "devgraph_toy_backend._device:ToyDevice"))
