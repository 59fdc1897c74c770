"""The devgraph SGLang platforms: SGLang's device mixin for the device, devgraph's graph machinery.

``DevgraphCpuPlatform`` runs SGLang on torch's CPU device with graphs from devgraph's CPU reference
backend (correctness, not speed), or from its NPU backend on devgraph's torch_npu simulator (tests/sim);
``DevgraphNpuPlatform`` runs on Ascend with devgraph's NPU backend. The decode graph runner follows
the devgraph backend that captures (``_runner.graph_runner_cls``). Both are out-of-tree (``PlatformEnum.OOT``), declare ``graph_capture`` (decode graphs;
no piecewise: SGLang 0.5.23 has no platform hook for prefill graphs) and default to the ``devgraph``
attention backend, whose decode attention is a devgraph op updated by task update at every replay.
"""

from __future__ import annotations

from sglang.srt.platforms.cpu import CpuDeviceMixin
from sglang.srt.platforms.device_mixin import PlatformEnum
from sglang.srt.platforms.interface import PlatformCapabilities, SRTPlatform
from sglang.srt.platforms.npu import NPUDeviceMixin

#: Name of the attention backend devgraph registers (``_plugin.register``).
ATTENTION_BACKEND = "devgraph"


class _DevgraphPlatform(SRTPlatform):
    """What every devgraph platform answers, whatever the device."""

    _enum = PlatformEnum.OOT
    capabilities = PlatformCapabilities(graph_capture=True)

    def apply_server_args_defaults(self, server_args) -> None:
        # The general plugin that registers the backend runs in every SGLang process; make sure it
        # ran in this one before the backend name is resolved.
        from devgraph.adapters.sglang._plugin import register

        register()
        if getattr(server_args, "attention_backend", None) is None:
            server_args.attention_backend = ATTENTION_BACKEND

    def get_default_attention_backend(self) -> str:
        return ATTENTION_BACKEND

    def get_graph_runner_cls(self) -> type:
        # By the devgraph device that captures (not SGLang's device): NPU graphs get SGLang's NPU
        # runner, also on CPU tensors (devgraph's NPU backend on devgraph.testing's simulator).
        from devgraph.adapters.sglang._backend import devgraph_device_for
        from devgraph.adapters.sglang._runner import graph_runner_cls

        return graph_runner_cls(devgraph_device_for(self.device_name))

    def get_full_graph_backend_cls(self) -> type:
        from devgraph.adapters.sglang._backend import DevgraphGraphBackend

        return DevgraphGraphBackend

    def init_backend(self) -> None:
        from devgraph.adapters.sglang._plugin import register

        register()


class DevgraphCpuPlatform(CpuDeviceMixin, _DevgraphPlatform):
    """SGLang on torch's CPU device, graphs captured by devgraph's CPU reference backend.

    Or by devgraph's NPU backend, when that is devgraph's device and its tensors are CPU tensors
    (devgraph's torch_npu simulator (tests/sim)): the decode runner is then ``DevgraphNPUGraphRunner``.
    """

    _enum = PlatformEnum.OOT
    device_name = "cpu"
    device_type = "cpu"

    def is_pin_memory_available(self, device=None) -> bool:
        return False


class DevgraphNpuPlatform(NPUDeviceMixin, _DevgraphPlatform):
    """SGLang on Ascend NPU, graphs captured by devgraph's NPU backend.

    SGLang hands an ``npu`` device its in-tree graph backend before asking the platform, so the
    runner is ``DevgraphNPUGraphRunner``, which replaces that backend with devgraph's before capture.
    """

    _enum = PlatformEnum.OOT
    device_name = "npu"
    device_type = "npu"
