"""CPU worker and model runner that let vLLM's own capture loop run on devgraph's CPU reference.

vLLM's CPU worker never captures graphs and its model runner never wraps the model for FULL graphs.
``DevgraphCPUWorker`` builds a ``DevgraphCPUModelRunner`` (with vLLM's workspace manager, which the
capture loop locks afterwards) and, after vLLM's warm-up, calls vLLM's unchanged ``capture_model()``:
its dispatcher, capture sizes and warm-up runs drive ``DevgraphGraphWrapper``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.config import CompilationMode, CUDAGraphMode
from vllm.utils.torch_utils import set_random_seed
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from devgraph.adapters.vllm._wrapper import DevgraphGraphWrapper

__all__ = ["DevgraphCPUModelRunner", "DevgraphCPUWorker"]

logger = logging.getLogger("devgraph")


class DevgraphCPUModelRunner(CPUModelRunner):
    """vLLM's CPU model runner, with the model wrapped for FULL graphs as the GPU runner does."""

    def load_model(self, load_dummy_weights: bool = False) -> None:
        super().load_model(load_dummy_weights)
        cc = self.compilation_config
        if cc.mode != CompilationMode.STOCK_TORCH_COMPILE and cc.cudagraph_mode.has_full_cudagraphs():
            self.model = DevgraphGraphWrapper(self.model, self.vllm_config, runtime_mode=CUDAGraphMode.FULL)  # type: ignore[has-type]

    def get_model(self) -> Any:
        model: Any = self.model
        return model.unwrap() if isinstance(model, DevgraphGraphWrapper) else model


class DevgraphCPUWorker(CPUWorker):
    """vLLM's CPU worker plus graph capture after warm-up."""

    def init_device(self) -> None:
        from vllm.v1.worker.workspace import init_workspace_manager

        super().init_device()
        # capture_model() locks the workspace afterwards, so it must exist (the GPU worker makes it).
        init_workspace_manager(self.device, 1)
        if not isinstance(self.model_runner, CPUModelRunner) or self.use_v2_model_runner:  # type: ignore[has-type]
            raise RuntimeError("devgraph's vLLM adapter supports vLLM's V1 CPU model runner only")
        self.model_runner = DevgraphCPUModelRunner(self.vllm_config, torch.device("cpu"))

    def compile_or_warm_up_model(self) -> Any:
        times = super().compile_or_warm_up_model()
        if (
            not self.model_config.enforce_eager
            and self.compilation_config.cudagraph_mode != CUDAGraphMode.NONE
        ):
            self.model_runner.capture_model()
            # Capture ran dummy batches; start generation from the seed as vLLM's GPU worker does.
            set_random_seed(self.model_config.seed, self.parallel_config.data_parallel_index)
        return times
