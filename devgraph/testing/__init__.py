"""Test helpers for devgraph's users and backend authors (a side layer: no other layer imports it).

* ``conformance``: the backend conformance suite.
* ``models``: tiny decoder models for end-to-end tests (and the demo).
* ``speculative``: a k-step speculative draft over the tiny decoder: eager, one merged graph, k replays.
* ``distributed``: ``run_ranks(fn, world_size)`` runs ``fn`` on spawned ranks of one process group
  (gloo on CPU by default), every wait bounded by a timeout.

devgraph's own test doubles (its torch_npu simulator, a ``torch.accelerator`` stand-in) are not
here: they live with its tests (``tests/sim``, the ``devgraph_sim`` package), not in what users install.

Submodules load on first use, so importing this package imports neither torch nor the ops.
"""
