"""A torch_npu simulator: run devgraph's NPU backend, unchanged, on the CPU.

``with simulated_torch_npu() as torch_npu:`` puts a fake ``torch_npu`` (and ``torch_npu.npu``) in
``sys.modules`` for the block only, so ``import torch_npu`` inside it returns the simulator and
``devgraph.device("npu")`` builds the real NPU backend on top of it. On exit the previous
``sys.modules`` entries come back (absent, ``None``, or a real torch_npu) and cached ``npu`` devices
are forgotten, on entry too, so a device never outlives the module it was built on.

What it is: a CPU model of the subset of torch_npu 2.13.0 that devgraph calls, with the real
signatures (``tests/backends/npu/test_npu_signatures.py`` checks them against the wheel):

* ``torch_npu.npu``: ``Stream``, ``Event``, ``ExternalEvent`` (asynchronous: work is queued per
  stream, see ``simulated_torch_npu``), ``current_stream``, ``set_stream``,
  ``stream``, ``synchronize``, ``is_available``, ``device_count``, the memory counters,
  ``NPUGraph``, ``graph`` (``auto_dispatch_capture`` included), ``graph_pool_handle`` and the four
  ``graph_task_*`` functions; see ``devgraph_sim.npu._runtime``.
* ``torch_npu.<op>``: reference kernels of the ops the NPU kernels call, as dispatcher ops with
  torch_npu's schemas, refusing the dtypes/layouts/sizes the hardware refuses; see
  ``devgraph_sim.npu._ops``.

What it is not: a performance model, or a model of anything else in torch_npu. Tensors are CPU
tensors: a simulated stream's ``device`` is ``cpu``, and devgraph's NPU backend, which asks its
streams where its tensors live, as on hardware, places them there. The block also enters
``devgraph.ops.route(CPU="PrivateUse1")``: devgraph ops called on those tensors run their NPU
(``PrivateUse1``) kernels. The NPU backend has no seam for the simulator: nothing in it knows it
is simulated. Nothing in ``torch`` is modified; in particular there is no ``torch.npu``.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import logging
import sys
import types
from collections.abc import Iterator

from devgraph_sim.npu import _handlers, _ops, _runtime

__all__ = ["MODULE_NAMES", "SIMULATED_OPS", "simulated_torch_npu"]

#: The ``sys.modules`` entries the simulator installs (and restores on exit).
MODULE_NAMES = (
    "torch_npu",
    "torch_npu.npu",
    "torch_npu.npu._npugraph_handlers",
    "torch_npu.npu._npugraph_handlers.npugraph_handler",
)

#: The torch_npu ops the simulator provides (as ``torch_npu.<name>``).
SIMULATED_OPS = tuple(sorted({name.split(".")[0] for name in _ops.SCHEMAS}))

_MISSING = object()

logger = logging.getLogger("devgraph_sim.npu")

_DOC = """A CPU *simulator* of torch_npu 2.13.0 (devgraph_sim.npu, from devgraph's tests), not the real thing.

It implements only what devgraph's NPU backend calls, with torch_npu's signatures. Installed in
sys.modules by devgraph_sim.npu.simulated_torch_npu() for the duration of a with-block.
"""


def _build() -> types.ModuleType:
    """A fresh fake ``torch_npu`` module with its ``npu`` submodule."""
    _ops.define_ops()
    top = types.ModuleType("torch_npu", _DOC)
    npu = types.ModuleType("torch_npu.npu", "Streams, events, graphs and memory of the simulated NPU.")
    origin = "devgraph_sim.npu"
    top.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None, origin=origin)
    npu.__spec__ = importlib.machinery.ModuleSpec("torch_npu.npu", None, origin=origin)
    names = [n for n in _runtime.__all__ if n not in _runtime.SIMULATOR_ONLY]
    npu.__dict__.update({name: getattr(_runtime, name) for name in names}, __all__=names)
    # torch_npu 2.13's task-update handler registry, at the wheel's module paths (one process-wide
    # registry, as on hardware: a handler registered under one simulator block stays registered).
    handlers = types.ModuleType("torch_npu.npu._npugraph_handlers", _handlers.__doc__)
    core = types.ModuleType("torch_npu.npu._npugraph_handlers.npugraph_handler")
    for mod in (handlers, core):
        mod.__spec__ = importlib.machinery.ModuleSpec(mod.__name__, None, origin=origin)
        mod.__dict__.update(
            NpuGraphOpHandler=_handlers.NpuGraphOpHandler,
            register_npu_graph_handler=_handlers.register_npu_graph_handler,
        )
    core._NPU_GRAPH_OP_HANDLERS = _handlers._NPU_GRAPH_OP_HANDLERS
    handlers.npugraph_handler = core
    npu._npugraph_handlers = handlers
    top.__dict__.update(
        __version__="2.13.0",
        npu=npu,
        **{name: _ops.op(name) for name in SIMULATED_OPS},
    )
    return top


@contextlib.contextmanager
def simulated_torch_npu(streams: str = "eager", hang_timeout: float = 2.0) -> Iterator[types.ModuleType]:
    """Install the torch_npu simulator in ``sys.modules`` for the block; yield the fake module.

    Args:
        streams: when queued device work runs (``devgraph_sim.npu._streams``):
            ``"eager"`` runs each stream as far as its waits allow as soon as work is queued (CPU
            reads of graph outputs then see finished replays); ``"lazy"`` runs streams only when
            the host synchronises or another stream waits on them, side streams first, so a
            missing stream or event dependency shows as a wrong result or a hang. In lazy mode
            call ``device.synchronize()`` before reading what a replay wrote.
        hang_timeout: seconds a host sync waits for blocked work before raising
            ``SimulatedHang`` (a ``RuntimeError`` naming the task).

    On a normal exit the block's queued work is run (a hang raises); then queues are dropped.
    Nests (the inner block restores the outer simulator and its mode). Not for use from several
    threads at once: ``sys.modules`` is process-wide.
    """
    from devgraph import _plugins
    from devgraph.ops import route

    module = _build()
    saved = {name: sys.modules.get(name, _MISSING) for name in MODULE_NAMES}
    outer_mode = _runtime.stream_mode()
    _runtime.reset_state(streams, hang_timeout)
    _plugins.forget_devices("npu")
    sys.modules["torch_npu"] = module
    sys.modules["torch_npu.npu"] = module.__dict__["npu"]
    sys.modules["torch_npu.npu._npugraph_handlers"] = module.npu._npugraph_handlers
    sys.modules["torch_npu.npu._npugraph_handlers.npugraph_handler"] = (
        module.npu._npugraph_handlers.npugraph_handler
    )
    ok = False
    try:
        with route(CPU="PrivateUse1"):
            yield module
            ok = True
            module.npu.synchronize()  # the block's device work must be able to finish
    finally:
        for name, previous in saved.items():
            if previous is _MISSING:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous  # type: ignore[assignment]
        left = _runtime.reset_state(*outer_mode)
        if left and ok:
            logger.debug("simulator exit dropped %d queued work items", len(left))
        _plugins.forget_devices("npu")
