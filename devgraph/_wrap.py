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
    with ``clone_outputs=True``; without it one live thread at a time may call (a second is
    refused). Attributes the wrapper does not define are the model's own.

    ``eval()``, ``train()``, ``requires_grad_()``, ``to()`` and the other ``nn.Module`` methods
    that return the module return the wrapper, so graphs keep serving calls; a change the graphs
    cannot follow (a weight moved or cast, a training flag flipped) drops them and the next call
    captures again. Moving the model off the wrapper's device is refused: wrap it again there.
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

    # -- nn.Module methods that return the module: keep the wrapper -------------------------------

    def train(self, mode: bool = True) -> Any:
        """``module.train(mode)``; graphs captured in the other mode are dropped (captured again)."""
        return self._module_method("train", mode)

    def eval(self) -> Any:
        """``module.eval()``; graphs captured in training mode are dropped (captured again)."""
        return self._module_method("eval")

    def requires_grad_(self, requires_grad: bool = True) -> Any:
        """``module.requires_grad_(...)``; calls run without autograd, so the graphs stay."""
        return self._module_method("requires_grad_", requires_grad)

    def to(self, *args: Any, **kwargs: Any) -> Any:
        """``module.to(...)``; a cast drops the graphs (captured again). Raises ``DevgraphError`` for
        another device type than the wrapper's: wrap the moved model again instead."""
        import torch

        target = torch._C._nn._parse_to(*args, **kwargs)[0]
        return self._module_method("to", *args, to_device=target, **kwargs)

    def cuda(self, *args: Any, **kwargs: Any) -> Any:
        return self._module_method("cuda", *args, to_device="cuda", **kwargs)

    def cpu(self) -> Any:
        return self._module_method("cpu", to_device="cpu")

    def half(self) -> Any:
        return self._module_method("half")

    def float(self) -> Any:
        return self._module_method("float")

    def double(self) -> Any:
        return self._module_method("double")

    def bfloat16(self) -> Any:
        return self._module_method("bfloat16")

    def type(self, dst_type: Any) -> Any:
        return self._module_method("type", dst_type)

    def apply(self, fn: Any) -> Any:
        return self._module_method("apply", fn)

    def _module_method(self, name: str, *args: Any, to_device: Any = None, **kwargs: Any) -> Any:
        """Run ``module.<name>(...)``; drop the graphs when it changed what they captured; return
        the wrapper where the module returned itself."""
        if to_device is not None:
            self._check_device(name, to_device)
        before = _captured_state(self.module)
        result = getattr(self.module, name)(*args, **kwargs)
        if _captured_state(self.module) != before:
            self._drop_graphs()  # weights moved, cast or replaced, or a training flag flipped
        return self if result is self.module else result

    def _drop_graphs(self) -> None:
        """Forget everything captured for the module as it was; the next call captures again."""
        self.runner.reset()

    def _check_device(self, name: str, target: Any) -> None:
        import torch

        kind = torch.device(target).type
        mine = torch.device(self.runner.device.torch_device).type
        if kind != mine:
            raise DevgraphError(
                f".{name}() would move the model to {kind}, but this wrapper captures on {self.runner.device} "
                f"({mine}); its graphs cannot follow. Wrap the moved model again: "
                f"devgraph.wrap(model.{name}(...), device={kind!r})"
            )

    def __getattr__(self, name: str) -> Any:
        if name in ("module", "runner"):
            raise AttributeError(name)
        return getattr(self.module, name)

    def __repr__(self) -> str:
        return (
            f"<GraphedModule {type(self.module).__name__} on {self.runner.device}, sizes {self.runner.sizes}>"
        )


def _captured_state(module: Any) -> Any:
    """What graphs depend on besides the inputs: every weight's address, dtype and device, and
    every submodule's training flag (None for a plain callable)."""
    if not hasattr(module, "named_parameters"):
        return None
    weights = [
        (name, t.data_ptr(), t.dtype, t.device)
        for name, t in [*module.named_parameters(), *module.named_buffers()]
    ]
    return weights, [m.training for m in module.modules()]


def _is_hf_model(model: Any) -> bool:
    return any(
        c.__module__.startswith("transformers.") and c.__name__ == "PreTrainedModel"
        for c in type(model).__mro__
    )


def _argument_names(model: Any) -> list[str] | None:
    """The argument names of ``model``'s calls (None: unknown, or open-ended ``*args``/``**kwargs``)."""
    from devgraph.runner._calls import signature_of

    try:
        params = list(signature_of(model).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        return None
    return [p.name for p in params]


def wrap(model: Any, device: str | Device | Any | None = None, **options: Any) -> Any:
    """Serve ``model``'s calls from graphs captured per batch-size bucket on ``device``.

    Args:
        model: an ``nn.Module`` (or callable) taking tensors, or a Hugging Face causal LM (its decode
            step is captured over a static KV cache; ``generate()`` is then graphed).
        device: a backend name (``"cuda"``, ``"npu"``, ``"cpu"``), a ``torch.device``, a
            ``devgraph.Device``, or None for the best available.
        options: ``devgraph.runner.RunnerConfig`` fields (``max_batch_size``, ``batch_sizes``,
            ``pad_values``, ``host_args``, ``static_args``, ``batch_dims``, ``clone_outputs``,
            ``strict``, ``debug``, ``warmup_iters``, ``mode``, ``process_group``, ``check_ranks``,
            ``capture_context``), with ``mode='piecewise'`` or
            ``'full_and_piecewise'`` also ``devgraph.compile.CompileConfig`` fields (``splitting_ops``,
            ``compile_backend``, ``passes``, ``capture_sizes``, ``capture_budget``, ``traffic``,
            ``is_decode``), plus adapter options. A model's own ``devgraph_options()`` provides defaults.
    Raises:
        DevgraphError: an unknown option (the message lists the valid ones), a bad value (batch
            sizes must be positive integers), or ``static_args``/``pad_values``/``batch_dims``/
            ``host_args`` naming an argument the model does not take (the message lists those it does).
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
    config = make_config(RunnerConfig, merged, extra_valid=compile_names, arguments=_argument_names(model))
    if config.mode != "full":
        from devgraph.compile import piecewise_runner

        return GraphedModule(model, piecewise_runner(model, dev, config, **compile_options))
    if compile_options:
        raise DevgraphError(
            f"option(s) {sorted(compile_options)} apply to mode='piecewise' or mode='full_and_piecewise' "
            "only; add mode=... or drop them"
        )
    return GraphedModule(model, GraphRunner(model, dev, config))
