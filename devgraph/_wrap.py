"""``devgraph.wrap``: the front door."""

from __future__ import annotations

from typing import Any

from devgraph._contract import Device
from devgraph._errors import DevgraphError
from devgraph._plugins import device as _device

__all__ = ["GraphedModule", "wrap"]


class GraphedModule:
    """A model whose calls are served by captured graphs (callable like the model).

    Outputs are views of graph memory, overwritten by the next call, unless the model was wrapped
    with ``clone_outputs=True``. Attributes the wrapper does not define are the model's own.
    """

    def __init__(self, module: Any, runner: Any) -> None:
        self.module = module
        self.runner = runner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.runner(*args, **kwargs)

    def capture(self, *example_args: Any, **example_kwargs: Any) -> GraphedModule:
        """Capture every bucket now from an example call (any batch size); otherwise the first call does."""
        self.runner.capture(*example_args, **example_kwargs)
        return self

    @property
    def stats(self) -> Any:
        """Counters: replays, eager calls, fallbacks by reason, capture seconds, pool bytes."""
        return self.runner.stats

    @property
    def device(self) -> Device:
        return self.runner.device

    def __getattr__(self, name: str) -> Any:
        if name in ("module", "runner"):
            raise AttributeError(name)
        return getattr(self.module, name)

    def __repr__(self) -> str:
        return (
            f"<GraphedModule {type(self.module).__name__} on {self.runner.device}, sizes {self.runner.sizes}>"
        )


def _is_hf_model(model: Any) -> bool:
    return any(
        c.__module__.startswith("transformers.") and c.__name__ == "PreTrainedModel"
        for c in type(model).__mro__
    )


def wrap(model: Any, device: str | Device | None = None, **options: Any) -> Any:
    """Serve ``model``'s calls from graphs captured per batch-size bucket on ``device``.

    Args:
        model: an ``nn.Module`` (or callable) taking tensors, or a Hugging Face causal LM (its decode
            step is captured over a static KV cache; ``generate()`` is then graphed).
        device: a backend name (``"cuda"``, ``"npu"``, ``"cpu"``), a ``devgraph.Device``, or None for
            the best available.
        options: ``devgraph.runner.RunnerConfig`` fields (``max_batch_size``, ``batch_sizes``,
            ``pad_values``, ``host_args``, ``static_args``, ``batch_dims``, ``clone_outputs``,
            ``strict``, ``debug``, ``warmup_iters``, ``mode``), with ``mode='piecewise'`` or
            ``'full_and_piecewise'`` also ``devgraph.compile.CompileConfig`` fields (``splitting_ops``,
            ``compile_backend``, ``passes``, ``capture_sizes``, ``capture_budget``, ``traffic``,
            ``is_decode``), plus adapter options. A model's own ``devgraph_options()`` provides defaults.
    Raises:
        DevgraphError: an unknown option (the message lists the valid ones).
    """
    dev = device if isinstance(device, Device) else _device(device)
    if _is_hf_model(model):
        from devgraph.adapters.hf import wrap_hf

        return wrap_hf(model, dev, **options)
    from devgraph.compile import compile_option_names
    from devgraph.runner import GraphRunner, RunnerConfig, make_config

    defaults = model.devgraph_options() if hasattr(model, "devgraph_options") else {}
    merged = {**defaults, **options}
    compile_names = compile_option_names()
    compile_options = {k: merged.pop(k) for k in list(merged) if k in compile_names}
    config = make_config(RunnerConfig, merged, extra_valid=compile_names)
    if config.mode != "full":
        from devgraph.compile import piecewise_runner

        return GraphedModule(model, piecewise_runner(model, dev, config, **compile_options))
    if compile_options:
        raise DevgraphError(
            f"option(s) {sorted(compile_options)} apply to mode='piecewise' or mode='full_and_piecewise' "
            "only; add mode=... or drop them"
        )
    return GraphedModule(model, GraphRunner(model, dev, config))
