"""Decode graph runners that make ``DevgraphGraphBackend`` the backend that captures and replays.

``DevgraphDecodeGraphRunner`` is SGLang's ``DecodeCudaGraphRunner`` (buckets, static buffers, capture
largest first, slicing) with devgraph's backend, for the CPU reference, where a graph step must equal
the eager step bit for bit. Two things differ from SGLang's runner:

* Nothing is ``torch.compile``'d (unless ``DEVGRAPH_SGLANG_COMPILE=1``: then SGLang compiles the
  sizes it chose and the capture records each compiled graph whole). On ``cpu`` SGLang captures only with ``enable_torch_compile`` and
  then compiles every captured size's whole forward (it raises ``torch_compile_max_bs`` to the
  largest capture size whatever was passed); inductor's fused kernels round differently from the
  eager ops (near-tied greedy tokens flipped on long outputs), and compiling each size took most of
  the engine's start. The capture records the eager ops instead.
* A batch replays only a graph of its own size, never one padded to a larger bucket: float32 CPU
  GEMMs round a row differently depending on how many rows the matrix has, so a padded step is not
  the eager step. A decode batch of a size with no graph runs eagerly, counted in
  ``stats().eager_decode``; once per engine, ``EAGER_REPORT_WINDOW`` decode steps after the first
  eager one, a warning says how many steps ran eagerly, at which sizes, and the
  ``--cuda-graph-bs-decode`` list (or ``--max-running-requests``) that captures them (SGLang's
  default sizes on ``cpu`` cover every batch up to 16).

On devices where SGLang's ``resolve_decode_backend`` asks the platform (every out-of-tree device
except ``npu``/``xpu``) the runner already gets devgraph's backend; where SGLang builds its in-tree
backend first (``npu``), the runner swaps it for devgraph's before capture, without patching SGLang.

``npu_graph_runner_cls()`` builds the same runner over SGLang's ``NPUGraphRunner``, whose replay calls
``backend.replay_with_input_update(...)``: devgraph's backend maps that onto
``Graph.replay(host_args=...)``.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections import Counter
from typing import Any

from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

from devgraph.adapters.sglang import _stats
from devgraph.adapters.sglang._backend import DevgraphGraphBackend
from devgraph.graph import Device

logger = logging.getLogger(__name__)

#: Set to 1 to keep SGLang's torch.compile of the decode forward (its --enable-torch-compile, as
#: SGLang means it): steps are then not eager steps bit for bit (inductor rounds otherwise).
COMPILE_ENV = "DEVGRAPH_SGLANG_COMPILE"


class _UsesDevgraphBackend:
    """Mixin for SGLang decode runners: capture with devgraph's backend whatever SGLang built.

    Nothing is ``torch.compile``'d, whatever runner precedes it: SGLang's decode runner compiles each
    captured size's forward (inductor rounds unlike the eager ops, see the module docstring), and its
    NPU runner would compile with torchair's ``npugraph_ex``, which captures ACL graphs of its own
    inside devgraph's capture. The capture records the eager ops.
    """

    backend: Any  # set by SGLang's runner __init__ (resolve_decode_backend) before capture()
    compile_bs: list[int]
    capture_bs: list[int]
    device_module: Any

    def capture(self) -> None:
        if not isinstance(self.backend, DevgraphGraphBackend):
            # SGLang picked its in-tree backend by device before asking the platform; it holds no
            # graphs yet, so release what it set up and capture with devgraph's instead.
            logger.info(
                "devgraph: replacing SGLang's %s with DevgraphGraphBackend", type(self.backend).__name__
            )
            self.backend.cleanup()
            self.backend = DevgraphGraphBackend(self)
        if os.environ.get(COMPILE_ENV) == "1":
            logger.warning(
                "devgraph: %s=1: SGLang compiles the forward of decode sizes %s with torch.compile "
                "(inductor) and devgraph records each compiled graph whole: those steps differ from eager "
                "where inductor rounds otherwise (DEVGRAPH_COMPARE_EAGER explains where)",
                COMPILE_ENV,
                getattr(self, "compile_bs", []),
            )
        else:
            if getattr(self, "compile_bs", None):
                logger.info(
                    "devgraph: capturing decode sizes %s without torch.compile (SGLang would compile %s): "
                    "graph steps then equal eager steps bit for bit",
                    self.capture_bs,
                    self.compile_bs,
                )
            self.compile_bs = []
        runner = type(self).__name__
        _stats.record(lambda s: setattr(s, "runner", runner))
        start = time.perf_counter()
        super().capture()  # type: ignore[misc]  # the SGLang runner this mixin precedes
        seconds = time.perf_counter() - start
        _stats.record(lambda s: setattr(s, "capture_s", s.capture_s + seconds))

    def _record_in_graph_metadata_prep_done(self) -> None:
        # SGLang plants an external event here, asking torch's device module whether a capture is
        # running. torch.cpu (SGLang's device module on cpu, also under devgraph's NPU backend on the
        # torch_npu simulator) has neither stream capture nor external events: nothing to plant.
        if not hasattr(self.device_module, "is_current_stream_capturing"):
            return
        super()._record_in_graph_metadata_prep_done()  # type: ignore[misc]


class DevgraphDecodeGraphRunner(_UsesDevgraphBackend, DecodeCudaGraphRunner):
    """SGLang's decode graph runner, captured and replayed by devgraph: no compile, exact sizes only."""

    #: decode steps, counted from the first eager one, after which the eager ones are reported
    #: (once per engine, with the numbers): long enough to show the load, short enough for a short run.
    EAGER_REPORT_WINDOW = 8

    _eager_sizes: Counter | None = None
    _steps_since_eager: int = 0
    _reported: bool = False

    def can_run_graph(self, forward_batch: Any) -> bool:
        ok = super().can_run_graph(forward_batch)
        bs = forward_batch.batch_size
        if ok and bs in self.capture_bs:
            self._note_decode_step(bs, eager=False)
            return True
        if ok or bs > self.max_bs:  # a decode batch of a size with no graph: eager, never padded
            self._note_decode_step(bs, eager=True)
        return False

    def _note_decode_step(self, bs: int, *, eager: bool) -> None:
        if eager:
            if self._eager_sizes is None:
                self._eager_sizes = Counter()
            self._eager_sizes[bs] += 1
            _stats.record(lambda s: s.eager_decode.update([bs]))
        if self._eager_sizes:
            self._steps_since_eager += 1
            if not self._reported and self._steps_since_eager >= self.EAGER_REPORT_WINDOW:
                self._reported = True
                logger.warning("%s", self.eager_decode_message())

    def eager_decode_message(self) -> str:
        """How many decode steps ran eagerly, at which sizes, and what to capture."""
        eager = self._eager_sizes or Counter()
        n = sum(eager.values())
        sizes = ", ".join(f"{bs} ({count}x)" for bs, count in sorted(eager.items()))
        missing = sorted(set(range(1, max(eager) + 1)) - set(self.capture_bs))
        above = max(eager) > self.max_bs
        return (
            f"devgraph: {n} of {self._steps_since_eager} decode steps ran eagerly: no graph of their "
            f"batch size was captured (captured: {sorted(self.capture_bs)}; eager batch sizes: {sizes}). "
            "devgraph replays only a graph of the batch's exact size here (padding changes how CPU "
            f"GEMMs round). Capture them with --cuda-graph-bs-decode {' '.join(map(str, sorted({*self.capture_bs, *missing})))}"
            + (f", or lower --max-running-requests to {self.max_bs}" if above else "")
            + ". Counted in devgraph.adapters.sglang.stats().eager_decode."
        )


def graph_runner_cls(device: Device) -> type:
    """The SGLang decode runner for graphs of the devgraph ``device``.

    ``DevgraphNPUGraphRunner`` for devgraph's NPU backend (SGLang's Ascend runner, which hands the
    attention's host lengths to every replay), also when its tensors are CPU tensors (devgraph.testing's
    torch_npu simulator); ``DevgraphDecodeGraphRunner`` for every other backend.
    """
    if device.name == "npu":
        return npu_graph_runner_cls()
    return DevgraphDecodeGraphRunner


@functools.cache
def npu_graph_runner_cls() -> type:
    """SGLang's ``NPUGraphRunner`` with devgraph's backend (imported lazily: it needs torch_npu)."""
    from sglang.srt.hardware_backend.npu.graph_runner.npu_graph_runner import NPUGraphRunner

    return type("DevgraphNPUGraphRunner", (_UsesDevgraphBackend, NPUGraphRunner), {"__module__": __name__})
