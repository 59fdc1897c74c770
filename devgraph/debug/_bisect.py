"""``devgraph.bisect``: the first op whose replayed output differs from eager."""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
from torch.utils._pytree import tree_map

from devgraph._errors import DevgraphError
from devgraph.debug._compare import Diff, align, diff_tensors, max_difference
from devgraph.debug._compiled import COMPILED, descend, truly_eager
from devgraph.debug._poison import new_run, unmatched_poison
from devgraph.debug._probe import OpProbe, OpRecord, module_names
from devgraph.debug._report import BisectReport, OpDifference
from devgraph.debug._steps import ServesSteps, first_differing_step, step_plan
from devgraph.debug._subjects import Call, Plan, callable_plan, clone_tensors, served_plan, traced_plans
from devgraph.frontend import TracedModule
from devgraph.graph import Device, Graph, tree_tensors

__all__ = ["BisectOptions", "bisect"]

logger = logging.getLogger("devgraph.debug")

#: Bisects run one at a time: an eager side's ``set_stance("force_eager")`` is process-wide, and
#: would make another thread's graph side run its compiled code eagerly (two concurrent bisects of a
#: compiled model: one reported no difference).
_ONE_AT_A_TIME = threading.RLock()


def _non_negative(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
        raise DevgraphError(f"BisectOptions.{attribute.name} must be a number >= 0, got {value!r}")


@attrs.frozen
class BisectOptions:
    """How ``devgraph.bisect`` runs (pass as ``bisect_options=``; every field has a default).

    Attributes:
        device: where a plain callable is captured (a backend name or ``devgraph.Device``; None:
            the device of the call's first tensor); a Graph target captures on its own device.
        capture_args / capture_kwargs: what a plain callable is captured with (None: the call's own
            arguments); the call's tensors are then copied in and the graph replayed, host values
            staying as captured, as on a device. Capture with other host values than the call's to
            see an op that freezes them. ``device`` and these are refused for a wrapped model, whose
            graph is captured as its runner captures it.
        atol / rtol: added to the measured noise floor: an op differs when
            ``max |graph - eager| > noise + atol + rtol * max |eager|``. 0 (the default): any difference
            two eager runs do not show.
        reference: ``"eager"`` (default): the eager side runs on the graph's device. ``"cpu"``: on a CPU
            copy of the model and the call, so the report names the first op where the device's replay
            departs from the CPU's math (kernels round differently across devices: give ``rtol``).
        compile_mode: the inductor mode the bisect compiles with when it descends into
            ``torch.compile``'d code (None: torch's default; give the mode the code was compiled
            with, e.g. SGLang's ``"max-autotune-no-cudagraphs"``).
    """

    device: str | Device | None = None
    capture_args: tuple[Any, ...] | None = attrs.field(
        default=None, converter=attrs.converters.optional(tuple)
    )
    capture_kwargs: dict[str, Any] | None = None
    atol: float = attrs.field(default=0.0, validator=_non_negative)
    rtol: float = attrs.field(default=0.0, validator=_non_negative)
    reference: str = attrs.field(default="eager")
    compile_mode: str | None = None

    @reference.validator
    def _check_reference(self, attribute: attrs.Attribute[Any], value: str) -> None:
        if value not in ("eager", "cpu"):
            raise DevgraphError(
                f"BisectOptions.reference must be 'eager' (eager on the graph's device) or 'cpu' (eager on a "
                f"CPU copy of the model and the call), got {value!r}"
            )


def _plan(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], options: BisectOptions) -> Plan:
    from devgraph.runner import GraphedModule

    if isinstance(target, GraphedModule):
        _refuse_capture_options(options)
        return served_plan(target, args, kwargs)
    if isinstance(target, Graph):
        if not args or not callable(args[0]):
            raise DevgraphError(
                "bisect of a Graph takes its capture function next: devgraph.bisect(graph, step, *args), "
                "where `with graph.capture(): step(*args)` is how the graph is captured"
            )
        fn, rest = args[0], args[1:]
        return callable_plan(
            fn,
            rest,
            kwargs,
            device=target.device,
            capture_args=options.capture_args,
            capture_kwargs=options.capture_kwargs,
            subject=f"a {target.device.name} graph captured from {getattr(fn, '__qualname__', fn)!s}",
        )
    if not callable(target):
        raise DevgraphError(
            f"bisect needs a model wrapped by devgraph.wrap, a callable, or a Graph and its capture "
            f"function; got {type(target).__name__}"
        )
    return callable_plan(
        target,
        args,
        kwargs,
        device=options.device,
        capture_args=options.capture_args,
        capture_kwargs=options.capture_kwargs,
    )


def _noise(first: Sequence[OpRecord], second: Sequence[OpRecord]) -> dict[int, float]:
    """Per op of ``first``, the largest difference the second eager run showed on it."""
    pairs, _ = align(first, second)
    out = {}
    for i, j in pairs:
        d = max_difference(first[i], second[j])
        out[i] = d.max_abs if d.comparable else 0.0
    return out


@attrs.define
class _Side:
    """One eager reference: its records, its measured noise, how to name it."""

    name: str
    records: list[OpRecord]
    noise: dict[int, float]
    pairs: dict[int, int]  # graph op index -> this side's op index


def _run_eager(call: Call, probe: OpProbe) -> Any:
    args, kwargs = clone_tensors(call.args), clone_tensors(call.kwargs)  # outside the probe
    if call.before is not None:
        call.before()
    # Eager is eager: a torch.compile'd function runs its original code, op by op.
    with torch.no_grad(), truly_eager(), probe:
        return call.fn(*args, **kwargs)


def _eager_side(
    name: str, call: Call, modules: dict[int, str], graph: list[OpRecord], run: int
) -> tuple[_Side, Any, list[str]]:
    outs, runs = [], []
    for _ in range(2):  # twice: what differs between two eager runs is the noise floor
        probe = OpProbe(modules, poison=run)
        outs.append(_run_eager(call, probe))
        runs.append(probe.records)
    # Around a compiled graph (one record for many eager ops) op names alone can pair an op after it
    # with one eager ran inside it: pair by op and source line there.
    pairs, unmatched = align(graph, runs[0], by_source=any(r.op == COMPILED for r in graph))
    return _Side(name, runs[0], _noise(runs[0], runs[1]), dict(pairs)), outs[0], unmatched


def _hint(d: Diff, g: torch.Tensor, e: torch.Tensor, flagged: list[str], sides: int, notes: list[str]) -> str:
    """What this kind of difference usually means."""
    at = d.where
    inside = len(at) == e.dim() and all(i < n for i, n in zip(at, e.shape))
    if inside and bool(unmatched_poison(g[at], e[at]).any()):
        return (
            "eager reads its NaN poison here, memory no op wrote (eager runs fill uninitialised memory "
            "with a marked NaN); the graph replays whatever that memory held: an op leaves part of its "
            "output unwritten"
        )
    if any(name.startswith("the padded batch") for name in flagged):
        return (
            "it differs from eager at the same padded shape: a host value frozen at capture, a stale or "
            "moved input, or memory the graph shares, not the batch size"
        )
    if sides > 1:
        return (
            "it agrees with eager at the padded shape and differs only at the call's own row count: "
            "this op's numerics depend on the batch size (padding to the bucket changes its rounding)"
        )
    if notes:
        return "host values differ between the capture and the call (see the notes)"
    return ""


def _differs(d: Diff, noise: float, atol: float, rtol: float) -> bool:
    return d.comparable and d.max_abs > noise + atol + rtol * d.scale


def bisect(
    target: Any, /, *args: Any, bisect_options: BisectOptions | None = None, **kwargs: Any
) -> BisectReport:
    """Find the first op whose output, replayed from a graph, differs from eager beyond the noise floor.

    Args:
        target: a model wrapped by ``devgraph.wrap`` (the graph of the bucket serving this call is
            captured again as the runner captures it, with a copy of every op's output, replayed as the
            runner replays it, and compared with eager on the call, and with eager on the same padded
            inputs when the bucket pads the call); any callable (captured for the purpose); or a
            ``devgraph.Graph`` followed by its capture function (``bisect(graph, step, *args)``).
        args: the call's positional arguments (the target's own).
        kwargs: the call's keyword arguments (the target's own).
        bisect_options: a ``BisectOptions`` (device, capture arguments, tolerances).
    Returns:
        A ``BisectReport``: ``report.first`` is the first differing op (its aten name, ``file:line``,
        module path, differences, noise floor, both tensors); ``str(report)`` reads as a report.
    Raises:
        CaptureError: the target cannot be captured (the op and line are named).
        DevgraphError: a target of another kind, capture arguments unlike the call, or a wrapped
            model's call that no graph serves.
    """
    options = bisect_options or BisectOptions()
    if not isinstance(options, BisectOptions):
        raise DevgraphError(f"bisect_options must be a devgraph.BisectOptions, got {type(options).__name__}")
    with _ONE_AT_A_TIME:
        if isinstance(target, ServesSteps):  # before GraphedModule: a GraphedCausalLM is one
            _refuse_capture_options(options)
            return _bisect_steps(target, args, dict(kwargs), options)
        if isinstance(target, TracedModule):
            _refuse_capture_options(options)
            return _first_differing(traced_plans(target, args, dict(kwargs)), options)
        plan = _plan(target, args, dict(kwargs), options)
        try:
            return _run(plan, options)
        finally:
            for done in plan.cleanup:
                done()


def _bisect_steps(
    target: ServesSteps, args: tuple[Any, ...], kwargs: dict[str, Any], options: BisectOptions
) -> BisectReport:
    """A call of several graphed steps (``generate``): run it recording each step served from graphs,
    find the first whose graph differs from eager over the state it started from, bisect that step."""
    if options.reference != "eager":
        raise DevgraphError(
            "BisectOptions(reference='cpu') does not apply to a generate() bisect: its steps write a KV "
            "cache that a CPU copy of the model would not share. Bisect on the model's own device "
            "(reference='eager')"
        )
    served = target.served_steps(*args, **kwargs)
    if not served.steps:
        why = "; ".join(served.eager_reasons) or "see graphed.stats.fallbacks"
        raise DevgraphError(
            f"{served.subject} served no step from graphs (every step ran eagerly: {why}); nothing to "
            "bisect. Make the call the wrapper serves from graphs (the reasons above say what ran eagerly "
            "and the fix), then bisect it"
        )
    names = [s.name for s in served.steps]
    found = first_differing_step(served, options.atol, options.rtol)
    if found is None:
        k = len(served.steps) - 1
        subject = f"{served.subject}: no step differs; {served.steps[k].name}, the last, bisected op by op"
        notes = [
            f"no step differs: each of the {len(names)} steps served from graphs ({', '.join(names)}), run "
            "eagerly over the KV cache it started from, gives the graph's output and writes the graph's cache"
        ]
    else:
        k, why = found
        subject = f"{served.subject}, {served.steps[k].name}"
        before = f"; the {k} step(s) before it agree ({', '.join(names[:k])})" if k else ""
        notes = [
            f"{served.steps[k].name} is the first step whose graph differs from eager over the KV cache it "
            f"started from: {why}{before}"
        ]
    plan, plan_notes = step_plan(served.steps[k])
    plan.subject = f"{subject}: {plan.subject}"
    try:
        report = _run(plan, options)
        return attrs.evolve(report, notes=(*notes, *plan_notes, *served.notes, *report.notes))
    finally:
        for done in plan.cleanup:
            done()


def _first_differing(plans: list[Plan], options: BisectOptions) -> BisectReport:
    """Bisect each graph a call ran, in order; the report of the first that differs (else the last)."""
    report = None
    for k, plan in enumerate(plans):
        try:
            report = _run(plan, options)
        finally:
            for done in plan.cleanup:
                done()
        if report.first is not None or report.output_max_abs > 0:
            for rest in plans[k + 1 :]:
                for done in rest.cleanup:
                    done()
            return report
    assert report is not None
    return report


def _refuse_capture_options(options: BisectOptions) -> None:
    given = [n for n in ("device", "capture_args", "capture_kwargs") if getattr(options, n) is not None]
    if given:
        raise DevgraphError(
            f"BisectOptions {given} apply to a callable or a Graph; a wrapped model's graph is captured "
            "on its own device as its runner captures it. Drop them, or bisect graphed.module with them"
        )


def _on_cpu(call: Call, fn: Callable[..., Any]) -> Call:
    def move(x: Any) -> Any:
        return x.to("cpu") if isinstance(x, torch.Tensor) else x

    return Call(fn, tree_map(move, call.args), tree_map(move, call.kwargs))


def _cpu_copy(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A CPU copy of ``fn`` (an ``nn.Module``: deep-copied and moved; a plain function: itself)."""
    if isinstance(fn, torch.nn.Module):
        return copy.deepcopy(fn).to("cpu")
    return fn


def _run(plan: Plan, options: BisectOptions) -> BisectReport:
    records, graph_out = plan.run_graph()
    sides = []
    eager, padded_call, modules, where = plan.eager, plan.padded() if plan.padded else None, plan.modules, ""
    # What the graph's compiled regions ran on: its device, the call as the graph replayed it (padded).
    replayed = padded_call if padded_call is not None else eager
    if options.reference == "cpu":
        fn = _cpu_copy(eager.fn)
        modules = module_names(fn)
        eager = _on_cpu(eager, fn)
        padded_call = _on_cpu(padded_call, fn) if padded_call is not None else None
        where = " on the CPU"
    run = new_run()  # after the graph's run: no memory its capture was handed holds this run's poison
    call_side, eager_out, unmatched = _eager_side("the call" + where, eager, modules, records, run)
    sides.append(call_side)
    if padded_call is not None:
        padded, _, _ = _eager_side("the padded batch" + where, padded_call, modules, records, run)
        sides.append(padded)
    atol, rtol = options.atol, options.rtol
    found: list[OpDifference] = []
    compared = 0
    for i, g in enumerate(records):
        flagged = []
        for side in sides:
            j = side.pairs.get(i)
            if j is None:
                continue
            if side is call_side:
                compared += 1
            d = max_difference(g, side.records[j])
            if _differs(d, side.noise.get(j, 0.0), atol, rtol):
                flagged.append((side, j, d))
        if not flagged:
            continue
        side, j, d = flagged[0]
        e = side.records[j]
        g_out, e_out = g.outputs[d.output], e.outputs[d.output]
        found.append(
            OpDifference(
                index=i,
                op=g.op,
                source=e.source or g.source,
                module=e.module or g.module,
                max_abs=d.max_abs,
                max_rel=d.max_rel,
                noise_floor=side.noise.get(j, 0.0),
                against=side.name,
                where=d.where,
                graph_value=g_out.clone(),
                eager_value=e_out.clone(),
                hint=_hint(d, g_out, e_out, [s.name for s, _, _ in flagged], len(sides), plan.notes),
            )
        )
    regions = [i for i, r in enumerate(records) if r.op == COMPILED]
    output_diff = _output_diff(graph_out, eager_out)
    notes = list(plan.notes)
    if regions and (output_diff > 0 or found) and (not found or found[0].index > regions[0]):
        # The difference starts in or after a compiled graph, recorded whole: look inside it.
        try:
            inside = _inside_compiled(replayed, [records[i] for i in regions], options, notes)
            if inside is not None and padded_call is not None:
                inside = attrs.evolve(inside, against="the padded batch")  # what the descent ran
        except Exception as exc:  # the op-level report stands; say why there is no descent
            notes.append(f"the bisect could not look inside the compiled code ({type(exc).__name__}: {exc})")
            inside = None
        if inside is not None:
            found.append(inside)
            found.sort(key=lambda f: f.index)  # stable: at one index the op-level record stays first
    first = found[0] if found else None
    largest = max(found, key=lambda f: f.max_rel) if found else None
    measured = max((v for s in sides for v in s.noise.values()), default=0.0)
    noise = (
        "eager run twice on the same inputs"
        + (" (the call, and the padded batch)" if len(sides) > 1 else "")
        + (
            ": bit-identical on every op, so any difference counts"
            if measured == 0
            else f": up to {measured:.3g} on some ops, used per op"
        )
    )
    report = BisectReport(
        subject=plan.subject,
        device=str(plan.device),
        ops_compared=compared,
        first=first,
        differing=len(found),
        largest=largest,
        noise=noise,
        tolerance=(float(atol), float(rtol)),
        output_max_abs=output_diff,
        unmatched=tuple(unmatched),
        reproduces=None if plan.served is None else _output_diff(graph_out, plan.served) == 0.0,
        notes=tuple(notes),
    )
    logger.info("%s", report.text())
    return report


#: ops that convert a value's dtype (how Dynamo's graphs and aten name them)
_CONVERSIONS = frozenset(
    {"Tensor.float", "Tensor.to", "Tensor.half", "Tensor.bfloat16", "Tensor.double", "Tensor.type_as"}
)


def _compiled_hint(op: str, dtype: torch.dtype) -> str:
    if op in _CONVERSIONS or op.startswith("aten::_to_copy") or op.startswith("prims::convert_element_type"):
        return (
            "inductor fuses a lower-precision intermediate away: the value converted here is the unrounded "
            "higher-precision one, where eager rounded it first. torch._inductor.config."
            "emulate_precision_casts = True makes inductor round like eager (slower kernels)"
        )
    if dtype in (torch.bfloat16, torch.float16):
        return (
            f"inductor fuses this op with the ops feeding it and keeps their results in float32, where eager "
            f"rounds each one to {str(dtype).removeprefix('torch.')} (or it orders a reduction otherwise). "
            "torch._inductor.config.emulate_precision_casts = True rounds like eager"
        )
    return (
        "inductor computes this op unlike eager (it fuses ops and keeps intermediates in higher precision, "
        "or orders a reduction otherwise): compiled and eager runs round differently here"
    )


def _inside_compiled(
    call: Call, regions: list[OpRecord], options: BisectOptions, notes: list[str]
) -> OpDifference | None:
    """The op inside the call's compiled code where its difference from eager starts (``_compiled``);
    ``call`` as the graph replayed it, on the graph's device."""
    found = descend(
        call.fn,
        clone_tensors(call.args),
        clone_tensors(call.kwargs),
        mode=options.compile_mode,
        atol=options.atol,
        rtol=options.rtol,
    )
    if found is None:
        notes.append(
            f"the {len(regions)} {COMPILED} call(s) of the graph run were looked into: each, compiled "
            f"afresh by inductor (mode {options.compile_mode or 'default'}), agrees with eager"
        )
        return None
    graph, diff = found
    # The probe recorded the call's compiled graph calls in the order the descent saw them.
    if graph >= len(regions):
        notes.append(
            f"the descent saw {graph + 1}+ compiled graph calls, the graph run {len(regions)}: the call "
            "ran other compiled code the second time; the op is placed at the last compiled record"
        )
    region = regions[min(graph, len(regions) - 1)]
    called = f" called at {region.source.split(': ', 1)[0]}" if region.source else ""
    return attrs.evolve(
        diff,
        index=region.index,
        hint=_compiled_hint(diff.op, diff.eager_value.dtype),
        inside=f"the {COMPILED}{called} ({diff.inside})",
    )


def _output_diff(graph_out: Any, eager_out: Any) -> float:
    g, e = tree_tensors(graph_out), tree_tensors(eager_out)
    worst = 0.0
    for a, b in zip(g, e):
        d = diff_tensors(a, b)
        if d.comparable:
            worst = max(worst, d.max_abs)
    return worst
