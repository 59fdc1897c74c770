"""Differential test of the CPU reference backend against PyTorch's own OpInfo database.

For every op in ``torch.testing._internal.common_methods_invocations.op_db`` with float32 CPU
samples (random, uninitialised and nondeterministic ops left out), under ``no_grad`` and
``inference_mode``: capture one call on the CPU reference, refill the captured inputs with new
values, replay, and compare with eager on the new values. A ``CaptureError`` at capture is an
acceptable answer; a wrong value, a replay crash, or any other error at capture is a *hazard*.

Refilling (the rule): floating and complex tensors are multiplied elementwise by factors drawn from
[0.5, 1.0) -- the sign, and so the domain of most ops (``log``, ``acos``, ``sqrt``), is kept while
every value changes. Integer and bool tensors (indices, masks, counts) are permuted: each one gets
its own values in a new order, so an index stays in range and a mask keeps its count. Where the
new values are invalid for the op anyway (a matrix that is no longer positive definite), eager
raises on them and the case is counted as ``skipped``, not as a hazard.

``python tests/test_opinfo_differential.py`` runs every case and writes ``tests/opinfo_counts.json``
(the numbers the README quotes); the test below fails on any hazard.
"""

from __future__ import annotations

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

SAMPLES_PER_OP = 4
COUNTS_FILE = Path(__file__).with_name("opinfo_counts.json")
MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}

# Ops whose output is random or uninitialised: eager on the same inputs differs from itself.
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
    "empty",
)

try:
    from torch.testing._internal.common_methods_invocations import op_db as _OP_DB
except ImportError:  # expecttest missing: the [test] extra installs it
    _OP_DB = []


def _selected_ops() -> list:
    ops = []
    for op in _OP_DB:
        if any(word in op.name for word in _RANDOM) or getattr(op, "has_nondeterministic_output", False):
            continue
        if torch.float32 not in op.supported_dtypes("cpu"):
            continue
        ops.append(op)
    return ops


OPS = _selected_ops()


class _RandomOps(TorchDispatchMode):
    """Notes the first op tagged ``nondeterministic_seeded`` (dropout, bernoulli, randn...) that runs.

    OpInfo wraps random ops to reseed the generator on every call, so eager looks deterministic
    while a replay draws from wherever the generator is: such samples are left out.
    """

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
        try:
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5, equal_nan=True)
        except AssertionError:
            return False
    return True


def run_case(op, sample, mode) -> tuple[str, str]:
    """One sample under one grad mode: ``("equal"|"refused"|"skipped"|"hazard", detail)``."""
    call = (sample.input, sample.args, sample.kwargs)
    inputs = _tensors(call)
    if any(t.device.type != "cpu" for t in inputs):
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
        return "skipped", f"random: {random_ops.seen}"
    graph = devgraph.device("cpu").graph()
    try:
        with mode():
            with graph.capture():
                out = fn(call)
    except CaptureError as exc:
        return "refused", f"{exc.op}"
    except Exception as exc:
        return "hazard", f"capture raised {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    g = torch.Generator().manual_seed(1234)
    for t in inputs:
        with torch.no_grad():
            t.copy_(_refill(t, g))
    fresh = _snapshot(call)
    try:
        with mode():
            expected = fn(fresh)
    except Exception as exc:  # the new values are invalid for this op
        return "skipped", f"eager raises on new values: {type(exc).__name__}"
    try:
        graph.replay()
    except Exception as exc:
        return "hazard", f"replay raised {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    if not _close(out, expected):
        return "hazard", "replay differs from eager on the new values"
    if not _close(call, fresh):
        return "hazard", "replay left the inputs different from eager (in-place effects)"
    return "equal", ""


def op_cases(op):
    """Every (mode, sample) case of ``op``: at most SAMPLES_PER_OP samples."""
    try:
        samples = list(op.sample_inputs("cpu", torch.float32, requires_grad=False))[:SAMPLES_PER_OP]
    except Exception:
        return []
    return [(mode_name, i, sample) for mode_name in MODES for i, sample in enumerate(samples)]


def _op_id(op) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


@pytest.mark.skipif(not _OP_DB, reason="torch.testing._internal needs expecttest")
@pytest.mark.parametrize("op", OPS, ids=_op_id)
def test_replay_equals_eager_or_capture_refuses(op):
    torch.manual_seed(0)
    hazards = []
    for mode_name, i, sample in op_cases(op):
        verdict, detail = run_case(op, sample, MODES[mode_name])
        if verdict == "hazard":
            hazards.append(f"{mode_name} sample {i}: {detail}")
    assert not hazards, "\n".join(hazards)


@pytest.mark.skipif(not _OP_DB, reason="torch.testing._internal needs expecttest")
def test_committed_counts_cover_every_selected_op_and_show_no_hazard():
    counts = json.loads(COUNTS_FILE.read_text())
    assert counts["ops"] == len(OPS)
    assert counts["hazards"] == 0
    assert counts["cases"] == counts["equal"] + counts["refused"] + counts["skipped"] + counts["hazards"]


def main() -> None:
    """Run every case serially and write the counts file (and the hazards, one a line, to stdout)."""
    torch.set_num_threads(1)
    totals = {"ops": len(OPS), "cases": 0, "equal": 0, "refused": 0, "skipped": 0, "hazards": 0}
    refused_ops: dict[str, int] = {}
    hazards = []
    for op in OPS:
        torch.manual_seed(0)
        for mode_name, i, sample in op_cases(op):
            verdict, detail = run_case(op, sample, MODES[mode_name])
            totals["cases"] += 1
            totals["hazards" if verdict == "hazard" else verdict] += 1
            if verdict == "refused":
                refused_ops[detail] = refused_ops.get(detail, 0) + 1
            if verdict == "hazard":
                hazards.append(f"{_op_id(op)} {mode_name} sample {i}: {detail}")
    totals["refused_by_op"] = dict(sorted(refused_ops.items()))
    totals["torch"] = torch.__version__
    totals["samples_per_op"] = SAMPLES_PER_OP
    if "--dry-run" not in sys.argv:
        COUNTS_FILE.write_text(json.dumps(totals, indent=2) + "\n")
    sys.stdout.write("\n".join(hazards) + ("\n" if hazards else ""))
    sys.stdout.write(json.dumps({k: v for k, v in totals.items() if k != "refused_by_op"}) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    main()
