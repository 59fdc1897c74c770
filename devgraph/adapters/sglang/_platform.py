"""The devgraph SGLang platforms: SGLang's device mixin for the device, devgraph's graph machinery.

``DevgraphCpuPlatform`` runs SGLang on torch's CPU device with graphs from devgraph's CPU reference
backend (correctness, not speed), or from its NPU backend on devgraph's torch_npu simulator (tests/sim);
``DevgraphNpuPlatform`` runs on Ascend with devgraph's NPU backend. The decode graph runner follows
the devgraph backend that captures (``_runner.graph_runner_cls``). Both are out-of-tree (``PlatformEnum.OOT``), declare ``graph_capture`` (decode graphs;
not ``piecewise_graph``, SGLang's torch.compile piecewise backend: prefill graphs come from devgraph's
breakable capture through ``_prefill``, which SGLang 0.5.23 offers no platform hook for) and default to
the ``devgraph`` attention backend, whose decode attention is a devgraph op updated by task update at
every replay.
"""

from __future__ import annotations

import logging

from sglang.srt.platforms.cpu import CpuDeviceMixin
from sglang.srt.platforms.device_mixin import PlatformEnum
from sglang.srt.platforms.interface import PlatformCapabilities, SRTPlatform
from sglang.srt.platforms.npu import NPUDeviceMixin

#: Name of the attention backend devgraph registers (``_plugin.register``).
ATTENTION_BACKEND = "devgraph"

logger = logging.getLogger(__name__)

#: Prefill graphs on ``cpu`` capture SGLang's token buckets up to this many tokens unless sized
#: (``cuda_graph_max_bs_prefill`` / ``cuda_graph_bs_prefill``): 14 buckets. SGLang's own list runs to
#: its chunked prefill size: 50 buckets up to 4096 tokens in the engine tests' configuration, 444 s
#: of capture on the shared 2-core CPU where the 16 decode sizes took 41 s. A bucket costs about what
#: a decode size does (1.1 s each for 22 buckets up to 256 tokens on the same loaded machine), and
#: the engine start with both kinds of graphs is to stay within 1.5x the start without.
CPU_PREFILL_MAX_TOKENS = 128


def cpu_prefill_sizes(server_args) -> int | None:
    """Bound the prefill graphs' token buckets on ``cpu`` when they are on and not sized by the user.

    Sets ``cuda_graph_config.prefill.max_bs`` to ``CPU_PREFILL_MAX_TOKENS`` (SGLang then lists its
    buckets up to it) and returns it; None when it leaves the settings as they are (another device,
    prefill graphs off or not breakable, sizes given).
    """
    config = getattr(server_args, "cuda_graph_config", None)
    prefill = getattr(config, "prefill", None)
    if getattr(server_args, "device", None) != "cpu" or prefill is None:
        return None
    if prefill.backend != "breakable" or prefill.max_bs is not None or prefill.bs is not None:
        return None
    from sglang.srt.model_executor.cuda_graph_config import with_phase

    server_args.cuda_graph_config = with_phase(config, "prefill", max_bs=CPU_PREFILL_MAX_TOKENS)
    return CPU_PREFILL_MAX_TOKENS


def graph_settings_notes(server_args) -> list[str]:
    """What SGLang will do with the decode-graph settings on ``cpu`` that the user would not expect.

    SGLang 0.5.23 captures decode graphs on ``cpu`` only with ``enable_torch_compile`` (devgraph's
    runner then compiles nothing), whatever else is set; and it sizes them by
    ``cuda_graph_bs_decode``, else ``torch_compile_max_bs``, never by ``cuda_graph_max_bs_decode``.
    Returns the warnings to give at engine start (empty when the settings do what they say).
    """
    if getattr(server_args, "device", None) != "cpu":
        return []
    notes = []
    graphs_off = bool(getattr(server_args, "disable_cuda_graph", False)) or bool(
        getattr(server_args, "disable_decode_cuda_graph", False)
    )
    compile_on = bool(getattr(server_args, "enable_torch_compile", False))
    sizes = getattr(server_args, "cuda_graph_bs_decode", None)
    max_bs = getattr(server_args, "cuda_graph_max_bs_decode", None)
    if not compile_on and not graphs_off:
        asked = [f"cuda_graph_bs_decode={sizes}"] if sizes else []
        asked += [f"cuda_graph_max_bs_decode={max_bs}"] if max_bs else []
        notes.append(
            "devgraph SGLang platform: no decode graph will be captured"
            + (f" (though {', '.join(asked)} was given)" if asked else "")
            + ": on device cpu SGLang 0.5.23 captures decode graphs only with enable_torch_compile=True "
            "(--enable-torch-compile; devgraph's runner then compiles nothing, it captures the eager ops). "
            "Set it to capture decode graphs through devgraph, or disable_cuda_graph=True to run "
            "eagerly without this warning."
        )
    elif compile_on and max_bs and sizes:
        notes.append(
            f"devgraph SGLang platform: cuda_graph_max_bs_decode={max_bs} is ignored on device cpu: "
            f"cuda_graph_bs_decode={sizes} lists the decode sizes captured."
        )
    return notes


class _DevgraphPlatform(SRTPlatform):
    """What every devgraph platform answers, whatever the device."""

    _enum = PlatformEnum.OOT
    capabilities = PlatformCapabilities(graph_capture=True)
    #: read by the prefill hook (``_prefill``), which must not import this module (import circle)
    is_devgraph = True

    def apply_server_args_defaults(self, server_args) -> None:
        # The general plugin that registers the backend runs in every SGLang process; make sure it
        # ran in this one before the backend name is resolved.
        from devgraph.adapters.sglang._plugin import register

        register()
        if getattr(server_args, "attention_backend", None) is None:
            server_args.attention_backend = ATTENTION_BACKEND
        for note in graph_settings_notes(server_args):
            logger.warning(note)
        max_bs = getattr(server_args, "cuda_graph_max_bs_decode", None)
        if (
            getattr(server_args, "device", None) == "cpu"
            and getattr(server_args, "enable_torch_compile", False)
            and max_bs
            and not getattr(server_args, "cuda_graph_bs_decode", None)
        ):
            # SGLang sizes cpu graphs by torch_compile_max_bs and never reads this option there;
            # devgraph's runner compiles nothing, so that limit only sizes the graphs: make the
            # documented option do what it says (every size up to it, SGLang's cpu buckets).
            server_args.torch_compile_max_bs = int(max_bs)
            logger.info(
                "devgraph SGLang platform: decode graphs up to cuda_graph_max_bs_decode=%d "
                "(torch_compile_max_bs set to it; nothing is compiled)",
                max_bs,
            )
        if cpu_prefill_sizes(server_args) is not None:
            logger.info(
                "devgraph SGLang platform: prefill graphs up to %d tokens on cpu (set "
                "cuda_graph_max_bs_prefill or cuda_graph_bs_prefill to capture others)",
                CPU_PREFILL_MAX_TOKENS,
            )

    def get_default_attention_backend(self) -> str:
        return ATTENTION_BACKEND

    def get_graph_runner_cls(self) -> type:
        # By the devgraph device that captures (not SGLang's device): NPU graphs get SGLang's NPU
        # runner, also on CPU tensors (devgraph's NPU backend on devgraph.testing's simulator).
        from devgraph.adapters.sglang._backend import devgraph_device_for
        from devgraph.adapters.sglang._decode_runner import graph_runner_cls

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
