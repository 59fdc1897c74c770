"""What a bisect runs: the graph side (captured with the probe, replayed) and the eager side.

A *plan* says, for one target, how to capture it with the probe and replay it, and how to run it
eagerly on the call (and, for a bucket that pads the call, eagerly on the same padded inputs the
graph replays). ``callable_plan`` captures any callable for the purpose; ``served_plan`` rebuilds
the graph a wrapped model serves this call from, through the runner's public face (the one place
that knows the runner: redirect it when the runner changes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from devgraph._errors import DevgraphError
from devgraph.debug._probe import OpProbe, OpRecord, module_names
from devgraph.graph import Device, Graph

__all__ = ["Plan", "callable_plan", "served_plan"]


@attrs.define
class Plan:
    """How to run one target both ways (see the module docstring)."""

    subject: str
    device: Device
    modules: dict[int, str]
    #: capture with the probe, load the call, replay: the probe's records (replayed values), the output
    run_graph: Callable[[], tuple[list[OpRecord], Any]]
    #: the call as given, eagerly, under the probe it is given (its inputs copied outside it)
    run_eager: Callable[[OpProbe], Any]
    #: eager on the padded inputs the graph replays (None: the graph replays the call unpadded)
    run_padded: Callable[[OpProbe], Any] | None = None
    #: the output the served graph returned for the call (wrapped models), cloned
    served: Any = None
    notes: list[str] = attrs.field(factory=list)
    #: graphs to reset once the comparison is done (their pools hold the probe's copies)
    graphs: list[Graph] = attrs.field(factory=list)


def _clone(tree: Any) -> Any:
    return tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree)


def capture_with_probe(
    plan_graphs: list[Graph],
    device: Device,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    modules: dict[int, str],
) -> tuple[Graph, OpProbe, Any]:
    """Capture ``fn(*args, **kwargs)`` on ``device`` with the probe innermost (its copies captured)."""
    graph = device.graph()
    probe = OpProbe(modules)
    with graph.capture(auto_update_ops=device.updatable_ops):
        with probe:
            out = fn(*args, **kwargs)
    plan_graphs.append(graph)
    return graph, probe, out


def _device_of(args: Any, device: str | Device | None) -> Device:
    import devgraph

    if isinstance(device, Device):
        return device
    if device is not None:
        return devgraph.device(device)
    for leaf in tree_flatten(args)[0]:
        if isinstance(leaf, torch.Tensor):
            return devgraph.device(leaf.device.type)
    return devgraph.device("cpu")


def _describe(target: Any) -> str:
    name = getattr(target, "__qualname__", None) or type(target).__name__
    return f"{name}"


def _has_tensor(value: Any) -> bool:
    return any(isinstance(leaf, torch.Tensor) for leaf in tree_flatten(value)[0])


def _frozen_host_values(
    captured: tuple[tuple[Any, ...], dict[str, Any]], call: tuple[tuple[Any, ...], dict[str, Any]]
) -> list[str]:
    """A note per argument without tensors whose value differs between the capture and the call."""
    named = [(f"argument {i}", c, x) for i, (c, x) in enumerate(zip(captured[0], call[0]))]
    named += [(f"argument {k!r}", captured[1][k], call[1][k]) for k in call[1]]
    return [
        f"host {what} is {c!r} at capture and {x!r} in the call: the graph replays the capture's "
        "value (host values are frozen at capture unless an updatable task re-issues them)"
        for what, c, x in named
        if not _has_tensor(c) and c != x
    ]


def callable_plan(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    device: str | Device | None,
    capture_args: tuple[Any, ...] | None,
    capture_kwargs: dict[str, Any] | None,
    subject: str | None = None,
) -> Plan:
    """Capture ``fn`` for the purpose: on copies of ``capture_args`` (default: the call's own), then
    load the call's tensors into them and replay (host values stay as captured, as on a device)."""
    dev = _device_of((args, kwargs), device)
    cap = (
        tuple(args) if capture_args is None else tuple(capture_args),
        dict(kwargs) if capture_kwargs is None else dict(capture_kwargs),
    )
    call_leaves, call_spec = tree_flatten((tuple(args), dict(kwargs)))
    cap_leaves, cap_spec = tree_flatten(cap)
    if call_spec != cap_spec:
        raise DevgraphError(
            "capture_args/capture_kwargs must have the call's structure (the same arguments, tensors in "
            f"the same places); got {cap_spec} for a call of {call_spec}"
        )
    for i, (c, x) in enumerate(zip(cap_leaves, call_leaves)):
        if isinstance(x, torch.Tensor) != isinstance(c, torch.Tensor):
            raise DevgraphError(f"capture argument {i} is {type(c).__name__}, the call's is {type(x).__name__}")
        if isinstance(x, torch.Tensor):
            if x.shape != c.shape or x.dtype != c.dtype:
                raise DevgraphError(
                    f"capture tensor {i} is {tuple(c.shape)} {c.dtype}, the call's {tuple(x.shape)} {x.dtype}: "
                    "a graph replays the shapes it captured; give capture_args of the call's shapes"
                )
    notes = _frozen_host_values(cap, (tuple(args), dict(kwargs)))
    modules = module_names(fn)
    graphs: list[Graph] = []
    static = [c.clone() if isinstance(c, torch.Tensor) else c for c in cap_leaves]

    def run_graph() -> tuple[list[OpRecord], Any]:
        s_args, s_kwargs = tree_unflatten(static, cap_spec)
        with torch.no_grad():
            fn(*_clone(s_args), **_clone(s_kwargs))  # warm-up: lazy initialisation outside the capture
            _, probe, out = capture_with_probe(graphs, dev, fn, s_args, s_kwargs, modules)
            for dst, src in zip(static, call_leaves):
                if isinstance(dst, torch.Tensor):
                    dst.copy_(src)
            graphs[-1].replay()
            dev.synchronize()
        return probe.records, out

    def run_eager(probe: OpProbe) -> Any:
        e_args, e_kwargs = _clone(tuple(args)), _clone(dict(kwargs))
        with torch.no_grad(), probe:
            return fn(*e_args, **e_kwargs)

    plan = Plan(subject or _describe(fn), dev, modules, run_graph, run_eager, notes=notes)
    plan.graphs = graphs
    return plan


def served_plan(graphed: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Plan:
    """The graph a wrapped model (``devgraph.wrap``) serves this call from, rebuilt with the probe.

    The served graph has no copies of its ops' outputs, so the bucket that serves the call is captured
    again as the runner captures it (its static buffers narrowed to the bucket, host lists at their
    pad values, the device's updatable ops as tasks), the call is loaded and replayed as the runner
    replays it (padding, padded host arguments). This is the one function that reads the runner:
    ``sizes``, ``config``, ``inputs`` (read, bind, narrow, load), ``padded_host_args``, ``stats``.
    """
    from devgraph.runner import GraphRunner, choose_bucket

    runner = graphed.runner
    if not isinstance(runner, GraphRunner):
        raise DevgraphError(
            f"bisect of a wrapped model serves {type(runner).__name__} graphs through mode='full' only; "
            "bisect the model itself (devgraph.bisect(graphed.module, ...)) to capture it whole"
        )
    before = runner.stats.replays
    fallbacks = dict(runner.stats.fallbacks)
    with torch.no_grad():
        served = _clone(runner(*args, **kwargs))
    if runner.stats.replays == before:
        new = {k: v for k, v in runner.stats.fallbacks.items() if v != fallbacks.get(k, 0)}
        raise DevgraphError(
            f"this call is not served from a graph (it ran eagerly: {sorted(new) or 'see graphed.stats'}); "
            "nothing to bisect. Bisect the model itself, devgraph.bisect(graphed.module, ...), to capture "
            "this call for the purpose"
        )
    inputs, config, dev = runner.inputs, runner.config, runner.device
    call = inputs.read(args, kwargs)
    size = choose_bucket(call.batch, runner.sizes)
    assert size is not None
    fn = runner.fn
    modules = module_names(fn)
    graphs: list[Graph] = []

    def bound(tensors: dict[str, torch.Tensor], host: dict[str, list[Any]]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        values: dict[str, Any] = dict(tensors)
        values.update(call.static)
        values.update(call.consts)
        values.update(host)
        return call.bind(inputs.signature, values)

    def run_graph() -> tuple[list[OpRecord], Any]:
        host = {name: [config.pad_value(name)] * size for name in call.host}
        c_args, c_kwargs = bound(dict(inputs.narrowed(size)), host)
        with torch.no_grad():
            graph, probe, out = capture_with_probe(graphs, dev, fn, c_args, c_kwargs, modules)
            inputs.load(call, size)
            graph.replay(runner.padded_host_args(call.host, size) if config.host_args else None)
            dev.synchronize()
        return probe.records, out

    def run_eager(probe: OpProbe) -> Any:
        e_args, e_kwargs = _clone(tuple(args)), _clone(dict(kwargs))
        with torch.no_grad(), probe:
            return fn(*e_args, **e_kwargs)

    def run_padded(probe: OpProbe) -> Any:
        inputs.load(call, size)
        tensors = {n: t.clone() for n, t in inputs.narrowed(size).items()}
        host = {n: list(v) + [config.pad_value(n)] * (size - call.batch) for n, v in call.host.items()}
        p_args, p_kwargs = bound(tensors, host)
        with torch.no_grad(), probe:
            return fn(*p_args, **p_kwargs)

    subject = (
        f"{_describe(fn)} wrapped, the graph of bucket {size} serving a call of {call.batch} rows"
    )
    plan = Plan(
        subject, dev, modules, run_graph, run_eager, run_padded if size != call.batch else None, served
    )
    plan.graphs = graphs
    return plan
