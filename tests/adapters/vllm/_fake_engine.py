"""A vLLM step loop without the engine: vLLM's forward context, capture switch and wrapper protocol,
driving ``DevgraphGraphWrapper`` on any devgraph device (the CPU reference, the NPU simulator).

``platform_on(device_name)`` installs, for a with-block, a devgraph platform built from vLLM's own
``CpuPlatform`` class and devgraph's platform mixin as ``vllm.platforms.current_platform``.
``AttentionModel`` is the "model": ``LAYERS`` paged decode attentions over persistent buffers, each
reading its host sequence lengths from the step's attention metadata, as vLLM's attention layers
do, and adding its output into ``acc``, which lives outside the graph, so that ``acc`` shows the
lengths every queued replay really used.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch

import devgraph.ops as ops
from devgraph.backends import _reference

LAYERS = 2
SCALE = 0.5
BLOCK = 16


@contextlib.contextmanager
def platform_on(device_name: str):
    import vllm.compilation.cuda_graph
    import vllm.forward_context
    import vllm.platforms
    from vllm.platforms.cpu import CpuPlatform

    from devgraph.adapters.vllm._platform import DevgraphPlatformMixin

    cls = type(
        "TestDevgraphPlatform",
        (DevgraphPlatformMixin, CpuPlatform),
        {"devgraph_device_name": device_name, "devgraph_error": None, "_global_graph_pool": None},
    )
    platform = cls()
    # vLLM's modules that imported ``current_platform`` by name hold it too.
    holders = [vllm.platforms, vllm.compilation.cuda_graph]
    previous = [m.__dict__.get("current_platform") for m in holders]
    for module in holders:
        module.current_platform = platform
    try:
        yield platform
    finally:
        for module, value in zip(holders, previous):
            if value is None:
                del module.current_platform
            else:
                module.current_platform = value


def metadata(lens: list[int]) -> dict[str, SimpleNamespace]:
    """One step's attention metadata, {layer: metadata}, as devgraph's attention backend builds it."""
    m = SimpleNamespace(
        seq_lens_host=list(lens), max_query_len=1, devgraph_host_args={"seq_lens_host": list(lens)}
    )
    return {f"layer{i}": m for i in range(LAYERS)}


class AttentionModel:
    """``LAYERS`` decode attentions reading the step's host lengths from the forward context."""

    def __init__(self, dtype: torch.dtype, batch: int = 2) -> None:
        g = torch.Generator().manual_seed(0)
        heads, kv_heads, dim, blocks = 4, 2, 16, 8
        self.q = [torch.randn(batch, heads, dim, generator=g).to(dtype) for _ in range(LAYERS)]
        self.k = torch.randn(blocks, BLOCK, kv_heads, dim, generator=g).to(dtype)
        self.v = torch.randn(blocks, BLOCK, kv_heads, dim, generator=g).to(dtype)
        self.table = torch.randperm(blocks, generator=g)[: batch * 2].view(batch, 2).to(torch.int32)
        self.seq = torch.zeros(batch, dtype=torch.int32)
        self.out = [torch.empty_like(q) for q in self.q]
        self.acc = torch.zeros(batch, heads, dim)
        self.input_ids = torch.zeros(batch, dtype=torch.int64)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        from vllm.forward_context import get_forward_context

        context = get_forward_context().attn_metadata
        for i, (q, out) in enumerate(zip(self.q, self.out)):
            lens = context[f"layer{i}"].seq_lens_host
            ops.paged_decode_attention(q, self.k, self.v, self.table, self.seq, lens, SCALE, out)
            self.acc.add_(out.float())
        return self.out[-1]

    def expected(self, lens: list[int]) -> torch.Tensor:
        """What one step with ``lens`` adds to ``acc``."""
        total = torch.zeros_like(self.acc)
        for q in self.q:
            out = torch.empty_like(q, dtype=torch.float32)
            k, v = self.k.float(), self.v.float()
            _reference.paged_decode_attention_host_lens(q.float(), k, v, self.table, lens, SCALE, out)
            total += out
        return total


def vllm_config():
    from vllm.config import VllmConfig

    return VllmConfig()


def step(wrapper, model: AttentionModel, config, lens: list[int], mode=None, capture: bool = False):
    """One vLLM step through ``wrapper`` with host lengths ``lens`` (FULL by default)."""
    from vllm.compilation.monitor import set_cudagraph_capturing_enabled
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor, set_forward_context

    mode = CUDAGraphMode.FULL if mode is None else mode
    batch = model.input_ids.shape[0]
    descriptor = BatchDescriptor(num_tokens=batch, num_reqs=batch, uniform=True)
    set_cudagraph_capturing_enabled(capture)
    try:
        with set_forward_context(
            metadata(lens), config, cudagraph_runtime_mode=mode, batch_descriptor=descriptor
        ):
            return wrapper(input_ids=model.input_ids, positions=None)
    finally:
        set_cudagraph_capturing_enabled(False)
