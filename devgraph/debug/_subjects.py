"""What a bisect runs: the graph side (captured with the probe, replayed) and the eager side.

A *plan* says, for one target, how to capture it with the probe and replay it, and what to run
eagerly: the call, and, for a bucket that pads the call, the same padded inputs the graph replays.
The probe reaches every capture through ``devgraph.graph.probe_captures``, so whatever holds the
graphs (one graph, a piecewise runner's pieces, a breakable graph's segments) is probed alike.
``callable_plan`` captures any callable for the purpose; ``served_plan`` rebuilds the graphs a
wrapped model serves this call from, through the runner's public face (the one place that knows the
runners: redirect it when they change).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import attrs
import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from devgraph._errors import DevgraphError
from devgraph.debug._probe import OpProbe, OpRecord, module_names
from devgraph.graph import Device, probe_captures

__all__ = ["Call", "Plan", "callable_plan", "probed", "served_plan", "traced_plans"]


@attrs.frozen
class Call:
    """``fn(*args, **kwargs)``: what an eager side runs."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    #: run before each run of the call, outside the probe (a step of generate: put its KV cache back)
    before: Callable[[], None] | None = None


@attrs.define
class Plan:
    """How to run one target both ways (see the module docstring)."""

    subject: str
    device: Device
    modules: dict[int, str]
    #: capture with the probe, load the call, replay: the probe's records (replayed values), the output
    run_graph: Callable[[], tuple[list[OpRecord], Any]]
    #: the call as given (run eagerly on copies of its tensors)
    eager: Call
    #: the padded inputs the graph replays, eagerly (None: the graph replays the call unpadded);
    #: a callable, as the inputs exist only once the call is loaded
    padded: Callable[[], Call] | None = None
    #: the output the served graph returned for the call (wrapped models), cloned
    served: Any = None
    notes: list[str] = attrs.field(factory=list)
    #: run once the comparison is done (reset the graphs: their pools hold the probe's copies)
    cleanup: list[Callable[[], None]] = attrs.field(factory=list)


def clone_tensors(tree: Any) -> Any:
    return tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree)


@contextmanager
def probed(modules: dict[int, str]) -> Iterator[list[OpRecord]]:
    """Every capture in the block copies its ops' outputs into the records yielded (in order)."""
    records: list[OpRecord] = []
    with probe_captures(lambda graph: OpProbe(modules, records=records)):
        yield records


def _device_of(args: Any, device: str | Device | None) -> Device:
    from devgraph._plugins import device as find_device

    if isinstance(device, Device):
        return device
    if device is not None:
        return find_device(device)
    for leaf in tree_flatten(args)[0]:
        if isinstance(leaf, torch.Tensor):
            return find_device(leaf.device.type)
    return find_device("cpu")


def _describe(target: Any) -> str:
    return getattr(target, "__qualname__", None) or type(target).__name__


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
            raise DevgraphError(
                f"capture argument {i} is {type(c).__name__}, the call's is {type(x).__name__}"
            )
        if isinstance(x, torch.Tensor) and (x.shape != c.shape or x.dtype != c.dtype):
            raise DevgraphError(
                f"capture tensor {i} is {tuple(c.shape)} {c.dtype}, the call's {tuple(x.shape)} {x.dtype}: "
                "a graph replays the shapes it captured; give capture_args of the call's shapes"
            )
    notes = _frozen_host_values(cap, (tuple(args), dict(kwargs)))
    modules = module_names(fn)
    static = [c.clone() if isinstance(c, torch.Tensor) else c for c in cap_leaves]
    cleanup: list[Callable[[], None]] = []

    def run_graph() -> tuple[list[OpRecord], Any]:
        s_args, s_kwargs = tree_unflatten(static, cap_spec)
        with torch.no_grad():
            fn(*clone_tensors(s_args), **clone_tensors(s_kwargs))  # warm-up: lazy initialisation
            graph = dev.graph()
            cleanup.append(graph.reset)
            with probed(modules) as records, graph.capture(auto_update_ops=dev.updatable_ops):
                out = fn(*s_args, **s_kwargs)
            for dst, src in zip(static, call_leaves):
                if isinstance(dst, torch.Tensor):
                    dst.copy_(src)
            graph.replay()
            dev.synchronize()
        return records, out

    return Plan(
        subject or _describe(fn),
        dev,
        modules,
        run_graph,
        Call(fn, tuple(args), dict(kwargs)),
        notes=notes,
        cleanup=cleanup,
    )


def served_plan(graphed: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Plan:
    """The graphs a wrapped model (``devgraph.wrap``) serves this call from, rebuilt with the probe.

    The served graphs hold no copies of their ops' outputs, so they are captured again as the runner
    captures them and replayed as it replays (see ``_full_plan`` and ``_piecewise_plan``). The call is
    served once first: a call the runner serves eagerly is refused, and its output is what the
    report's ``reproduces`` compares with.
    """
    runner = graphed.runner
    parts = runner.parts
    before = [p.stats.replays for p in parts]
    fallbacks = dict(runner.stats.fallbacks)
    with torch.no_grad():
        served = clone_tensors(runner(*args, **kwargs))
    after = [p.stats.replays for p in parts]
    if after == before:
        new = sorted(k for k, v in runner.stats.fallbacks.items() if v != fallbacks.get(k, 0))
        raise DevgraphError(
            f"this call is not served from a graph (it ran eagerly: {new or 'see graphed.stats'}); "
            "nothing to bisect. Bisect the model itself, devgraph.bisect(graphed.module, ...), to capture "
            "this call for the purpose"
        )
    # The part whose replays moved served it (full_and_piecewise: the full graphs of a decode batch).
    part = next(p for p, b, a in zip(parts, before, after) if a != b)
    plan = _part_plan(part, args, kwargs)
    plan.served = served
    return plan


def _part_plan(part: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Plan:
    """The plan of the runner part that served a call: its bucket captured again with the probe, as
    the part says (``part.words.probe``: a graph per bucket made by its ``make_graph``, or pieces)."""
    probe = part.words.probe
    if probe == "whole":
        noun = "breakable graph" if part.words.kind == "breakable" else "graph"
        return _full_plan(part, args, kwargs, part.make_graph, noun)
    if probe == "pieces":
        return _piecewise_plan(part, args, kwargs)
    raise DevgraphError(
        f"bisect does not know how to probe the part {type(part).__name__} (words.probe={probe!r}); "
        "bisect graphed.module"
    )


def traced_plans(traced: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Plan]:
    """The graphs that served this call of a ``devgraph.wrap(..., frontend="dynamo")`` model, one plan
    each, in call order: the call is made once with the graphs' replays logged (the arguments Dynamo
    gave each graph), then each graph's bucket is captured again with the probe and replayed as its
    runner replays it (``_full_plan``), against the graph Dynamo traced run eagerly, node by node (each
    op named at the user's line the node came from). The graphs served are the graphs bisected: a
    graph Dynamo's guards no longer pick is never looked at."""
    graphs = traced.graphs
    with graphs.recording() as log, torch.no_grad():
        traced(*args, **kwargs)
    if not log:
        raise DevgraphError(
            "this call is not served from a graph (Dynamo or devgraph ran it eagerly: see graphed.stats); "
            "nothing to bisect. Bisect the model itself, devgraph.bisect(graphed.module, ...), to capture "
            "this call for the purpose"
        )
    plans = []
    for k, served in enumerate(log):
        graph, runner = served.graph, served.runner
        # run node by node under each node's meta (ops named at the user's lines), except where the
        # part traces the graph again (pieces: Dynamo does not trace torch.fx's interpreter)
        graph.interpret = runner.pieces is None
        plan = _part_plan(runner.part, tuple(served.arguments), {})
        plan.cleanup.append(functools.partial(setattr, graph, "interpret", False))
        plan.served = tuple(served.outputs)
        which = (
            f"graph {k + 1} of {len(log)} Dynamo traced for the call"
            if len(log) > 1
            else "the graph Dynamo traced"
        )
        what = plan.subject.split(" wrapped", 1)[-1].lstrip(" ,")  # "the graph of bucket 4 serving ..."
        plan.subject = f"{_describe(traced.module)} through Dynamo, {which}: {what}"
        plans.append(plan)
    return plans


def _full_plan(
    runner: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    make_graph: Callable[[], Any] | None = None,
    noun: str = "graph",
    before_replay: Callable[[], None] | None = None,
) -> Plan:
    """A ``WholeGraphs`` part's bucket: captured on its static buffers narrowed to the bucket, host lists
    at their pad values, the device's updatable ops as tasks; the call loaded (padding) and replayed
    with its padded host arguments. Reads ``sizes``, ``config``, ``inputs`` (read, bind, narrow, load,
    padded_host_args).

    ``make_graph``: what captures (default ``device.graph()``); a ``BreakableGraphs`` part's is a
    ``BreakableGraph``, whose every segment capture is probed. Its breaks run eagerly on both sides
    and are not compared (as a piecewise graph's splitting ops): what they change shows in the next
    segment's ops. ``before_replay``: run between the capture and the replay (a step that writes
    state, as a decode step writes its KV cache, has the state it started from put back)."""
    from devgraph.runner import choose_bucket

    inputs, config, dev, fn = runner.kit.inputs, runner.config, runner.device, runner.fn
    call = inputs.read(args, kwargs)
    size = choose_bucket(call.batch, runner.sizes)
    assert size is not None
    modules = module_names(fn)
    cleanup: list[Callable[[], None]] = []

    def bound(
        tensors: dict[str, torch.Tensor], host: dict[str, list[Any]]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        values: dict[str, Any] = dict(tensors)
        values.update(call.static)
        values.update(call.consts)
        values.update(host)
        return call.bind(inputs.signature, values)

    def run_graph() -> tuple[list[OpRecord], Any]:
        host = {name: [config.pad_value(name)] * size for name in call.host}
        c_args, c_kwargs = bound(dict(inputs.narrowed(size)), host)
        with torch.no_grad():
            graph = make_graph() if make_graph is not None else dev.graph()
            cleanup.append(graph.reset)
            with probed(modules) as records, graph.capture(auto_update_ops=dev.updatable_ops):
                out = fn(*c_args, **c_kwargs)
            if before_replay is not None:
                before_replay()
            inputs.load(call, size)
            graph.replay(inputs.padded_host_args(call.host, size) if config.host_args else None)
            dev.synchronize()
        return records, out

    def padded() -> Call:
        inputs.load(call, size)
        tensors = {n: t.clone() for n, t in inputs.narrowed(size).items()}
        host = {n: list(v) + [config.pad_value(n)] * (size - call.batch) for n, v in call.host.items()}
        p_args, p_kwargs = bound(tensors, host)
        return Call(fn, p_args, p_kwargs)

    subject = f"{_describe(fn)} wrapped, the {noun} of bucket {size} serving a call of {call.batch} rows"
    return Plan(
        subject,
        dev,
        modules,
        run_graph,
        Call(fn, tuple(args), dict(kwargs)),
        padded if size != call.batch else None,
        cleanup=cleanup,
    )


def _piecewise_plan(runner: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Plan:
    """A ``Pieces`` part's pieces at the size serving the call: a runner of the same model, options
    and compiler capturing that size alone, its every piece's capture probed, called with the call (it
    traces, captures and replays the pieces, the splitting ops eagerly in between). The splitting ops
    run eagerly on both sides and are not compared; what they change shows in the next piece's ops.
    Reads ``plan.sizes``, ``config``, ``compile_config``, ``inputs.read``, ``fn`` and ``device``."""
    from devgraph.runner import GraphRunner, choose_bucket

    call = runner.kit.inputs.read(args, kwargs)
    sizes = runner.plan.sizes if runner.plan is not None else ()
    size = choose_bucket(call.batch, list(sizes)) if sizes else None
    if size is None:
        raise DevgraphError(f"no captured piece size holds {call.batch} tokens (sizes {list(sizes)})")
    compile_config = attrs.evolve(runner.compile_config, mode="piecewise", capture_sizes=(size,))
    config = attrs.evolve(runner.config, mode="piecewise", strict=True)
    fresh = GraphRunner(runner.fn, runner.device, config, compile_config)
    modules = module_names(runner.fn)

    def run_graph() -> tuple[list[OpRecord], Any]:
        with torch.no_grad(), probed(modules) as records:
            out = fresh(*args, **kwargs)
        runner.device.synchronize()
        return records, out

    subject = (
        f"{_describe(runner.fn)} wrapped piecewise, the pieces of size {size} serving a call of "
        f"{call.batch} tokens"
    )
    return Plan(
        subject,
        runner.device,
        modules,
        run_graph,
        Call(runner.fn, tuple(args), dict(kwargs)),
        cleanup=[fresh.reset],
    )
