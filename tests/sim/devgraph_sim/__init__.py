"""Test doubles for devgraph's own tests, outside the devgraph package (users never install them).

* ``devgraph_sim.npu``: a CPU simulator of torch_npu 2.13.0. ``with simulated_torch_npu():`` puts a
  fake ``torch_npu`` in ``sys.modules`` for the block, so devgraph's NPU backend runs, unchanged and
  unaware, on CPU tensors. Its signatures are checked against the real wheel's sources
  (``tests/backends/npu/test_npu_signatures.py``).
* ``devgraph_sim.accelerator``: a stand-in for torch 2.13's ``torch.accelerator`` Python API, for the
  ``accelerator`` backend's tests.
* ``devgraph_sim.pytest_plugin``: the ``npu_sim`` fixture.

Installed by the nox sessions with ``pip install --no-deps -e tests/sim`` (like the toy backend of
``tests/plugins``). torch keeps its equivalent, OpenReg, outside its package for the same reason.
"""
