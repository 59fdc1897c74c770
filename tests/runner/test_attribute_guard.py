"""Python values the forward reads, changed by the user between calls: never replayed frozen.

A flag, a temperature, a training flag flipped on the inner module, a config field, a global, a
closure's tensor: set after capture, the next call captures again (counted in ``stats.recaptures``,
one warning naming the value) and equals eager. Values the forward does not read, or set again to an
equal value, keep the graphs (issue 32).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import devgraph
from devgraph.runner import _guard
from devgraph.runner._guard import AttributeGuard

SCALE = 2.0  # a global the forward of GlobalScale reads


def _x(n: int = 4, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 4, generator=torch.Generator().manual_seed(seed))


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def _wrap(model, frontend, **options):
    """``devgraph.wrap`` through ``frontend``: "raw" (the AttributeGuard under test; its one warning of
    what it leaves unchecked is expected) or "dynamo" (the default: Dynamo's guards follow the values)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*captures the forward as it runs, untraced")
        return devgraph.wrap(model, device="cpu", frontend=frontend, **options)


class _Knobs:
    def __init__(self) -> None:
        self.shift = 1.0


class Flags(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)
        self.use_lora = True
        self.temperature = 1.0
        self.knobs = _Knobs()
        self.dims = (4,)
        self.calls = 0  # never read by the forward

    def forward(self, x):
        y = self.lin(x).reshape(-1, *self.dims)
        if self.use_lora:
            y = y * 2
        if self.training:
            y = y + 100
        return y / self.temperature + self.knobs.shift


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enabled = True

    def forward(self, x):
        return x * 3 if self.enabled else x


class Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class GlobalScale(torch.nn.Module):
    def forward(self, x):
        return x * SCALE


def _set_lora(m):
    m.use_lora = False


def _set_temperature(m):
    m.temperature = 0.5


def _train_inner(m):
    m.train()  # on the model itself, not the wrapper


def _set_knob(m):
    m.knobs.shift = -3.0


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (_set_lora, r"attribute use_lora \(True -> False\)"),
        (_set_temperature, r"attribute temperature \(1\.0 -> 0\.5\)"),
        (_train_inner, r"attribute training \(False -> True\)"),
        (_set_knob, r"attribute knobs\.shift \(1\.0 -> -3\.0\)"),
    ],
    ids=["flag", "temperature", "train_on_inner_module", "plain_object_field"],
)
@pytest.mark.parametrize("frontend", ["raw", "dynamo"])
def test_a_value_the_forward_reads_changed_after_capture_captures_again(change, named, frontend):
    model = Flags().eval()
    graphed = _wrap(model, frontend, batch_sizes=[4])
    torch.testing.assert_close(graphed(_x()), model(_x()))
    change(model)
    if frontend == "raw":
        with pytest.warns(UserWarning, match=named):
            out = graphed(_x())
    else:  # Dynamo's guard fails: the new value is another trace and its own graph, no warning
        out = _quiet(graphed, _x())
    torch.testing.assert_close(out, model(_x()))
    torch.testing.assert_close(graphed(_x()), model(_x()))
    assert graphed.stats.replays == 3
    assert graphed.stats.recaptures == (1 if frontend == "raw" else 0)


@pytest.mark.parametrize("frontend", ["raw", "dynamo"])
def test_a_submodules_flag_is_guarded(frontend):
    model = Stack()
    graphed = _wrap(model, frontend, batch_sizes=[4])
    graphed(_x())
    model.blocks[1].enabled = False
    torch.testing.assert_close(_quiet(graphed, _x()), model(_x()))
    # raw: the AttributeGuard captures again; Dynamo: its guard fails, another trace and graph
    assert graphed.stats.recaptures == (1 if frontend == "raw" else 0) and graphed.stats.replays == 2


@pytest.mark.parametrize("frontend", ["raw", "dynamo"])
def test_a_global_the_forward_reads_is_guarded(frontend):
    global SCALE
    graphed = _wrap(GlobalScale(), frontend, batch_sizes=[4])
    graphed(_x())
    try:
        SCALE = 5.0
        torch.testing.assert_close(_quiet(graphed, _x()), _x() * 5.0)
    finally:
        SCALE = 2.0
    # raw: the AttributeGuard captures again; Dynamo: its guard fails, another trace and graph
    assert graphed.stats.recaptures == (1 if frontend == "raw" else 0) and graphed.stats.replays == 2


def _closure_model():
    weight = torch.ones(4)

    def forward(x):
        return x * weight

    def swap(new):
        nonlocal weight
        weight = new

    return forward, swap


@pytest.mark.parametrize(
    ("frontend", "named"),
    # Dynamo's graphs take the closure's tensor as an input, named by Dynamo's source for it
    [("raw", r"closure 'weight' \(<tensor \[4\]"), ("dynamo", r"L\['weight'\] was replaced since capture")],
)
def test_a_wrapped_functions_closure_tensor_swapped_is_followed(frontend, named):
    forward, swap = _closure_model()
    graphed = _wrap(forward, frontend, batch_sizes=[4])
    torch.testing.assert_close(graphed(_x()), _x())
    swap(torch.full((4,), 3.0))
    with pytest.warns(UserWarning, match=named):
        out = graphed(_x())
    torch.testing.assert_close(out, _x() * 3)


def test_values_the_forward_does_not_read_or_set_again_equal_keep_the_graphs():
    model = Flags().eval()
    graphed = devgraph.wrap(model, device="cpu", batch_sizes=[4])
    for i in range(4):
        model.calls += 1  # an attribute the forward never reads, beside flags it reads
        model.temperature = float("1.0")  # a new float object, equal to the captured one
        model.dims = tuple([4])  # a new tuple, equal item by item
        torch.testing.assert_close(graphed(_x(seed=i)), model(_x(seed=i)))
    assert graphed.stats.recaptures == 0 and graphed.stats.replays == 4


@pytest.mark.parametrize("frontend", ["dynamo", "raw"])
def test_piecewise_mode_follows_a_flag_too(frontend):
    model = Flags().eval()
    graphed = _quiet(
        devgraph.wrap, model, device="cpu", mode="piecewise", frontend=frontend, capture_sizes=[4]
    )
    torch.testing.assert_close(graphed(_x()), model(_x()))
    model.use_lora = False
    torch.testing.assert_close(_quiet(graphed, _x()), model(_x()))
    if frontend == "raw":  # devgraph's attribute guard sees the flag: the pieces captured again
        assert graphed.stats.recaptures == 1
    else:  # Dynamo's guard on the flag fails: a trace (and capture) of its own
        assert graphed.stats.recompiles == 1 and graphed.stats.graphs == 2


@pytest.mark.parametrize("versions", [True, False], ids=["dict_versions", "python_only"])
def test_the_guard_sees_a_change_with_or_without_torchs_dict_versions(versions, monkeypatch):
    if not versions:
        monkeypatch.setattr(_guard, "_version_check", lambda tables: None)
    elif _guard._version_check([{"a": 1}]) is None:
        pytest.skip("this torch or Python has no dict-version guard")
    model = Stack()
    guard = AttributeGuard(model)
    assert (guard._versioned is not None) is versions
    assert guard.changed() is None
    model.blocks[2].enabled = True  # the same value again: nothing changed
    assert guard.changed() is None
    model.blocks[2].enabled = False
    assert guard.changed() == "attribute blocks.2.enabled (True -> False)"


def test_the_guard_holds_only_what_the_forward_reads():
    guard = AttributeGuard(Flags())
    paths = set(guard._table_paths)
    assert {"use_lora", "temperature", "training", "knobs", "knobs.shift"} <= paths
    assert "calls" not in paths and "lin.in_features" not in paths
