"""Bisecting a generation: the steps a wrapper served from graphs, the first that differs, its op.

A wrapper whose calls run several graphed steps over state they write (a Hugging Face
``GraphedCausalLM``: the prefill, from pieces or breakable graphs, then one decode step per token,
over a static KV cache) records each step it served: the runner, the runner's arguments, what the
runner returned, the state the step wrote, and how to put back the state the step started from
(``ServesSteps.served_steps``: the wrapper's own business, so this package never imports an
adapter). Then, step by step, the state is put back and the runner's function runs eagerly on the
recorded arguments: the first step whose output or written state differs from the graph's is the
step bisected, with the state put back before each of the bisect's runs (``step_plan``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import attrs
import torch

from devgraph._errors import DevgraphError
from devgraph.debug._compare import diff_tensors
from devgraph.debug._compiled import truly_eager
from devgraph.debug._subjects import Call, Plan, _full_plan, _piecewise_plan, clone_tensors
from devgraph.graph import BreakableGraph

__all__ = ["ServedStep", "ServesSteps", "StepsServed", "first_differing_step", "step_plan"]


@attrs.define
class ServedStep:
    """One step a wrapper served from graphs, as recorded while it ran.

    Attributes:
        name: what the step was, for the report (``"decode step 3 of generate"``).
        runner: the ``GraphRunner`` that served it (``runner.fn`` is the step's function).
        kwargs: the runner's call (tensors cloned before the step ran), ``shared`` aside.
        output: what the runner returned (cloned).
        written: ``read_written()`` right after the step (cloned): the state it wrote.
        restore: puts back the state the step started from (the KV cache before it).
        read_written: the state the step writes, as views to read after running it (the rows
            and slots of the call, not a bucket's padding).
    """

    name: str
    runner: Any
    kwargs: dict[str, Any]
    output: Any
    written: list[torch.Tensor]
    restore: Callable[[], None]
    read_written: Callable[[], list[torch.Tensor]]
    #: arguments passed as they are, never cloned: the state the step reads and writes when the
    #: runner's function takes it as arguments (a graph Dynamo traced lifts the KV cache's tensors)
    shared: dict[str, Any] = attrs.field(factory=dict)


@attrs.define
class StepsServed:
    """What a wrapper's call served from graphs: its steps in order (at most ``limit`` recorded)."""

    subject: str
    steps: list[ServedStep]
    #: the call ran with no step from graphs: why (the fallbacks it counted), for the error
    eager_reasons: list[str] = attrs.field(factory=list)
    notes: list[str] = attrs.field(factory=list)


@runtime_checkable
class ServesSteps(Protocol):
    """A wrapper whose call runs several graphed steps (``GraphedCausalLM``): ``bisect(wrapper,
    *call)`` records them through ``served_steps(*call)``, running the call once."""

    def served_steps(self, *args: Any, **kwargs: Any) -> StepsServed: ...


def _difference(graph: Any, eager: Any, what: str, atol: float, rtol: float) -> str | None:
    g = graph if isinstance(graph, (list, tuple)) else [graph]
    e = eager if isinstance(eager, (list, tuple)) else [eager]
    for a, b in zip(g, e, strict=True):
        if not isinstance(a, torch.Tensor):
            continue
        d = diff_tensors(a, b)
        if not d.comparable:
            return f"{what} has shape {tuple(a.shape)}, eager's {tuple(b.shape)}"
        if d.max_abs > atol + rtol * d.scale:
            return f"{what} differs from eager's by {d.max_abs:.3g} (relative {d.max_rel:.3g})"
    return None


def step_difference(step: ServedStep, atol: float, rtol: float) -> str | None:
    """None, or how ``step`` run eagerly over the state it started from differs from its graph."""
    step.restore()
    with torch.no_grad(), truly_eager():
        out = step.runner.fn(**clone_tensors(step.kwargs), **step.shared)
    written = [t.clone() for t in step.read_written()]
    return _difference(step.output, out, "its output", atol, rtol) or _difference(
        step.written, written, "the KV cache it writes", atol, rtol
    )


def first_differing_step(served: StepsServed, atol: float, rtol: float) -> tuple[int, str] | None:
    """``(index, how it differs)`` of the first step whose graph differs from eager, or None."""
    for k, step in enumerate(served.steps):
        why = step_difference(step, atol, rtol)
        if why is not None:
            return k, why
    return None


def step_plan(step: ServedStep) -> tuple[Plan, list[str]]:
    """The bisect of one served step: its runner's graphs for the step's call, rebuilt with the probe
    (``_piecewise_plan`` for pieces, ``_full_plan`` for whole or breakable graphs), with the state the
    step started from put back before the capture, the replay and each eager run; and notes for the
    report (kept out of the plan's own notes, which say that host values differ)."""
    runner, kwargs = step.runner, {**step.kwargs, **step.shared}
    notes: list[str] = []
    step.restore()
    # a graph Dynamo traced runs node by node on the eager side: each op named at the user's line
    traced = getattr(runner.fn, "graph", None)
    if traced is not None and runner.pieces is None:
        traced.interpret = True
    if runner.pieces is not None:
        plan = _piecewise_plan(runner.pieces, (), kwargs)
        tokens = runner.inputs.read((), kwargs).batch
        sizes = runner.pieces.plan.sizes if runner.pieces.plan is not None else ()
        if tokens not in sizes:
            notes.append(
                "the pieces run the call padded to their capture size and are compared with eager on the "
                "call itself: an op that counts the padded tokens (a static cache's write position, "
                "cumulative_length.add_) differs by design; read past it to the first op on the values"
            )
    elif runner.breakable is not None:
        breaks = runner.breakable.config.breaks
        device = runner.breakable.device
        plan = _full_plan(
            runner.breakable,
            (),
            kwargs,
            lambda: BreakableGraph(device, breaks),
            "breakable graph",
            before_replay=step.restore,
        )
    elif runner.full is not None:
        plan = _full_plan(runner.full, (), kwargs, before_replay=step.restore)
    else:
        raise DevgraphError(f"the runner of {step.name} holds no graphs to bisect ({runner!r})")
    run_graph = plan.run_graph

    def restored_run() -> Any:
        step.restore()
        return run_graph()

    plan.run_graph = restored_run
    plan.eager = attrs.evolve(plan.eager, before=step.restore)
    padded = plan.padded
    if padded is not None:

        def padded_restored() -> Call:
            return attrs.evolve(padded(), before=step.restore)

        plan.padded = padded_restored
    plan.served = step.output
    if traced is not None:
        plan.cleanup.append(lambda: setattr(traced, "interpret", False))
    return plan, notes
