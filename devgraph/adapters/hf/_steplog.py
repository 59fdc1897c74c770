"""What a ``generate`` served from graphs, step by step, for ``devgraph.bisect`` (``GraphedCausalLM.served_steps``).

While a log is set on the decode route and the prefill (``log`` attributes, None otherwise: one
attribute test per step), each runner call is recorded as a ``devgraph.debug.ServedStep``: the
runner's arguments (cloned), its output (cloned), the KV cache it wrote, and a copy of every cache
tensor (the shared cache and, in the piecewise and breakable modes, the prefill's one-row scratch
cache) from right before it, to put back. Copying the cache per step is what a bisect of a tiny or
small model can afford; ``limit`` bounds the steps recorded (later steps run unrecorded).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from devgraph._errors import DevgraphError
from devgraph.adapters.hf._cache import SharedStaticCache

__all__ = ["StepLog"]

#: Steps a bisect of ``generate`` records by default (prefill rows count one each).
MAX_STEPS = 32


class StepLog:
    """Records the steps served from graphs over ``caches`` (at most ``limit``)."""

    def __init__(self, caches: list[SharedStaticCache], limit: int = MAX_STEPS) -> None:
        self.caches = caches
        self.limit = limit
        self.steps: list[Any] = []  # devgraph.debug.ServedStep
        self.unrecorded = 0
        self.decode_steps = 0

    def _tensors(self) -> list[torch.Tensor]:
        out = []
        for cache in self.caches:
            if cache.allocated:
                for layer in cache.base.layers:
                    out += [layer.keys, layer.values, layer.cumulative_length]
        return out

    def serve(
        self,
        name: str,
        runner: Any,
        kwargs: dict[str, Any],
        written: Callable[[], list[torch.Tensor]],
    ) -> Any:
        """``runner(**kwargs)``, recorded as the step ``name`` (``written``: the state it writes)."""
        if len(self.steps) >= self.limit:
            self.unrecorded += 1
            return runner(**kwargs)
        from devgraph.debug import ServedStep

        saved = [t.clone() for t in self._tensors()]

        def restore() -> None:
            for dst, src in zip(self._tensors(), saved, strict=True):
                dst.copy_(src)

        def record(step_runner: Any, arguments: dict[str, Any], output: Any, shared: dict[str, Any]) -> None:
            self.steps.append(
                ServedStep(
                    name=name,
                    runner=step_runner,
                    kwargs=arguments,
                    output=output,
                    written=[t.clone() for t in written()],
                    restore=restore,
                    read_written=written,
                    shared=shared,
                )
            )

        graphs = getattr(runner, "graphs", None)
        if graphs is not None:  # a TracedModule: the step is the graph Dynamo traced for it
            with graphs.recording() as served:
                out = runner(**kwargs)
            if len(served) > 1:
                raise DevgraphError(
                    f"{name} was served by {len(served)} graphs (Dynamo broke the decode step's graph: see "
                    "graphed.stats.graph_breaks); a step is bisected as one graph. Bisect a wrapper made "
                    "with frontend='raw', which captures the step whole"
                )
            if served:
                graph = served[0].graph
                batched = set(graph.batch_dims)
                named = dict(zip(graph.arguments, served[0].arguments, strict=True))
                arguments = {k: v for k, v in named.items() if k in batched}
                shared = {k: v for k, v in named.items() if k not in batched}
                record(served[0].runner, arguments, list(served[0].outputs), shared)
            return out
        arguments = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        out = runner(**kwargs)
        record(runner, arguments, out.clone(), {})
        return out

    def decode(self, runner: Any, cache: SharedStaticCache, kwargs: dict[str, Any]) -> Any:
        """A decode step of ``rows`` rows: it writes those rows of the shared cache."""
        self.decode_steps += 1
        rows = kwargs["input_ids"].shape[0]

        def written() -> list[torch.Tensor]:
            return [t[:rows] for layer in cache.base.layers for t in (layer.keys, layer.values)]

        return self.serve(f"decode step {self.decode_steps} of generate", runner, kwargs, written)

    def prefill_row(
        self, what: str, runner: Any, scratch: SharedStaticCache, row: int, rows: int, kwargs: dict[str, Any]
    ) -> Any:
        """One prompt row through the prefill's graphs: it writes the scratch cache's first tokens."""
        tokens = kwargs["input_ids"].shape[0]

        def written() -> list[torch.Tensor]:
            return [t[:, :, :tokens] for layer in scratch.base.layers for t in (layer.keys, layer.values)]

        return self.serve(f"the prefill {what}, prompt row {row} of {rows}", runner, kwargs, written)
