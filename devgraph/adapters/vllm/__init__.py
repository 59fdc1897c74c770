"""vLLM adapter: a vLLM platform plugin whose graphs are captured and replayed through devgraph.

Installed with ``pip install 'devgraph[vllm]'``; vLLM finds it through the ``vllm.platform_plugins``
entry point ``devgraph``. It is inert unless ``DEVGRAPH_VLLM=1``: then the platform vLLM would use on
devgraph's device (``DEVGRAPH_BACKEND`` or the best available one) is subclassed so that

* ``get_static_graph_wrapper_cls()`` is ``DevgraphGraphWrapper`` (vLLM's piecewise backend wraps every
  piece with it) and the model runner wraps the whole model with it for FULL graphs;
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
