"""Test helpers for devgraph and for backend authors.

* ``simulated_torch_npu()``: a CPU simulator of torch_npu, installed in ``sys.modules`` for a
  with-block, so the NPU backend runs (and is tested) without an Ascend device
  (``devgraph.testing.npu_sim``). A pytest fixture, ``npu_sim``, lives in
  ``devgraph.testing.pytest_plugin``.
* ``conformance``: the backend conformance suite.
* ``models``: tiny decoder models for end-to-end tests.
* ``distributed``: ``run_ranks(fn, world_size)`` runs ``fn`` on spawned ranks of one process group
  (gloo on CPU by default), every wait bounded by a timeout.

Submodules load on first use, so importing this package imports neither torch nor the ops.
"""

from __future__ import annotations

from typing import Any

__all__ = ["simulated_torch_npu"]


def __getattr__(name: str) -> Any:
    if name == "simulated_torch_npu":
        from devgraph.testing.npu_sim import simulated_torch_npu

        return simulated_torch_npu
    raise AttributeError(f"module 'devgraph.testing' has no attribute {name!r}")
