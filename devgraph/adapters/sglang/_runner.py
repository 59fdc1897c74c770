"""Decode graph runners that make ``DevgraphGraphBackend`` the backend that captures and replays.

``DevgraphDecodeGraphRunner`` is SGLang's ``DecodeCudaGraphRunner`` (buckets, static buffers,
padding, capture largest first, slicing) with devgraph's backend. On devices where SGLang's
``resolve_decode_backend`` asks the platform (every out-of-tree device except ``npu``/``xpu``) it
already gets devgraph's backend; where SGLang builds its in-tree backend first (``npu``), the runner
swaps it for devgraph's before capture, without patching SGLang.

``npu_graph_runner_cls()`` builds the same runner over SGLang's ``NPUGraphRunner``, whose replay calls
``backend.replay_with_input_update(...)``: devgraph's backend maps that onto
``Graph.replay(host_args=...)``.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

from devgraph.adapters.sglang._backend import DevgraphGraphBackend

logger = logging.getLogger(__name__)


class _UsesDevgraphBackend:
    """Mixin for SGLang decode runners: capture with devgraph's backend whatever SGLang built."""

    backend: Any  # set by SGLang's runner __init__ (resolve_decode_backend) before capture()

    def capture(self) -> None:
        if not isinstance(self.backend, DevgraphGraphBackend):
            # SGLang picked its in-tree backend by device before asking the platform; it holds no
            # graphs yet, so release what it set up and capture with devgraph's instead.
            logger.info(
                "devgraph: replacing SGLang's %s with DevgraphGraphBackend", type(self.backend).__name__
            )
            self.backend.cleanup()
            self.backend = DevgraphGraphBackend(self)
        super().capture()  # type: ignore[misc]  # the SGLang runner this mixin precedes


class DevgraphDecodeGraphRunner(_UsesDevgraphBackend, DecodeCudaGraphRunner):
    """SGLang's decode graph runner, captured and replayed by devgraph."""

    def _record_in_graph_metadata_prep_done(self) -> None:
        # SGLang plants an external event here, asking torch's device module whether a capture is
        # running. torch.cpu has neither stream capture nor external events: nothing to plant.
        if not hasattr(self.device_module, "is_current_stream_capturing"):
            return
        super()._record_in_graph_metadata_prep_done()


@functools.cache
def npu_graph_runner_cls() -> type:
    """SGLang's ``NPUGraphRunner`` with devgraph's backend (imported lazily: it needs torch_npu)."""
    from sglang.srt.hardware_backend.npu.graph_runner.npu_graph_runner import NPUGraphRunner

    return type("DevgraphNPUGraphRunner", (_UsesDevgraphBackend, NPUGraphRunner), {"__module__": __name__})
