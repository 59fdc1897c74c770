"""SGLang adapter: decode graphs of a real ``sgl.Engine`` captured and replayed through devgraph.

Pinned to SGLang 0.5.23 (``pip install 'devgraph[sglang]'``). It plugs in through SGLang's own
extension points only, and does nothing until selected with ``SGLANG_PLATFORM=devgraph``:

* a platform plugin (entry point ``sglang.srt.platforms`` -> ``devgraph``): ``activate()`` returns
  the devgraph platform class only when ``SGLANG_PLATFORM=devgraph``; the platform declares
  ``graph_capture`` and answers ``get_graph_runner_cls()`` / ``get_full_graph_backend_cls()``;
* a graph backend (``DevgraphGraphBackend``, SGLang's ``BaseCudaGraphBackend``) over
  ``devgraph.Graph``: one shared pool, devgraph's capture stream, weak-ref outputs, task update
  (``replay_with_input_update`` -> ``Graph.replay(host_args=...)``);
* decode runners (``DevgraphDecodeGraphRunner``; ``DevgraphNPUGraphRunner`` on NPU hosts, where
  SGLang builds its in-tree backend before asking the platform) that make devgraph's backend the
  one that captures;
* a general plugin (entry point ``sglang.srt.plugins`` -> ``devgraph``) registering the
  ``devgraph`` attention backend: decode through ``devgraph.ops.paged_decode_attention`` with host
  lengths given at every replay by task update, so the CPU reference runs the NPU's update path;
  prefill inside prefill graphs through the break op ``devgraph_sglang::extend_attention``;
* prefill graphs (opt-in, SGLang's ``--cuda-graph-backend-prefill breakable``) by devgraph's
  breakable capture (``DevgraphBreakableBackend``: one ``devgraph.BreakableGraph`` per token bucket of
  SGLang's prefill runner), reached through one ``HookRegistry`` hook around SGLang's
  ``resolve_prefill_backend`` that the general plugin registers under ``SGLANG_PLATFORM=devgraph`` only
  (SGLang 0.5.23 has no platform hook for the prefill backend).

``stats()`` returns this process's counters (captures, replays per bucket, padded rows, task
updates); with ``DEVGRAPH_SGLANG_STATS=<file>`` they are also written there as JSON after every
capture and replay, so a test can read the counters of an engine's scheduler process.

Limits at SGLang 0.5.23: prefill graphs by breakable capture only (not ``full``), with the
``devgraph`` attention backend.
"""

from __future__ import annotations

from devgraph.adapters.sglang._stats import GraphStats, stats

SGLANG_VERSION = "0.5.23"
"""The SGLang release this adapter is written and tested against."""

__all__ = ["SGLANG_VERSION", "GraphStats", "stats"]
