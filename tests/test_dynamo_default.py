"""``devgraph.wrap`` in ``mode="full"`` puts Dynamo in front by default (``devgraph.frontend``).

What the default adds over the raw front end, each checked against eager and against a broken
version where one can be planted: graph breaks counted and refused with ``fullgraph=True``,
recompiles counted and named, the model's tensors a graph writes in place read from the FX graph
(every form of in-place write) and put back after capture, a capture that writes anything else
refused, the options that name arguments, the wrapper's surface (copies, threads), and the one
warning of an untraced wrap.
"""

from __future__ import annotations

import copy
import logging
import pickle
import threading
import warnings

import pytest
import torch
from torch import nn

import devgraph
from devgraph.frontend import TracedModule, _traced_graph


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _x(n: int, seed: int = 0, width: int = 4) -> torch.Tensor:
    return torch.randint(-3, 4, (n, width), generator=torch.Generator().manual_seed(seed)).float()


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def test_wrap_in_full_mode_is_dynamo_in_front_and_raw_says_what_it_leaves_unchecked():
    model = nn.Linear(4, 4).eval()
    graphed = devgraph.wrap(model, device="cpu", batch_sizes=[2, 4])
    assert isinstance(graphed, TracedModule)
    with torch.no_grad():
        torch.testing.assert_close(graphed(_x(3)), model(_x(3)), rtol=0, atol=1e-6)
    assert graphed.stats.frontend == "dynamo" and graphed.stats.replays == 1
    with pytest.warns(
        UserWarning, match=r"frontend='raw' captures the forward as it runs, untraced.*not guarded"
    ):
        raw = devgraph.wrap(model, device="cpu", frontend="raw", batch_sizes=[2, 4])
    assert raw.stats.frontend == "raw" and not isinstance(raw, TracedModule)
    with pytest.warns(
        UserWarning,
        match=r"mode='piecewise' is served from one trace or capture.*without Dynamo's guards.*frontend='dynamo'",
    ):
        devgraph.wrap(model, device="cpu", mode="piecewise", frontend="raw", capture_sizes=[2, 4])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Dynamo in front of piecewise mode by default: no warning
        assert isinstance(
            devgraph.wrap(model, device="cpu", mode="piecewise", capture_sizes=[2, 4]), TracedModule
        )


SEEN: list[float] = []


@torch._dynamo.disable
def _record(y: torch.Tensor) -> None:
    SEEN.append(float(y.abs().sum()))  # code Dynamo does not trace: the graph breaks at the call


class Breaks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        _record(y)
        return y * 2


def test_a_graph_break_runs_the_code_there_every_call_counted_by_reason_and_warned_once(caplog):
    model = Breaks().eval()
    graphed = devgraph.wrap(model, device="cpu", batch_sizes=[4])
    SEEN.clear()
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="devgraph"):
        for seed in range(3):
            assert torch.equal(_quiet(graphed, _x(4, seed)), model(_x(4, seed)))
    assert len(SEEN) == 6 and SEEN[0::2] == SEEN[1::2]  # the code at the break ran at every call
    breaks = graphed.stats.graph_breaks
    assert len(breaks) == 1 and "disable" in next(iter(breaks)) and next(iter(breaks.values())) == 1, breaks
    warned = [r.getMessage() for r in caplog.records if "Dynamo broke the forward's graph" in r.getMessage()]
    assert len(warned) == 1 and "fullgraph=True" in warned[0]


def test_fullgraph_refuses_a_graph_break_by_name():
    graphed = devgraph.wrap(Breaks().eval(), device="cpu", batch_sizes=[4], fullgraph=True)
    with pytest.raises(devgraph.DevgraphError, match=r"fullgraph=True: Dynamo cannot trace Breaks's forward"):
        with torch.no_grad():
            graphed(_x(4))
    with pytest.raises(devgraph.DevgraphError, match="fullgraph must be True or False"):
        devgraph.wrap(Breaks(), device="cpu", fullgraph="yes")


class ClassScale(nn.Module):
    scale = 2.0

    def forward(self, x):
        return x * type(self).scale


def test_a_guard_that_fails_traces_and_captures_again_counted_and_named(caplog):
    model = ClassScale()
    graphed = devgraph.wrap(model, device="cpu", batch_sizes=[4])
    try:
        with caplog.at_level(logging.WARNING, logger="devgraph"):
            assert torch.equal(_quiet(graphed, _x(3)), model(_x(3)))
            ClassScale.scale = 5.0
            assert torch.equal(_quiet(graphed, _x(3)), model(_x(3)))
    finally:
        ClassScale.scale = 2.0
    assert graphed.stats.recompiles == 1 and graphed.stats.graphs == 2
    warned = [r.getMessage() for r in caplog.records if "Dynamo traced the forward again" in r.getMessage()]
    assert len(warned) == 1 and "scale" in warned[0] and "2.0" in warned[0]


@torch.library.custom_op("devgraph_test::bump", mutates_args={"t"})
def _bump(t: torch.Tensor) -> None:
    t.add_(1)


class Writes(nn.Module):
    """The model's own tensors written in place, in every form a graph can show it."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.lin = nn.Linear(4, 4)
        self.register_buffer("n", torch.zeros(4))
        with torch.no_grad():
            self.lin.weight.copy_(torch.eye(4))
            self.lin.bias.zero_()

    def forward(self, x):
        how, n = self.how, self.n
        if how == "method":
            n.add_(1)
        elif how == "operator":
            n += 1
        elif how == "setitem":
            n[1:3] = n[1:3] + 1
        elif how == "view":
            n.view(2, 2)[0].mul_(2).add_(1)
        elif how == "data":
            n.data.add_(1)
        elif how == "out":
            torch.add(n, 1, out=n)
        elif how == "inplace_kwarg":
            n.sub_(2)
            torch.nn.functional.relu(n, inplace=True)
            n.add_(1)
        elif how == "custom_op":
            _bump(n)
        elif how == "foreach":  # a list of tensors written in place
            torch._foreach_add_([n, self.lin.bias], 1)
        elif how == "parameter":
            with torch.no_grad():
                self.lin.bias.mul_(0.5).add_(1)
        return self.lin(x) + n


@pytest.mark.parametrize(
    "how",
    [
        "method",
        "operator",
        "setitem",
        "view",
        "data",
        "out",
        "inplace_kwarg",
        "custom_op",
        "parameter",
        "foreach",
    ],
)
def test_the_models_tensors_a_graph_writes_advance_once_per_call_as_in_eager(how):
    model = Writes(how).eval()
    twin = copy.deepcopy(model)
    graphed = devgraph.wrap(model, device="cpu", batch_sizes=[2, 4])
    with torch.no_grad():
        for i, rows in enumerate((3, 4, 2)):
            assert torch.equal(_quiet(graphed, _x(rows, i)), twin(_x(rows, i))), (how, i)
    assert torch.equal(model.n, twin.n) and torch.equal(model.lin.bias, twin.lin.bias)
    assert graphed.stats.replays == 3


def test_a_capture_that_writes_what_the_graph_does_not_show_is_refused(monkeypatch):
    """The broken version: a reading of the graph that misses every write. The capture's runs then
    advance the buffer without its being put back, and devgraph refuses instead of serving."""
    monkeypatch.setattr(_traced_graph, "written_placeholders", lambda gm: set())
    graphed = devgraph.wrap(Writes("method").eval(), device="cpu", batch_sizes=[4])
    with pytest.raises(
        devgraph.DevgraphError, match=r"wrote n in place, which devgraph did not find written"
    ):
        with torch.no_grad():
            _quiet(graphed, _x(4))


class FromMin(nn.Module):
    """Rows mix through a minimum over the batch: padded rows of 0 change it, of 99 do not."""

    def forward(self, ids, table):
        return (ids - ids.min()).float().unsqueeze(-1) + table.sum()


def test_pad_values_and_static_args_name_the_forwards_arguments():
    model = FromMin()
    table = torch.ones(4, 3)  # 4 rows: not batched (static_args), never padded
    ids = torch.tensor([5, 7, 6])
    for pad, served in (({"ids": 99}, True), ({}, False)):
        graphed = devgraph.wrap(model, device="cpu", batch_sizes=[4], pad_values=pad, static_args=["table"])
        with torch.no_grad():
            assert torch.equal(_quiet(graphed, ids, table), model(ids, table))
        stats = graphed.stats
        assert (stats.replays, stats.fallbacks) == ((1, {}) if served else (0, {"padding_changes_result": 1}))
    with pytest.raises(devgraph.DevgraphError, match=r"pad_values names \['idz'\].*takes"):
        devgraph.wrap(model, device="cpu", pad_values={"idz": 0})
    with pytest.raises(devgraph.DevgraphError, match=r"static_args names \['tabel'\]"):
        devgraph.wrap(model, device="cpu", static_args=["tabel"])


def test_host_args_are_refused_naming_the_raw_front_end_which_a_model_may_choose_itself():
    from devgraph.testing.models import DecoderConfig, make_decoder

    class HostList(nn.Module):
        def forward(self, x, lengths):
            return x * 2

    with pytest.raises(devgraph.DevgraphError, match=r"host_args=.*frontend='raw'"):
        devgraph.wrap(HostList(), device="cpu", host_args=["lengths"])
    decoder = make_decoder(DecoderConfig(num_layers=1))  # its devgraph_options choose "raw"
    with pytest.warns(UserWarning, match="untraced"):
        graphed = devgraph.wrap(decoder, device="cpu", max_batch_size=4)
    assert graphed.stats.frontend == "raw"


def test_copies_and_pickles_carry_the_options_never_the_graphs():
    model = nn.Linear(4, 4).eval()
    graphed = devgraph.wrap(model, device="cpu", batch_sizes=[2, 4])
    with torch.no_grad():
        graphed(_x(3))
        for twin in (copy.deepcopy(graphed), copy.copy(graphed), pickle.loads(pickle.dumps(graphed))):
            assert isinstance(twin, TracedModule) and twin.stats.replays == 0
            torch.testing.assert_close(twin(_x(3)), model(_x(3)), rtol=0, atol=1e-6)
            assert twin.stats.captured_sizes == (2, 4)


def test_a_second_live_thread_is_refused_naming_clone_outputs():
    graphed = devgraph.wrap(nn.Tanh(), device="cpu", batch_sizes=[4])
    with torch.no_grad():
        graphed(_x(4))
    errors: list[str] = []

    def other():
        try:
            graphed(_x(4))
        except devgraph.DevgraphError as e:
            errors.append(str(e))

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert len(errors) == 1 and "clone_outputs=True" in errors[0]


class AttendsPerRow(nn.Module):
    """Attention within each row (a piecewise splitting op and a break op), a Python counter, and a
    branch on the batch size: what the piecewise and breakable modes' own traces cannot follow."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q = nn.Linear(8, 8)
        self.o = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = self.q(x).view(x.shape[0], 2, 4, 1).expand(-1, -1, -1, 2)  # [rows, heads, 4 tokens, 2]
        a = torch.nn.functional.scaled_dot_product_attention(h, h, h).reshape(x.shape[0], 16)[:, :8]
        if x.shape[0] == 1:  # the decode fast path
            a = a * 2
        return self.o(a) + self.calls


@pytest.mark.parametrize("mode", ["piecewise", "breakable"])
def test_piecewise_and_breakable_graphs_behind_dynamo_follow_python_state_as_eager(mode):
    model, twin = AttendsPerRow().eval(), AttendsPerRow().eval()
    sizes = {"capture_sizes": [2, 4]} if mode == "piecewise" else {"batch_sizes": [2, 4]}
    graphed = devgraph.wrap(model, device="cpu", mode=mode, **sizes)  # Dynamo in front: the default
    with torch.no_grad():
        for i, rows in enumerate((3, 1, 4, 3)):
            x = _x(rows, i, width=8)
            torch.testing.assert_close(_quiet(graphed, x), twin(x), rtol=0, atol=1e-5)
    assert model.calls == twin.calls == 4
    assert graphed.stats.replays >= 3 and graphed.stats.frontend == "dynamo"
    runner = graphed.graphs.runners[0]  # the first call's graph (3 rows: dynamic in the batch)
    assert (runner.pieces is not None) == (mode == "piecewise")
    assert (runner.breakable is not None) == (mode == "breakable")


def test_modes_that_route_by_is_decode_are_not_served_behind_dynamo():
    with pytest.raises(
        devgraph.DevgraphError, match=r"frontend='dynamo' serves mode='full', 'breakable' and 'piecewise'"
    ):
        devgraph.wrap(nn.Linear(4, 4), device="cpu", mode="full_and_piecewise", frontend="dynamo")
    from devgraph.frontend import backend_for

    with pytest.raises(devgraph.DevgraphError, match=r"mode='full_and_breakable' is not served with Dynamo"):
        backend_for({"mode": "full_and_breakable"})


def test_a_model_built_under_inference_mode_is_served_and_its_state_advances():
    """Its tensors are inference tensors, without version counters: the capture's check of what it
    wrote must not read one (it raised RuntimeError)."""
    with torch.inference_mode():
        model = Writes("method").eval()
    twin = copy.deepcopy(model)
    graphed = devgraph.wrap(model, device="cpu", batch_sizes=[4])
    with torch.inference_mode():
        for i in range(3):
            assert torch.equal(_quiet(graphed, _x(4, i)), twin(_x(4, i)))
    assert torch.equal(model.n, twin.n) and graphed.stats.replays == 3
