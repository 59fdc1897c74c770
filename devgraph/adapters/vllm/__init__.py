"""vLLM adapter: a vLLM platform plugin whose graphs are captured and replayed through devgraph.

Installed with ``pip install 'devgraph[vllm]'``; vLLM finds it through the ``vllm.platform_plugins``
entry point ``devgraph``. It is inert unless ``DEVGRAPH_VLLM=1``: then the platform vLLM would use on
devgraph's device (``DEVGRAPH_BACKEND`` or the best available one) is subclassed so that

* ``get_static_graph_wrapper_cls()`` is ``DevgraphGraphWrapper`` (vLLM's piecewise backend wraps every
  piece with it);
* the worker is the platform's own, whose model runner gets one device-neutral devgraph piece
  (``_runner``): the model's FULL wrapper (vLLM's, vllm-ascend's, or none on CPU) becomes a
  ``DevgraphGraphWrapper``, profiling-time graphs are cleared, over-size eager decode is counted;
* on devices that freeze host arguments (CPU reference, NPU) FULL graphs use devgraph's attention,
  task-updated every step;
* with vLLM's own switch ``VLLM_USE_BREAKABLE_CUDAGRAPH=1`` the PIECEWISE batches replay devgraph
  breakable graphs of the uncompiled model (``DevgraphGraphWrapper.breakable``), cut at vLLM's
  attention and KV-cache ops, in place of vLLM's CUDA-only ``BreakableCUDAGraphWrapper``;
* the graph pool is one devgraph pool, captures run on the devgraph device's capture stream;
* on the CPU reference backend, graphs are switched back on (vLLM's CPU platform turns them off)
  and the worker runs vLLM's own ``capture_model()`` after warm-up.

Everything else of the platform is vLLM's own. See README, section "vLLM".
"""

from __future__ import annotations

from devgraph.adapters.vllm._plugin import DEVGRAPH_VLLM_ENV, is_enabled, register
from devgraph.adapters.vllm._stats import reset_stats, stats

__all__ = ["DEVGRAPH_VLLM_ENV", "DevgraphGraphWrapper", "is_enabled", "register", "reset_stats", "stats"]


def __getattr__(name: str):
    # The wrapper imports vLLM; keep ``import devgraph.adapters.vllm`` (the entry point) cheap.
    if name == "DevgraphGraphWrapper":
        from devgraph.adapters.vllm._wrapper import DevgraphGraphWrapper

        return DevgraphGraphWrapper
    raise AttributeError(name)
