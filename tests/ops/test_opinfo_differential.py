"""Differential test of the CPU reference backend against PyTorch's own OpInfo database.

For every op in ``torch.testing._internal.common_methods_invocations.op_db`` (uninitialised and
nondeterministic ops left out), in three passes -- float32 samples under ``no_grad``,
``inference_mode`` and grad mode; a bfloat16 sample under ``inference_mode``; an int64 sample under
``no_grad`` -- capture one call on the CPU reference, refill the captured inputs with new values,
replay, and compare with eager on the new values. A ``CaptureError`` at capture is an acceptable
answer; a wrong value, a replay crash, or any other error at capture is a *hazard*.

Samples are chosen non-empty (some tensor input has elements). A case whose eager output does not
change when its inputs are refilled (a shape query, a ``zeros_like``, a mask that stays the same) is
*vacuous*: a replay that did nothing would pass it too, so it is counted apart and kept out of the
headline ``equal`` count.

Refilling (the rule): floating and complex tensors are multiplied elementwise by factors drawn from
[0.5, 1.0) -- the sign, and so the domain of most ops (``log``, ``acos``, ``sqrt``), is kept while
every value changes. Integer and bool tensors (indices, masks, counts) are permuted: each one gets
its own values in a new order, so an index stays in range and a mask keeps its count. Where the
new values are invalid for the op anyway (a matrix that is no longer positive definite), eager
raises on them and the case is counted as ``skipped``, not as a hazard.

Random ops (those that draw from a generator) get a pass of their own. OpInfo calls them through
``wrapper_set_seed``, which re-seeds the generator inside every call: capturing that must be refused
(eager restarts the stream at every call, a replay would continue it). Called plainly, seeded
before the replay and before eager alike, a replay must equal eager.

``python tests/ops/test_opinfo_differential.py`` runs every case and writes ``tests/ops/opinfo_counts.json``
(the numbers the README quotes); the tests below fail on any hazard.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

import devgraph
from devgraph import CaptureError

# torch's own samples warn about their arguments (deprecated ``lu``, ``stft`` without a window,
# ``dropout2d`` on 3D input, ``kl_div``'s reduction), attributed to whichever frame calls the op:
# torch's, this file's, or devgraph's dispatch mode. devgraph's own warnings still show and fail
# nothing here: each of them starts with "devgraph".
pytestmark = pytest.mark.filterwarnings("ignore:(?!devgraph):UserWarning")

COUNTS_FILE = Path(__file__).with_name("opinfo_counts.json")
MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode, "grad": torch.enable_grad}
#: (pass name, dtype, grad modes, non-empty samples per op)
PASSES = (
    ("float32", torch.float32, ("no_grad", "inference_mode", "grad"), 3),
    ("bfloat16", torch.bfloat16, ("inference_mode",), 1),
    ("int64", torch.int64, ("no_grad",), 1),
)
RANDOM_SAMPLES = 2  # float32 samples per random op, under every grad mode
_SCAN = 25  # samples looked at per op to find non-empty ones

# Ops whose output is random, by name (the random pass); ``empty`` ones are uninitialised (left out).
_RANDOM = (
    "rand",
    "normal",
    "bernoulli",
    "dropout",
    "multinomial",
    "uniform",
    "exponential",
    "geometric",
    "cauchy",
    "log_normal",
    "rrelu",
    "poisson",
)

try:
    from torch.testing._internal import common_methods_invocations as _cmi

    _OP_DB = _cmi.op_db
except ImportError:  # expecttest missing: the [test] extra installs it
    _cmi, _OP_DB = None, []


def _selected_ops() -> list:
    return [
        op
        for op in _OP_DB
        if "empty" not in op.name and not getattr(op, "has_nondeterministic_output", False)
        if any(dtype in op.supported_dtypes("cpu") for _, dtype, _, _ in PASSES)
    ]


OPS = _selected_ops()


class _RandomOps(TorchDispatchMode):
    """Notes the first op tagged ``nondeterministic_seeded`` (dropout, bernoulli, randn...) that runs."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with self:  # a composite (sdpa under inference_mode) is random only if what it runs is
            result = func.decompose(*args, **kwargs)
        if result is not NotImplemented:
            return result
        if torch.Tag.nondeterministic_seeded in func.tags and not self.seen:
            self.seen = func._schema.name
        return func(*args, **kwargs)


def _refill(t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """New values for a captured input (see the module docstring for the rule)."""
    if t.numel() == 0:
        return t.clone()
    if t.is_floating_point() or t.is_complex():
        factor = torch.rand(t.shape, generator=g) * 0.5 + 0.5
        return t * factor.to(t.real.dtype if t.is_complex() else t.dtype)
    flat = t.reshape(-1)
    return flat[torch.randperm(flat.numel(), generator=g)].reshape(t.shape)


def _tensors(tree) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` over a copy of its whole storage (``as_strided`` samples read past the view)."""
    if t.layout != torch.strided:
        return t.clone()
    storage = t.untyped_storage().clone()
    out = torch.empty(0, dtype=t.dtype).set_(storage, t.storage_offset(), t.shape, t.stride())
    if t.is_conj():
        torch._C._set_conj(out, True)
    if t.is_neg():
        torch._C._set_neg(out, True)
    return out


def _snapshot(tree):
    return tree_map(lambda x: _copy(x) if isinstance(x, torch.Tensor) else x, tree)


def _close(actual, expected) -> bool:
    a, e = tree_flatten(actual)[0], tree_flatten(expected)[0]
    if len(a) != len(e):
        return False
    for x, y in zip(a, e):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if not isinstance(x, torch.Tensor):
            if x != y and not (x != x and y != y):  # NaN == NaN here
                return False
            continue
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        low = x.dtype in (torch.bfloat16, torch.float16)
        try:
            tol = {} if low else {"rtol": 1e-4, "atol": 1e-5}
            torch.testing.assert_close(x, y, equal_nan=True, **tol)
        except AssertionError:
            return False
    return True


@contextlib.contextmanager
def _plain_random_calls():
    """OpInfo's random ops without their re-seeding wrapper (they draw from the live generator)."""
    wrapper = _cmi.wrapper_set_seed
    _cmi.wrapper_set_seed = lambda op, *args, **kwargs: op(*args, **kwargs)
    try:
        yield
    finally:
        _cmi.wrapper_set_seed = wrapper


def _capture(fn, call, mode):
    graph = devgraph.device("cpu").graph()
    with mode():
        with graph.capture():
            out = fn(call)
    return graph, out


def _replay_verdict(graph, out, call, fn, mode, seed=None) -> tuple[str, str]:
    """Refill ``call``'s tensors, replay, compare with eager on the new values (both after
    ``torch.manual_seed(seed)`` when given): equal, vacuous, skipped or hazard."""
    captured = _snapshot(out)
    g = torch.Generator().manual_seed(1234)
    for t in _tensors(call):
        with torch.no_grad():
            t.copy_(_refill(t, g))
    fresh = _snapshot(call)
    if seed is not None:
        torch.manual_seed(seed)
    try:
        with mode():
            expected = fn(fresh)
    except Exception as exc:  # the new values are invalid for this op
        return "skipped", f"eager raises on new values: {type(exc).__name__}"
    if seed is not None:
        torch.manual_seed(seed)
    try:
        graph.replay()
    except Exception as exc:
        return "hazard", f"replay raised {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    if not _close(out, expected):
        return "hazard", "replay differs from eager on the new values"
    if not _close(call, fresh):
        return "hazard", "replay left the inputs different from eager (in-place effects)"
    if _close(captured, expected):
        return "vacuous", "output does not change with the refilled inputs"
    return "equal", ""


def run_case(op, sample, mode) -> tuple[str, str]:
    """One sample under one grad mode: ``("equal"|"vacuous"|"refused"|"skipped"|"hazard", detail)``."""
    call = (sample.input, sample.args, sample.kwargs)
    if any(t.device.type != "cpu" for t in _tensors(call)):
        return "skipped", "non-cpu input"

    def fn(tree):
        return op(tree[0], *tree[1], **tree[2])

    with mode():
        try:
            with _RandomOps() as random_ops:
                fn(_snapshot(call))
        except Exception as exc:
            return "skipped", f"eager raises: {type(exc).__name__}"
    if random_ops.seen:
        return "skipped", f"random: {random_ops.seen} (the random pass covers it)"
    try:
        graph, out = _capture(fn, call, mode)
    except CaptureError as exc:
        return "refused", f"{exc.op}"
    except Exception as exc:
        return "hazard", f"capture raised {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return _replay_verdict(graph, out, call, fn, mode)


def run_random_case(op, sample, mode) -> list[tuple[str, str, str]]:
    """A random op's sample: ``[(kind, verdict, detail)]`` for its re-seeding and plain calls.

    Re-seeded inside (OpInfo's own call): refused. Plain, seeded outside: equal (or vacuous) to eager
    after the same seed. A sample that draws nothing is skipped (the main pass covers it).
    """
    call = (sample.input, sample.args, sample.kwargs)
    if any(t.device.type != "cpu" for t in _tensors(call)):
        return [("reseeded", "skipped", "non-cpu input")]

    def fn(tree):
        return op(tree[0], *tree[1], **tree[2])

    with _plain_random_calls():
        try:
            with mode(), _RandomOps() as random_ops:
                fn(_snapshot(call))
        except Exception as exc:
            return [("plain", "skipped", f"eager raises: {type(exc).__name__}")]
    if not random_ops.seen:
        return [("plain", "skipped", "draws nothing (the main pass covers it)")]
    verdicts = []
    for kind in ("reseeded", "plain"):
        tree = _snapshot(call)
        with _plain_random_calls() if kind == "plain" else contextlib.nullcontext():
            try:
                with mode():
                    fn(_snapshot(tree))  # a warm-up, as the runner does
            except Exception as exc:
                verdicts.append((kind, "skipped", f"eager raises: {type(exc).__name__}"))
                continue
            try:
                graph, out = _capture(fn, tree, mode)
            except CaptureError as exc:
                verdict = (
                    ("refused", exc.op) if kind == "reseeded" else ("hazard", f"plain call refused: {exc}")
                )
                verdicts.append((kind, *verdict))
                continue
            except Exception as exc:
                verdicts.append((kind, "hazard", f"capture raised {type(exc).__name__}: {exc}"[:200]))
                continue
            verdicts.append((kind, *_replay_verdict(graph, out, tree, fn, mode, seed=7)))
    return verdicts


def _non_empty(samples, n: int) -> list:
    """The first ``n`` samples with a tensor input that has elements."""
    chosen = []
    for i, sample in enumerate(samples):
        if i >= _SCAN or len(chosen) == n:
            break
        if any(t.numel() for t in _tensors((sample.input, sample.args, sample.kwargs))):
            chosen.append(sample)
    return chosen


def op_cases(op):
    """Every (pass, mode, sample index, sample) case of ``op``."""
    cases = []
    supported = op.supported_dtypes("cpu")
    for name, dtype, modes, n in PASSES:
        if dtype not in supported:
            continue
        try:
            samples = _non_empty(op.sample_inputs("cpu", dtype, requires_grad=False), n)
        except Exception:
            continue
        cases += [(name, mode_name, i, sample) for mode_name in modes for i, sample in enumerate(samples)]
    return cases


def _draws(op, sample) -> bool:
    """True when ``op`` on ``sample`` draws from a generator (``p=0`` dropout does not)."""
    call = (sample.input, sample.args, sample.kwargs)
    if any(t.numel() == 0 for t in _tensors(call)):
        return False
    with _plain_random_calls():
        try:
            with torch.no_grad(), _RandomOps() as random_ops:
                op(*_snapshot((call[0], *call[1])), **_snapshot(call[2]))
        except Exception:
            return False
    return bool(random_ops.seen)


def random_cases(op):
    """The random pass's (mode, sample index, sample) cases of ``op``: samples that draw (factories,
    whose input is a size, included)."""
    chosen = []
    try:
        for i, sample in enumerate(op.sample_inputs("cpu", torch.float32, requires_grad=False)):
            if i >= _SCAN or len(chosen) == RANDOM_SAMPLES:
                break
            if _draws(op, sample):
                chosen.append(sample)
    except Exception:
        return []
    return [(mode_name, i, sample) for mode_name in MODES for i, sample in enumerate(chosen)]


#: random ops with float32 samples that draw (normalize matches a name but draws nothing)
RANDOM_OPS = [
    op
    for op in OPS
    if any(w in op.name for w in _RANDOM) and torch.float32 in op.supported_dtypes("cpu") and random_cases(op)
]


def _op_id(op) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


@pytest.fixture(autouse=True)
def _one_thread():
    """The samples are tiny: one intra-op thread is faster than several fighting over the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.skipif(not _OP_DB, reason="torch.testing._internal needs expecttest")
@pytest.mark.parametrize("op", OPS, ids=_op_id)
def test_replay_equals_eager_or_capture_refuses(op):
    torch.manual_seed(0)
    hazards = []
    for pass_name, mode_name, i, sample in op_cases(op):
        verdict, detail = run_case(op, sample, MODES[mode_name])
        if verdict == "hazard":
            hazards.append(f"{pass_name} {mode_name} sample {i}: {detail}")
    assert not hazards, "\n".join(hazards)


@pytest.mark.skipif(not _OP_DB, reason="torch.testing._internal needs expecttest")
@pytest.mark.parametrize("op", RANDOM_OPS, ids=_op_id)
def test_random_ops_replay_like_eager_and_reseeding_inside_is_refused(op):
    torch.manual_seed(0)
    hazards = []
    for mode_name, i, sample in random_cases(op):
        for kind, verdict, detail in run_random_case(op, sample, MODES[mode_name]):
            if verdict == "hazard":
                hazards.append(f"{kind} {mode_name} sample {i}: {detail}")
    assert not hazards, "\n".join(hazards)


@pytest.mark.skipif(not _OP_DB, reason="torch.testing._internal needs expecttest")
def test_committed_counts_cover_every_selected_op_and_show_no_hazard():
    counts = json.loads(COUNTS_FILE.read_text())
    assert counts["ops"] == len(OPS) and counts["random"]["ops"] == len(RANDOM_OPS)
    assert counts["hazards"] == 0 and counts["random"]["hazards"] == 0
    verdicts = ("equal", "vacuous", "refused", "skipped", "hazards")
    assert counts["cases"] == sum(counts[v] for v in verdicts)
    assert counts["cases"] == sum(p["cases"] for p in counts["passes"].values())
    for p in counts["passes"].values():
        assert p["cases"] == sum(p[v] for v in verdicts)


def _tally(totals: dict, verdict: str) -> None:
    totals["cases"] += 1
    totals["hazards" if verdict == "hazard" else verdict] += 1


def _zero() -> dict:
    return {"cases": 0, "equal": 0, "vacuous": 0, "refused": 0, "skipped": 0, "hazards": 0}


def main() -> None:
    """Run every case serially and write the counts file (and the hazards, one a line, to stdout)."""
    torch.set_num_threads(1)
    totals = {"ops": len(OPS), **_zero()}
    passes = {f"{name}/{mode}": _zero() for name, _, modes, _ in PASSES for mode in modes}
    refused_ops: dict[str, int] = {}
    hazards = []
    for op in OPS:
        torch.manual_seed(0)
        for pass_name, mode_name, i, sample in op_cases(op):
            verdict, detail = run_case(op, sample, MODES[mode_name])
            _tally(totals, verdict)
            _tally(passes[f"{pass_name}/{mode_name}"], verdict)
            if verdict == "refused":
                refused_ops[detail] = refused_ops.get(detail, 0) + 1
            if verdict == "hazard":
                hazards.append(f"{_op_id(op)} {pass_name} {mode_name} sample {i}: {detail}")
    random = {"ops": len(RANDOM_OPS), "reseeded": _zero(), "plain": _zero(), "hazards": 0}
    for op in RANDOM_OPS:
        torch.manual_seed(0)
        for mode_name, i, sample in random_cases(op):
            for kind, verdict, detail in run_random_case(op, sample, MODES[mode_name]):
                _tally(random[kind], verdict)
                if verdict == "hazard":
                    random["hazards"] += 1
                    hazards.append(f"{_op_id(op)} random {kind} {mode_name} sample {i}: {detail}")
    totals["passes"] = passes
    totals["random"] = random
    totals["refused_by_op"] = dict(sorted(refused_ops.items()))
    totals["torch"] = torch.__version__
    totals["samples"] = {name: n for name, _, _, n in PASSES} | {"random": RANDOM_SAMPLES}
    if "--dry-run" not in sys.argv:
        COUNTS_FILE.write_text(json.dumps(totals, indent=2) + "\n")
    sys.stdout.write("\n".join(hazards) + ("\n" if hazards else ""))
    headline = {
        k: v for k, v in totals.items() if k in ("ops", "cases", "equal", "vacuous", "refused", "skipped")
    }
    sys.stdout.write(json.dumps({**headline, "hazards": totals["hazards"], "random": random}) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    main()
