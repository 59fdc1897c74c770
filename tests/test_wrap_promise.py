"""devgraph.wrap on the models people bring: every call equals eager, or devgraph refuses.

Weights swapped after capture, forwards with side effects, hooks and train mode, rows that mix
under padding, outputs that are not per-row tensors, constants compared by type and value,
autocast and the default dtype; and the runner checks that a broken version must fail
(issue 19).
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings

import numpy as np
import pytest
import torch
from _tiny_modules import SeededLinear as Lin  # Linear(4, 4) from seed 0

import devgraph
from devgraph import DevgraphError
from devgraph.runner import GraphRunner
from devgraph.runner._calls import CallReader, Unsupported
from devgraph.runner._config import RunnerConfig


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def _x(n: int = 3, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 4, generator=torch.Generator().manual_seed(seed))


# -- weights replaced after capture ------------------------------------------------------------


#: The warning of a replaced weight: the raw path's weight watch names it as a parameter; Dynamo's
#: graphs name the tensor by its path.
_REPLACED = {
    "raw": r"parameter 'lin.weight' was replaced since capture",
    "dynamo": r"lin.weight was replaced since capture",
}


@pytest.mark.parametrize("frontend", ["raw", "dynamo"])
def test_a_parameter_assigned_after_capture_is_captured_again(frontend):
    model = Lin().eval()
    graphed = _quiet(devgraph.wrap, model, device="cpu", batch_sizes=[4], frontend=frontend)
    graphed(_x())
    model.lin.weight = torch.nn.Parameter(torch.randn(4, 4))
    with pytest.warns(UserWarning, match=_REPLACED[frontend]):
        out = graphed(_x())
    torch.testing.assert_close(out, model(_x()))
    assert graphed.stats.recaptures == 1


def test_load_state_dict_with_assign_on_the_model_or_the_wrapper_is_followed():
    model = Lin().eval()
    graphed = devgraph.wrap(model, device="cpu", batch_sizes=[4])
    graphed(_x())
    new = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    _quiet(model.load_state_dict, new, assign=True)
    torch.testing.assert_close(_quiet(graphed, _x()), model(_x()))
    newer = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    graphed.load_state_dict(newer, assign=True)
    torch.testing.assert_close(graphed(_x()), model(_x()))


def test_a_submodule_replaced_after_capture_is_followed():
    model = Lin().eval()
    graphed = devgraph.wrap(model, device="cpu", batch_sizes=[4])
    graphed(_x())
    model.lin = torch.nn.Linear(4, 4)
    torch.testing.assert_close(_quiet(graphed, _x()), model(_x()))


def test_in_place_weight_copies_keep_the_graphs():
    model = Lin().eval()
    graphed = devgraph.wrap(model, device="cpu", batch_sizes=[4])
    graphed(_x())
    with torch.no_grad():
        model.lin.weight.copy_(torch.randn(4, 4))
    torch.nn.Linear(4, 4)  # registrations elsewhere make the runner look, and find nothing replaced
    torch.testing.assert_close(graphed(_x()), model(_x()))
    graphed.load_state_dict({k: v * 2 for k, v in model.state_dict().items()})  # in place: no assign
    torch.testing.assert_close(graphed(_x()), model(_x()))
    assert graphed.stats.recaptures == 0 and graphed.stats.replays == 3


def test_param_data_replaced_is_refused_in_debug_mode():
    model = Lin().eval()
    graphed = _quiet(devgraph.wrap, model, device="cpu", batch_sizes=[4], debug=True, frontend="raw")
    for _ in range(3):  # the watch has settled: it looks again only after a registration
        graphed(_x())
    model.lin.weight.data = torch.randn(4, 4)  # no registration: only debug mode sees this
    with pytest.raises(DevgraphError, match=r"parameter 'lin.weight'.*capture"):
        graphed(_x())


def test_param_data_replaced_is_captured_again_through_dynamo():
    # Dynamo's graphs take the weights as inputs: one at a new address is captured again, debug or not.
    model = Lin().eval()
    graphed = devgraph.wrap(model, device="cpu", batch_sizes=[4], debug=True)
    for _ in range(3):
        graphed(_x())
    model.lin.weight.data = torch.randn(4, 4)
    torch.testing.assert_close(_quiet(graphed, _x()), model(_x()))
    assert graphed.stats.recaptures == 1


# -- forward side effects at warm-up and capture --------------------------------------------------


class Counts(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.steps.add_(1)
        return x * 2


def test_a_buffer_the_forward_advances_counts_real_calls_only():
    model = Counts()
    graphed = devgraph.wrap(model, device="cpu", batch_sizes=[2, 4])
    for _ in range(3):
        graphed(_x())
    assert model.steps.item() == 3  # as eager: warm-ups, capture and checks left no trace


class Position(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pos = 0

    def forward(self, x):
        self.pos += 1
        return x + self.pos


def test_a_python_attribute_changed_in_forward_is_refused_by_name():
    model = Position()
    graphed = _quiet(devgraph.wrap, model, device="cpu", batch_sizes=[4], frontend="raw")
    with pytest.raises(DevgraphError, match=r"attribute pos \(0 -> \d+\)"):
        graphed(_x())
    assert model.pos == 0  # put back


def test_a_python_attribute_changed_in_forward_advances_as_in_eager_through_dynamo():
    # Dynamo replays the forward's Python side effects at every call: served, not refused.
    model, twin = Position(), Position()
    graphed = devgraph.wrap(model, device="cpu", batch_sizes=[4])
    for i in range(3):
        torch.testing.assert_close(_quiet(graphed, _x(seed=i)), twin(_x(seed=i)))
    assert model.pos == twin.pos == 3


def test_batch_norm_running_stats_are_not_moved_by_capture():
    model = torch.nn.BatchNorm1d(4).eval()
    model.running_mean.fill_(0.5)
    graphed = devgraph.wrap(model, device="cpu", batch_sizes=[4])
    torch.testing.assert_close(graphed(_x()), model(_x()))
    assert model.running_mean.tolist() == [0.5] * 4


def test_hooks_are_warned_about_once():
    model = Lin().eval()
    model.lin.register_forward_hook(lambda m, i, o: None)
    graphed = _quiet(devgraph.wrap, model, device="cpu", batch_sizes=[4], frontend="raw")
    with pytest.warns(UserWarning, match=r"hooks or pre-hooks on lin run while capturing, not at replay"):
        graphed(_x())


def test_hooks_run_at_every_call_through_dynamo():
    # Dynamo traces the hooks with the forward: they run (and change the output) as in eager.
    model = Lin().eval()
    calls = []
    model.lin.register_forward_hook(lambda m, i, o: calls.append(1) or o * 2)
    graphed = devgraph.wrap(model, device="cpu", batch_sizes=[4])
    with torch.no_grad():
        for i in range(3):
            torch.testing.assert_close(_quiet(graphed, _x(seed=i)), model(_x(seed=i)))
    assert len(calls) == 6  # three served calls and three eager ones


def test_training_mode_is_warned_about_naming_eval():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    graphed = devgraph.wrap(model, device="cpu", batch_sizes=[4])
    with pytest.warns(UserWarning, match=r"training mode.*model\.eval\(\)"):
        _quiet_fallbacks(graphed, _x())


def _quiet_fallbacks(graphed, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*running eagerly.*")
        return graphed(*args, **kwargs)


# -- padding: rows must be independent --------------------------------------------------------------


class Centres(torch.nn.Module):
    def forward(self, x):
        return x - x.mean(0)


class Branches(torch.nn.Module):
    def forward(self, x):
        return x * 2 if x.shape[0] > 3 else x * 3


@pytest.mark.parametrize("frontend", ["raw", "dynamo"])
@pytest.mark.parametrize(
    "model", [Centres(), Branches(), torch.nn.BatchNorm1d(4).train()], ids=["mean", "branch", "bn_train"]
)
def test_a_model_that_mixes_rows_is_served_exactly(model, frontend):
    graphed = _quiet(devgraph.wrap, model, device="cpu", batch_sizes=[4], frontend=frontend)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = graphed(_x(3))
    messages = [str(w.message) for w in seen]
    if frontend == "dynamo" and isinstance(model, Branches):
        # Dynamo takes the branch on the call's real size (3 rows: x * 3) and the graph it traced
        # is padded to bucket 4 exactly: replayed, no fallback.
        assert not any("(padding_changes_result)" in m for m in messages), messages
        torch.testing.assert_close(out, model(_x(3)))
        torch.testing.assert_close(graphed(_x(4)), model(_x(4)))
        assert graphed.stats.replays == 2 and graphed.stats.fallbacks == {}
        return
    assert sum("(padding_changes_result)" in m for m in messages) == 1, messages
    # Batch norm in train mode is also warned about, by name; the other two are plain modules.
    assert sum("model is in training mode" in m for m in messages) == isinstance(model, torch.nn.BatchNorm1d)
    torch.testing.assert_close(out, model(_x(3)))
    torch.testing.assert_close(graphed(_x(4)), model(_x(4)))  # a bucket's own size still replays
    assert graphed.stats.replays == 1 and graphed.stats.fallbacks == {"padding_changes_result": 1}


def test_check_padding_false_skips_the_checks_eager_runs():
    # The Hugging Face decode step vouches for its rows this way: the checks' extra eager steps
    # would move its cache's write positions past a short cache (the forwards seen by a wrapper).
    seen = _RUNS
    seen.clear()
    for check in (True, False):
        config = RunnerConfig(batch_sizes=[2, 4], check_padding=check)
        _quiet(GraphRunner(_Counting(check), devgraph.device("cpu"), config), _x(3))
    # warm-ups (2 each) and captures (1 each) of 2 buckets: 6; the check adds 3 runs per checked bucket
    assert seen[False] == 6 and seen[True] > seen[False]


#: forwards run per _Counting key: a module global, not state of the model (which capture would refuse)
_RUNS: dict[bool, int] = {}


class _Counting(torch.nn.Module):
    def __init__(self, key):
        super().__init__()
        self.key = key

    def forward(self, x):
        _RUNS[self.key] = _RUNS.get(self.key, 0) + 1
        return x * 2


class SpecialCasesOne(torch.nn.Module):
    def forward(self, x):
        return x * 2 if x.shape[0] == 1 else x * 3


def test_a_branch_at_a_size_never_padded_keeps_padding():
    model = SpecialCasesOne()
    graphed = devgraph.wrap(model, device="cpu", batch_sizes=[1, 4])
    for n in (1, 3, 2):  # 1 runs in bucket 1 and is never padded: 2 and 3 pad to 4 exactly
        torch.testing.assert_close(graphed(_x(n)), model(_x(n)))
    assert graphed.stats.replays == 3


class AttendsToAll(torch.nn.Module):
    """Non-causal attention over the tokens (rows): padded tokens would be attended to."""

    def forward(self, x):
        q = x.unsqueeze(0)
        return torch.nn.functional.scaled_dot_product_attention(q, q, q).squeeze(0) + 1


@pytest.mark.parametrize("model", [Centres(), AttendsToAll()], ids=["mean", "attention"])
def test_piecewise_pads_no_tokens_for_a_model_that_mixes_them(model):
    graphed = devgraph.wrap(model, device="cpu", mode="piecewise", capture_sizes=[4])
    out = _quiet_fallbacks(graphed, _x(3))
    torch.testing.assert_close(out, model(_x(3)))
    assert graphed.stats.fallbacks.get("padding_changes_result") == 1


# -- outputs that are not per-row tensors -------------------------------------------------------------


class Outputs(torch.nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.w = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        y = x @ self.w
        if self.kind == "count":
            return y, x.shape[0]
        if self.kind == "flat":
            return y.reshape(-1)
        if self.kind == "rows":
            return list(y.unbind(0))
        return y, self.w * 2  # "fixed": a [4, 4] output that is not per row


@pytest.mark.parametrize("frontend", ["raw", "dynamo"])
@pytest.mark.parametrize("buckets", [[4], [2, 4]])
@pytest.mark.parametrize("kind", ["count", "flat", "rows", "fixed"])
def test_outputs_that_are_not_per_row_come_back_as_eager_returns_them(kind, buckets, frontend):
    model = Outputs(kind).eval()
    graphed = _quiet(devgraph.wrap, model, device="cpu", batch_sizes=buckets, frontend=frontend)
    for n in (3, 4, *buckets[:-1]):
        out = _quiet_fallbacks(graphed, _x(n))
        want = model(_x(n))
        if isinstance(want, tuple) and not isinstance(want[1], torch.Tensor):
            assert out[1] == want[1]
            torch.testing.assert_close(out[0], want[0])
        else:
            torch.testing.assert_close(out, want)
    if kind == "fixed":  # padding is exact: the [4, 4] output is not cut
        assert graphed.stats.replays == len(buckets) + 1
    elif frontend == "dynamo" and kind in ("count", "rows"):
        # Dynamo computes x.shape[0] and unbinds the rows from the call's real size (a graph per
        # row count where the output's length depends on it): every call replayed, none eager.
        assert graphed.stats.fallbacks == {} and graphed.stats.eager_calls == 0
    else:
        assert graphed.stats.fallbacks == {"padding_changes_result": 1}


# -- the call template --------------------------------------------------------------------------------


class Scales(torch.nn.Module):
    def forward(self, x, scale=1.0):
        return x * scale


def test_an_int_constant_is_not_served_from_a_float_constants_graph():
    graphed = devgraph.wrap(Scales(), device="cpu", batch_sizes=[4])
    x = torch.arange(8).reshape(4, 2)
    assert graphed(x, scale=1.0).dtype == torch.float32
    out = _quiet_fallbacks(graphed, x, scale=1)
    assert out.dtype == torch.int64 and out.tolist() == x.tolist()


class Cfg:
    def __init__(self) -> None:
        self.k = 2.0


class UsesCfg(torch.nn.Module):
    def forward(self, x, cfg):
        return x * cfg.k


def test_a_plain_object_mutated_between_calls_no_longer_matches():
    cfg = Cfg()
    graphed = devgraph.wrap(UsesCfg(), device="cpu", batch_sizes=[4])
    graphed(_x(), cfg)
    cfg.k = 5.0
    torch.testing.assert_close(_quiet_fallbacks(graphed, _x(), cfg), _x() * 5.0)


class UsesTable(torch.nn.Module):
    def forward(self, x, table):
        return x * float(table.sum())


def test_a_large_numpy_constant_is_compared_exactly():
    table = np.zeros(5000)
    graphed = devgraph.wrap(UsesTable(), device="cpu", batch_sizes=[4])
    graphed(_x(), table)
    changed = table.copy()
    changed[2500] = 1.0  # not in the array's truncated repr
    assert repr(changed) == repr(table)
    torch.testing.assert_close(_quiet_fallbacks(graphed, _x(), changed), _x() * 1.0)


@dataclasses.dataclass(frozen=True)
class Holder:
    bias: torch.Tensor


class UsesHolder(torch.nn.Module):
    def forward(self, x, holder):
        return x + holder.bias


@pytest.mark.parametrize("frontend", ["raw", "dynamo"])
def test_a_frozen_dataclass_holding_a_tensor_runs_eagerly(frontend):
    graphed = _quiet(devgraph.wrap, UsesHolder(), device="cpu", batch_sizes=[4], frontend=frontend)
    holder = Holder(torch.ones(4))
    if frontend == "raw":
        with pytest.warns(UserWarning, match="holds a tensor"):
            out = graphed(_x(), holder)
    else:  # Dynamo reads the tensor inside the dataclass as a graph input: served, no warning
        out = graphed(_x(), holder)
    torch.testing.assert_close(out, _x() + 1)
    torch.testing.assert_close(_quiet_fallbacks(graphed, _x(), Holder(torch.zeros(4))), _x())


@pytest.mark.parametrize("frontend", ["raw", "dynamo"])
def test_autocast_is_part_of_the_template_both_ways(frontend):
    model = Lin().eval()
    graphed = _quiet(devgraph.wrap, model, device="cpu", batch_sizes=[4], frontend=frontend)
    assert graphed(_x()).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        out = _quiet_fallbacks(graphed, _x())
        want = model(_x())
    assert out.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(out, want)

    under = _quiet(devgraph.wrap, Lin().eval(), device="cpu", batch_sizes=[4], frontend=frontend)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        assert under(_x()).dtype == torch.bfloat16
    out = _quiet_fallbacks(under, _x())
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, under.module(_x()))
    # Dynamo guards the autocast state: the other state is another trace and graph, not a fallback
    assert under.stats.fallbacks == ({"autocast_or_dtype_mismatch": 1} if frontend == "raw" else {})


class MakesOnes(torch.nn.Module):
    def forward(self, x):
        return x.double() + torch.ones(x.shape[0], 1)


@pytest.mark.parametrize("frontend", ["raw", "dynamo"])
def test_the_default_dtype_is_part_of_the_template(frontend):
    model = MakesOnes()
    graphed = _quiet(devgraph.wrap, model, device="cpu", batch_sizes=[4], frontend=frontend)
    graphed(_x())
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        out = _quiet_fallbacks(graphed, _x())
        want = model(_x())
    finally:
        torch.set_default_dtype(before)
    assert out.dtype == want.dtype
    torch.testing.assert_close(out, want)
    # Dynamo guards the default dtype: another trace and graph, not a fallback
    assert graphed.stats.fallbacks == ({"autocast_or_dtype_mismatch": 1} if frontend == "raw" else {})


# -- checks a broken runner must fail (mutation tests) ----------------------------------------------


@pytest.mark.parametrize("frontend", ["raw", "dynamo"])
def test_a_batched_input_of_another_dtype_is_not_served_from_the_graph(frontend):
    model = Scales()
    graphed = _quiet(devgraph.wrap, model, device="cpu", batch_sizes=[4], frontend=frontend)
    graphed(_x())
    out = _quiet_fallbacks(graphed, _x().double())
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, model(_x().double()))
    if frontend == "raw":
        assert graphed.stats.fallbacks == {"signature_mismatch": 1}
    else:  # Dynamo guards the dtype: the float64 call is another trace and its own graph
        assert graphed.stats.fallbacks == {} and graphed.stats.replays == 2


class AddsStatic(torch.nn.Module):
    def forward(self, x, table):
        return x + table.float().sum()


@pytest.mark.parametrize("other", ["address", "shape", "dtype"])
def test_a_static_argument_that_changed_is_not_served_from_the_graph(other):
    table = torch.tensor([1.0, 2.0, 3.0, 4.0])
    graphed = devgraph.wrap(AddsStatic(), device="cpu", batch_sizes=[4], static_args=["table"])
    graphed(_x(), table)
    changed = {
        "address": torch.tensor([5.0, 6.0, 7.0, 8.0]),
        "shape": table[:2],  # same address
        "dtype": table.view(torch.int32),  # same address and size
    }[other]
    torch.testing.assert_close(_quiet_fallbacks(graphed, _x(), changed), _x() + changed.float().sum())
    if other == "address":  # the same trace: the graph's runner refuses the other tensor
        assert graphed.stats.fallbacks == {"signature_mismatch": 1}
    else:  # Dynamo guards shape and dtype: the changed table is another trace and its own graph
        assert graphed.stats.fallbacks == {} and graphed.stats.replays == 2


def _lens(x, lens):
    return x


def test_a_host_list_of_the_wrong_length_is_refused():
    reader = CallReader(inspect.signature(_lens), RunnerConfig(host_args=["lens"]))
    reader.read((torch.ones(3, 2), [1, 2, 3]), {})
    with pytest.raises(Unsupported, match="host argument 'lens' has 2 values for batch 3"):
        reader.read((torch.ones(3, 2), [1, 2]), {})


class SlotWriter(torch.nn.Module):
    """Writes each row's value at the row's slot of a cache (padded rows: slot 0, scratch)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(16))

    def forward(self, x, slot):
        self.cache.index_copy_(0, slot, x)
        return x * 2


def test_padding_rows_above_a_smaller_bucket_stay_dirty_8_then_2_then_7():
    model = SlotWriter()
    graphed = devgraph.wrap(model, device="cpu", batch_sizes=[2, 8])
    graphed(torch.arange(1.0, 9.0), torch.arange(1, 9))  # 8 rows: slots 1..8
    graphed(torch.tensor([9.0, 10.0]), torch.tensor([9, 10]))  # bucket 2: rows 2..7 untouched
    model.cache.zero_()
    graphed(torch.arange(11.0, 18.0), torch.arange(1, 8))  # 7 rows in bucket 8: row 7 is padding
    assert model.cache.tolist() == [0.0, *range(11, 18), 0.0] + [0.0] * 7  # slot 8 not rewritten


def _open(*args, **kwargs):
    return args, kwargs


def test_a_binding_plan_that_differs_from_a_full_bind_is_not_kept():
    reader = CallReader(inspect.signature(_open), RunnerConfig())
    t = torch.ones(2, 3)
    first = reader.read((), {"args": t})  # a keyword named like the *args parameter
    second = reader.read((), {"args": t})
    assert list(first.batched) == list(second.batched) == ["args"]
    assert second.batched["args"] is t


def test_a_parameter_assigned_after_capture_is_followed_in_piecewise_mode():
    model = Lin().eval()
    graphed = devgraph.wrap(model, device="cpu", mode="piecewise", capture_sizes=[4])
    torch.testing.assert_close(graphed(_x(4)), model(_x(4)))
    model.lin.weight = torch.nn.Parameter(torch.randn(4, 4))
    torch.testing.assert_close(_quiet(graphed, _x(4)), model(_x(4)))
    assert graphed.stats.recaptures == 1


def test_the_weight_watch_trusts_a_registration_count_two_looks_found():
    from devgraph.runner._weights import WeightWatch, registrations

    model = Lin()
    watch = WeightWatch()
    watch.remember(model)
    old = model.lin.weight
    registrations[0] += 1  # a registration hook ran; the new value is not stored yet (another thread)
    assert watch.replaced() is None and watch.seen != registrations[0]
    model.lin._parameters["weight"] = torch.nn.Parameter(torch.randn(4, 4))  # ...now it is
    assert watch.replaced() == "parameter 'lin.weight'"
    model.lin._parameters["weight"] = old
    assert watch.replaced() is None and watch.replaced() is None
    assert watch.seen == registrations[0]


def test_the_weight_watch_leaves_other_compiled_models_alone():
    """devgraph's registration hooks are process-wide: a forward that makes modules as it runs (an HF
    model slicing self.layers[:n]) registered them inside Dynamo's trace, the counter's bump was a side
    effect Dynamo guarded on, and every call of that compiled model recompiled (past the limit: eager).
    The hook does nothing while Dynamo traces."""

    class Sliced(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

        def forward(self, x):
            for layer in self.layers[:2]:  # a new ModuleList: registrations inside the forward
                x = layer(x)
            return x

    devgraph.wrap(torch.nn.Linear(4, 4), device="cpu", batch_sizes=[1])(torch.ones(1, 4))  # hooks on
    compiles = []

    def backend(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    torch._dynamo.reset()
    model = Sliced()
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for _ in range(4):
            assert torch.equal(compiled(torch.ones(2, 4)), model(torch.ones(2, 4)))
    assert len(compiles) == 1
