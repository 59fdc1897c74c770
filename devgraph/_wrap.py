"""``devgraph.wrap``: the front door."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from devgraph._errors import DevgraphError
from devgraph._plugins import device as _device
from devgraph.graph import Device

if TYPE_CHECKING:  # torch is imported when first needed: ``import devgraph`` stays cheap
    import torch

    from devgraph.runner import GraphedModule

__all__ = ["wrap"]


def _is_hf_model(model: object) -> bool:
    return any(
        c.__module__.startswith("transformers.") and c.__name__ == "PreTrainedModel"
        for c in type(model).__mro__
    )


def _argument_names(model: Callable[..., Any]) -> list[str] | None:
    """The argument names of ``model``'s calls (None: unknown, or open-ended ``*args``/``**kwargs``)."""
    from devgraph.runner import signature_of

    try:
        params = list(signature_of(model).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        return None
    return [p.name for p in params]


def wrap(
    model: Callable[..., Any], device: str | Device | torch.device | None = None, **options: Any
) -> GraphedModule:
    """Serve ``model``'s calls from graphs captured per batch-size bucket on ``device``.

    In the ``full`` (default), ``piecewise`` and ``breakable`` modes Dynamo traces the forward and
    devgraph captures each graph it hands over (``devgraph.frontend.TracedModule``): Dynamo's guards
    decide at every call whether a graph may serve it, Python side effects happen at every call, code
    Dynamo cannot trace runs eagerly between graphs. ``frontend='raw'`` (and, by default, the
    ``full_and_*`` modes) captures the forward as it runs, untraced, and warns once what that leaves
    unchecked.

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
            ``is_decode``), plus adapter options. ``frontend``: ``'dynamo'`` (the default but in
            the ``full_and_*`` modes) or ``'raw'``;
            ``fullgraph=True`` (Dynamo in front) refuses a graph break. A model's own
            ``devgraph_options()`` provides defaults (``frontend`` included).
    Raises:
        DevgraphError: an unknown option (the message lists the valid ones), a bad value (batch
            sizes must be positive integers), or ``static_args``/``pad_values``/``batch_dims``/
            ``host_args`` naming an argument the model does not take (the message lists those it does),
            ``host_args`` with Dynamo in front (pass ``frontend='raw'``), or a mode Dynamo does not
            serve with ``frontend='dynamo'``.
    """
    dev = device if isinstance(device, Device) else _device(device)
    refuse_host_weights(model, dev.torch_device)
    defaults = (
        {} if _is_hf_model(model) or not hasattr(model, "devgraph_options") else model.devgraph_options()
    )
    frontend = options.pop("frontend", defaults.get("frontend"))
    if frontend not in (None, "dynamo", "raw"):
        raise DevgraphError(
            f"frontend must be 'dynamo' (Dynamo traces the forward, devgraph captures its graphs; the default "
            f"in mode='full') or 'raw' (the forward captured as it runs, untraced), got {frontend!r}"
        )
    if _is_hf_model(model):
        from devgraph.adapters.hf import wrap_hf

        if frontend == "raw":
            warn_untraced(model, "full")
        return wrap_hf(model, dev, frontend=frontend or "dynamo", **options)
    merged = {k: v for k, v in {**defaults, **options}.items() if k != "frontend"}
    mode = merged.get("mode", "full")
    from devgraph.runner import MODE_TABLE

    routes = mode in MODE_TABLE and MODE_TABLE[mode].routes
    if frontend is None:
        # A model the user compiled already has Dynamo in front of their compiler: captured as it runs
        # (its compiled code recorded whole), not traced again with devgraph's backend instead.
        compiled = type(model).__name__ == "OptimizedModule"
        frontend = "dynamo" if mode in ("full", "breakable", "piecewise") and not compiled else "raw"
    elif frontend == "dynamo" and routes:
        raise DevgraphError(
            f"frontend='dynamo' serves mode='full', 'breakable' and 'piecewise'; mode={mode!r} routes decode "
            "batches with is_decode, called with the model's own arguments: drop frontend (or pass 'raw')"
        )
    if frontend == "dynamo":
        from devgraph.frontend import wrap_traced

        return wrap_traced(model, dev, merged)
    warn_untraced(model, mode)
    from devgraph.compile import compile_option_names
    from devgraph.runner import GraphedModule, GraphRunner, RunnerConfig, make_config, piecewise_runner

    compile_names = compile_option_names()
    compile_options = {k: merged.pop(k) for k in list(merged) if k in compile_names}
    config = make_config(RunnerConfig, merged, extra_valid=compile_names, arguments=_argument_names(model))
    if MODE_TABLE[config.mode].serves == "breakable":
        is_decode = compile_options.pop("is_decode", None)
        if compile_options:
            raise DevgraphError(
                f"option(s) {sorted(compile_options)} apply to mode='piecewise' or mode='full_and_piecewise' "
                f"only: mode={config.mode!r} traces and compiles nothing (breaks=[...] names the ops it "
                "runs eagerly)"
            )
        return GraphedModule(model, GraphRunner(model, dev, config, is_decode=is_decode))
    if MODE_TABLE[config.mode].serves == "pieces":
        return GraphedModule(model, piecewise_runner(model, dev, config, **compile_options))
    if compile_options:
        raise DevgraphError(
            f"option(s) {sorted(compile_options)} apply to mode='piecewise' or mode='full_and_piecewise' "
            "only; add mode=... or drop them"
        )
    return GraphedModule(model, GraphRunner(model, dev, config))


#: What a forward served without Dynamo's guards leaves unchecked (the one warning of such a wrap).
UNTRACED = (
    "Python state the forward reads (attributes, globals, closures, config objects) is not guarded, and "
    "what it changes outside its tensors (counters, lists, random draws) happens at capture only; "
    "devgraph's own checks follow the model's attributes and buffers, not every path Python can take. "
    "You promise the forward reads and changes no other Python state"
)


def warn_untraced(model: Any, mode: str) -> None:
    """Warn once per wrap served without Dynamo in front: what ``frontend='raw'`` (or a mode Dynamo
    does not serve yet) leaves unchecked. ``stats.frontend`` says ``"raw"`` too."""
    import warnings

    from devgraph._source import user_stacklevel

    if mode == "full":
        how, instead = (
            "frontend='raw' captures the forward as it runs, untraced",
            "the default frontend='dynamo'",
        )
    elif mode in ("piecewise", "breakable"):
        how = f"mode={mode!r} is served from one trace or capture of the forward, without Dynamo's guards at each call"
        instead = "the default frontend='dynamo' (Dynamo in front of this mode)"
    else:
        how = f"mode={mode!r} is served from one trace or capture of the forward, without Dynamo's guards at each call"
        instead = "mode='full', or 'piecewise' / 'breakable' with frontend='dynamo',"
    warnings.warn(
        f"devgraph: {type(model).__name__}: {how}: {UNTRACED}; {instead} checks all of it "
        "(stats.frontend says 'raw')",
        stacklevel=user_stacklevel(),
    )


def refuse_host_weights(model: Any, target: torch.device) -> None:
    """Refuse, at wrap time, a module whose parameters or buffers are on the CPU while its graphs are
    for a device: a device graph records device work only, so CPU layers would run once, at capture,
    and every replay would reuse their results (the capture would refuse them too, later)."""
    import torch

    if target.type == "cpu" or not isinstance(model, torch.nn.Module):
        return
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, tensor in named:
            if tensor.device.type == "cpu":
                raise DevgraphError(
                    f"{type(model).__name__}'s {kind} {name!r} is on the CPU, and its graphs would be "
                    f"captured on {target}: a device graph records device work only, so what reads "
                    f"it would run once, at capture. Move the model first: model.to({str(target)!r}), "
                    "then devgraph.wrap(model, ...)"
                )
