"""Dynamo in front, devgraph behind (``devgraph.wrap(..., frontend="dynamo")``,
``torch.compile(backend="devgraph")``): every served call equals eager, wherever the forward reads
or changes Python state.

Each case builds a model and a way to change what it reads between calls, twice (the same seed): one
copy is called eagerly, the other through devgraph, over the same sequence of calls (batch sizes
that pad: 3 rows in the bucket of 4) and changes. The outputs must be equal call for call. These are
the paths the hand-written walkers of the raw front end missed (module globals, class attributes,
properties, partials, closures, iterators, Python counters, torch's global flags, values deep in
containers, shape branches); Dynamo guards and replays them, devgraph captures what it traces. For
each case the raw front end (``frontend="raw"``) is run too: where it is wrong, the test says so, so
these tests also show what the new front end fixes.
"""

from __future__ import annotations

import contextvars
import functools
import itertools
import logging
import random
import warnings
import weakref

import pytest
import torch
from torch import nn

import devgraph

SIZES = (3, 5, 1, 3, 7)
TABLE: dict[str, float] = {}
COUNTER: list = []


def _helper_scale(x: torch.Tensor) -> torch.Tensor:
    """A helper in this module reading a module-level dict (a global Dynamo guards)."""
    return x * TABLE["scale"]


class _Config:
    def __init__(self) -> None:
        self._gain = 1.0

    @property
    def gain(self) -> float:
        return self._gain


def _linear(seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(8, 8)
    with torch.no_grad():  # small integers: every sum exact, whatever kernel this CPU picks per row count
        layer.weight.copy_(torch.randint(-2, 3, (8, 8)).float())
        layer.bias.copy_(torch.randint(-2, 3, (8,)).float())
    return layer


def _module_global():
    TABLE.clear()
    TABLE["scale"] = 2.0

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = _linear()

        def forward(self, x):
            return _helper_scale(self.l(x))

    def change(i):
        TABLE["scale"] = 2.0 + i

    return M(), change


def _class_attribute():
    class M(nn.Module):
        offset = 0.5

        def __init__(self):
            super().__init__()
            self.l = _linear()

        def forward(self, x):
            return self.l(x) + type(self).offset

    def change(i):
        M.offset = 0.5 * i

    return M(), change


def _property_of_plain_object():
    cfg = _Config()

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = _linear()
            self.cfg = cfg

        def forward(self, x):
            return self.l(x) * self.cfg.gain

    def change(i):
        cfg._gain = float(i % 3 + 1)

    return M(), change


def _partial_keywords():
    def act(x, *, slope):
        return torch.where(x > 0, x, x * slope)

    holder = {"act": functools.partial(act, slope=0.25)}

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = _linear()
            self.act = holder["act"]

        def forward(self, x):
            return self.act(self.l(x))

    model = M()

    def change(i):
        model.act.keywords["slope"] = 0.25 * (i % 4)

    return model, change


def _closure_cell():
    state = {"bias": 0.0}
    bias = [0.0]

    def add_bias(x):
        return x + bias[0] + state["bias"]

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = _linear()

        def forward(self, x):
            return add_bias(self.l(x))

    def change(i):
        bias[0] = float(i)

    return M(), change


def _iterator_advanced_each_call():
    counter = itertools.count()

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = _linear()

        def forward(self, x):
            return self.l(x) + next(counter)

    return M(), None


def _python_counter_on_the_module():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = _linear()
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return self.l(x)

    return M(), None


def _buffer_written_in_place():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = _linear()
            self.register_buffer("steps", torch.zeros(()))

        def forward(self, x):
            self.steps.add_(1)
            return self.l(x) + self.steps

    return M(), None


def _list_item_past_the_sixteenth():
    weights = [1.0] * 20

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = _linear()
            self.weights = weights

        def forward(self, x):
            return self.l(x) * self.weights[18]

    def change(i):
        weights[18] = float(i + 1)

    return M(), change


def _value_four_objects_deep():
    class Leaf:
        value = 1.0

    class Mid:
        def __init__(self):
            self.leaf = Leaf()

    class Top:
        def __init__(self):
            self.mid = Mid()

    class Root:
        def __init__(self):
            self.top = Top()

    root = Root()

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = _linear()
            self.root = root

        def forward(self, x):
            return self.l(x) + self.root.top.mid.leaf.value

    def change(i):
        root.top.mid.leaf.value = float(i)

    return M(), change


def _branch_on_the_batch_size():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = _linear()

        def forward(self, x):
            if x.shape[0] == 1:  # a single row takes another path
                return self.l(x) * 100
            if len(x) > 4:
                return self.l(x) - 7
            return self.l(x)

    return M(), None


def _torch_global_flag():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = _linear()

        def forward(self, x):
            if torch.is_autocast_cpu_enabled():
                return self.l(x) + 1000
            return self.l(x) + torch.get_default_dtype().itemsize

    def change(i):
        torch.set_default_dtype(torch.float64 if i % 2 else torch.float32)

    return M(), change


def _context_var():
    var = contextvars.ContextVar("gain", default=1.0)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = _linear()

        def forward(self, x):
            return self.l(x) * var.get()

    def change(i):
        var.set(float(i % 3 + 1))

    return M(), change


def _lambda_in_a_dict():
    holder = {"f": lambda t: t * 2}

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = _linear()

        def forward(self, x):
            return holder["f"](self.l(x))

    def change(i):
        holder["f"] = lambda t, k=i: t * (k % 3 + 1)

    return M(), change


def _function_attribute():
    def scale(t):
        return t * scale.k

    scale.k = 2.0

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = _linear()

        def forward(self, x):
            return scale(self.l(x))

    def change(i):
        scale.k = float(i % 3 + 1)

    return M(), change


def _module_behind_a_weakref():
    inner = _linear(1)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.ref = weakref.ref(inner)

        def forward(self, x):
            return self.ref()(x)

    def change(i):
        with torch.no_grad():
            inner.bias.add_(1)

    model = M()
    model.keep = [inner]  # alive while the model is (not a submodule: reached through the weakref only)
    return model, change


def _bound_method_of_another_module():
    other = _linear(1)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.f = other.forward

        def forward(self, x):
            return self.f(x)

    def change(i):
        with torch.no_grad():
            other.bias.add_(1)

    return M(), change


def _random_instance():
    rng = random.Random(0)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = _linear()

        def forward(self, x):
            return self.l(x) + rng.randint(0, 9)

    return M(), None


CASES = {
    "module_global": _module_global,
    "class_attribute": _class_attribute,
    "property_of_plain_object": _property_of_plain_object,
    "partial_keywords": _partial_keywords,
    "closure_cell": _closure_cell,
    "iterator_advanced_each_call": _iterator_advanced_each_call,
    "python_counter_on_the_module": _python_counter_on_the_module,
    "buffer_written_in_place": _buffer_written_in_place,
    "list_item_past_the_sixteenth": _list_item_past_the_sixteenth,
    "value_four_objects_deep": _value_four_objects_deep,
    "branch_on_the_batch_size": _branch_on_the_batch_size,
    "torch_global_flag": _torch_global_flag,
    "context_var": _context_var,
    "lambda_in_a_dict": _lambda_in_a_dict,
    "function_attribute": _function_attribute,
    "module_behind_a_weakref": _module_behind_a_weakref,
    "bound_method_of_another_module": _bound_method_of_another_module,
    "random_instance": _random_instance,
}


def _run(case, serve):
    """The outputs of the case's call sequence, each call made through ``serve(model)``, and the
    model (its Python state after the calls)."""
    torch.manual_seed(1)
    inputs = [torch.randint(-3, 4, (rows, 8)).float() for rows in SIZES]
    model, change = CASES[case]()
    model.eval()
    call = serve(model)
    outputs = []
    try:
        with torch.no_grad():
            for i, x in enumerate(inputs):
                outputs.append(call(x).clone())
                if change is not None:
                    change(i + 1)
    finally:
        torch.set_default_dtype(torch.float32)
    return outputs, model


def _eager(model):
    return model


def _dynamo(model):
    return devgraph.wrap(model, device="cpu", frontend="dynamo", batch_sizes=[4, 8])


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_call_equals_eager(case):
    expected, eager_model = _run(case, _eager)
    served, model = _run(case, _dynamo)
    for i, (got, want) in enumerate(zip(served, expected)):
        assert torch.equal(got, want), f"call {i} ({SIZES[i]} rows): {(got - want).abs().max()}"
    assert vars(model).get("calls") == vars(eager_model).get("calls")  # Python side effects, as eagerly


def test_a_python_counter_advances_once_per_call_not_per_capture_run():
    _, model = _run("python_counter_on_the_module", _dynamo)
    assert model.calls == len(SIZES)


def test_a_buffer_written_in_place_advances_once_per_call():
    _, model = _run("buffer_written_in_place", _dynamo)
    assert model.steps.item() == len(SIZES)


def test_calls_are_served_from_graphs():
    model, _ = _module_global()
    graphed = _dynamo(model.eval())
    with torch.no_grad():
        for rows in (3, 5, 3, 2):
            graphed(torch.randn(rows, 8))
        graphed(torch.randn(1, 8))
    stats = graphed.stats
    # the batch dimension is dynamic from the first call (devgraph marks it): one graph, captured per
    # bucket; a single row is a size Dynamo specialises (its own graph, that size alone)
    assert stats.replays == 5 and stats.eager_calls == 0, stats
    assert stats.graphs == 2 and stats.captured_sizes == (1, 4, 8), stats


def test_a_size_the_forward_returns_is_the_calls_not_the_buckets():
    class M(nn.Module):
        def forward(self, x):
            return x * 2, x.shape[0] * 10

    graphed = _dynamo(M())
    with torch.no_grad():
        for rows in (3, 5, 6):
            out, n = graphed(torch.ones(rows, 4))
            assert n == rows * 10 and out.shape == (rows, 4)
    assert graphed.stats.replays == 3


def test_a_graph_break_runs_the_code_between_eagerly_and_graphs_both_sides():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = _linear(0), _linear(1)
            self.seen = []

        def forward(self, x):
            h = self.a(x)
            torch._dynamo.graph_break()
            self.seen.append(int(h.shape[0]))
            return self.b(h)

    model = M().eval()
    graphed = _dynamo(model)
    x = torch.randint(-2, 3, (5, 8)).float()
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(graphed(x), model.b(model.a(x)))
    assert model.seen == [5, 5]  # the Python between the graphs ran eagerly, at the call's size
    stats = graphed.stats
    assert stats.replays == 4 and stats.eager_calls == 0, stats  # both sides of the break, both calls
    assert stats.captured_sizes == (4, 8), stats  # the batch stays dynamic across the break


def test_torch_compile_with_the_devgraph_backend():
    model = nn.Sequential(_linear(0), nn.ReLU(), _linear(1)).eval()
    compiled = torch.compile(model, backend="devgraph", options={"device": "cpu", "batch_sizes": [4]})
    x = torch.randint(-2, 3, (4, 8)).float()
    with torch.no_grad():
        assert torch.equal(compiled(x), model(x))
        assert torch.equal(compiled(x + 1), model(x + 1))


def test_a_python_number_passed_as_a_tensor_runs_eagerly_and_is_counted(caplog):
    """torch.compile on its own passes a float that changed as a 0-d tensor read with .item(): a
    replay would freeze it; that graph runs as traced, eagerly, named once."""
    gain = {"g": 1.0}

    class M(nn.Module):
        def forward(self, x):
            return x * gain["g"]

    from devgraph.frontend import backend_for

    graphs = backend_for({"device": "cpu", "batch_sizes": [4]})
    compiled = torch.compile(M(), backend=graphs)
    x = torch.ones(4, 2)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="devgraph"):
        for g in (1.0, 2.0, 3.0):
            gain["g"] = g
            assert torch.equal(compiled(x), x * g)
    if graphs.stats.unservable:  # torch versions that pass the float as a tensor
        assert graphs.stats.unservable == {"python_scalar": 1}
        assert sum("python_scalar" in r.getMessage() for r in caplog.records) == 1


def test_torch_compiles_mode_is_refused():
    # torch wraps a backend's error in its own (BackendCompilerFailed), keeping devgraph's message
    with pytest.raises(Exception, match=r"DevgraphError: .*options=.*not mode='reduce-overhead'"):
        torch.compile(nn.Linear(2, 2), backend="devgraph", mode="reduce-overhead")(torch.ones(1, 2))


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"nonsense": 1}, r"unknown option\(s\) \['nonsense'\]"),
        ({"mode": "full_and_piecewise"}, "is not served with Dynamo in front"),
        ({"static_args": ["x"]}, "read from Dynamo's graph"),
    ],
)
def test_bad_options_are_refused_by_name(options, match):
    from devgraph.frontend import backend_for

    with pytest.raises(devgraph.DevgraphError, match=match):
        backend_for({"device": "cpu", **options})


def test_an_unknown_frontend_is_refused():
    with pytest.raises(devgraph.DevgraphError, match=r"frontend must be 'dynamo'.*or 'raw'"):
        devgraph.wrap(nn.Linear(2, 2), device="cpu", frontend="fx")


def test_a_recompile_storm_is_named_and_counted():
    """A value read by the forward that changes every call makes Dynamo trace again each time; past
    its recompile limit it runs the call as Python: counted, one warning naming it and the fix."""
    scale = {"s": 0.0}

    class M(nn.Module):
        def forward(self, x):
            return x * scale["s"]

    graphed = _dynamo(M())
    x = torch.ones(3, 2)
    limit = torch._dynamo.config.patch(recompile_limit=2)
    with torch.no_grad(), limit, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(5):
            scale["s"] = float(i)
            assert torch.equal(graphed(x), x * float(i))
    stats = graphed.stats
    assert stats.fallbacks.get("dynamo_untraced", 0) >= 2, stats
    named = [w for w in caught if "ran without graphs" in str(w.message)]
    assert len(named) == 1 and "recompile_limit" in str(named[0].message)


def test_strict_refuses_a_graph_it_cannot_serve():
    counter = {"n": 0.0}

    class M(nn.Module):
        def forward(self, x):
            counter["n"] += 1.5
            return x * counter["n"]

    from devgraph.frontend import backend_for

    compiled = torch.compile(M(), backend=backend_for({"device": "cpu", "batch_sizes": [2], "strict": True}))
    with torch.no_grad():
        compiled(torch.ones(2, 2))
        with pytest.raises(Exception, match="devgraph cannot serve a graph Dynamo traced"):
            compiled(torch.ones(2, 2))


def test_batch_dims_marks_the_named_argument_dynamic_along_that_dim():
    class M(nn.Module):
        def forward(self, x):  # x: [features, batch]
            return x * 2

    graphed = devgraph.wrap(M(), device="cpu", frontend="dynamo", batch_dims={"x": 1}, batch_sizes=[2, 4])
    with torch.no_grad():
        for rows in (3, 2, 4):
            x = torch.randn(5, rows)
            assert torch.equal(graphed(x), x * 2)
    assert graphed.stats.replays == 3 and graphed.stats.captured_sizes == (2, 4), graphed.stats


def test_batch_dims_naming_an_argument_the_forward_does_not_take_is_refused():
    with pytest.raises(
        devgraph.DevgraphError,
        match=r"batch_dims names \['y'\], which the model does not take; it takes: input",
    ):
        devgraph.wrap(nn.Identity(), device="cpu", frontend="dynamo", batch_dims={"y": 0})


def test_python_random_draws_run_eagerly_after_the_first_call_named_and_counted(caplog):
    """torch 2.13's Dynamo repeats a random.Random instance's first draw on every later call (with any
    backend); devgraph sees the draw in the graph, names it, and runs later calls eagerly."""
    wrappers = []

    def serve(model):
        wrappers.append(_dynamo(model))
        return wrappers[-1]

    with caplog.at_level(logging.WARNING, logger="devgraph"):
        _run("random_instance", serve)
    assert sum("random.Random" in r.getMessage() for r in caplog.records) == 1
    assert wrappers[0].stats.fallbacks == {"python_random": len(SIZES) - 1}


def test_torch_compiles_own_backend_refuses_python_random_draws():
    rng = random.Random(0)

    class M(nn.Module):
        def forward(self, x):
            return x + rng.randint(0, 9)

    compiled = torch.compile(M(), backend="devgraph", options={"device": "cpu", "batch_sizes": [4]})
    with pytest.raises(Exception, match=r"cannot serve this forward through Dynamo.*random"):
        compiled(torch.zeros(4, 1))


def test_a_generator_argument_draws_as_eagerly():
    """A torch.Generator passed as an argument: each call draws from its state then, not capture's."""

    class M(nn.Module):
        def forward(self, x, gen):
            return x + torch.randn(x.shape, generator=gen)

    def draws(serve):
        gen = torch.Generator().manual_seed(0)
        model = serve(M())
        with torch.no_grad():
            return [model(torch.zeros(3, 4), gen).clone() for _ in range(4)]

    for got, want in zip(draws(_dynamo), draws(_eager)):
        assert torch.equal(got, want)


def test_a_value_computed_from_a_host_list_follows_the_list():
    """max(lengths) of a Python list argument: Dynamo guards the list, so a new list is a new trace
    (or an eager call), never the capture's value."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = _linear()

        def forward(self, x, lengths):
            return self.l(x) * max(lengths)

    model = M().eval()
    graphed = _dynamo(model)
    x = torch.randint(-2, 3, (3, 8)).float()
    with torch.no_grad():
        for i in range(4):
            lengths = [i + 1, 2, 1]
            assert torch.equal(graphed(x, lengths), model(x, lengths))


def test_an_input_that_is_a_view_of_the_models_own_buffer_is_read_as_it_is_now():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = _linear()
            self.register_buffer("buf", torch.zeros(8, 8))

        def forward(self, x):
            return self.l(x)

    model = M().eval()
    graphed = _dynamo(model)
    with torch.no_grad():
        for i in range(4):
            model.buf.fill_(float(i))
            x = model.buf[:3]
            assert torch.equal(graphed(x), model(x))


@pytest.mark.parametrize("case", ["module_global", "closure_cell"])
def test_the_cases_catch_a_stale_graph(case):
    """The harness above tells a stale replay: the raw front end (its own walkers, no Dynamo) serves
    graphs captured with the old value on these cases (see docs/wrap.md), and the comparison sees it."""
    expected, _ = _run(case, _eager)
    served, _ = _run(case, _raw)
    assert any(not torch.equal(got, want) for got, want in zip(served, expected))


def _raw(model):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*captures the forward as it runs, untraced")
        return devgraph.wrap(model, device="cpu", frontend="raw", batch_sizes=[1, 2, 4, 8])


@pytest.mark.skipif(
    "isolate_recompiles" not in __import__("inspect").signature(torch.compile).parameters,
    reason="torch < 2.13 cannot isolate a compile's recompiles: wrappers of one class share Dynamo's limit",
)
def test_more_wrapped_models_than_dynamos_recompile_limit_are_graphed():
    torch._dynamo.reset()
    limit = torch._dynamo.config.recompile_limit
    with torch.no_grad():
        for i in range(limit + 2):
            model = nn.Linear(4, 4).eval()
            graphed = devgraph.wrap(model, device="cpu", batch_sizes=[2, 4])
            x = torch.randn(3, 4)
            torch.testing.assert_close(_quiet_fallbacks(graphed, x), model(x))
            assert graphed.stats.replays == 1 and graphed.stats.eager_calls == 0, (
                f"model {i}: {graphed.stats}"
            )


def _quiet_fallbacks(fn, *args):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*running eagerly.*")
        return fn(*args)


def test_a_replaced_weight_is_captured_again_counted_and_warned_once():
    model = nn.Sequential(_linear(0)).eval()
    graphed = _dynamo(model)
    x = torch.randint(-2, 3, (3, 8)).float()
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch.equal(graphed(x), model(x))
        for seed in (1, 2):
            model[0].weight = nn.Parameter(_linear(seed).weight.detach().clone())  # a new tensor
            assert torch.equal(graphed(x), model(x))
        with torch.no_grad():
            model[0].bias.data = model[0].bias.data + 1  # the same Parameter, new memory
        assert torch.equal(graphed(x), model(x))
    stats = graphed.stats
    assert stats.recaptures == 3 and stats.eager_calls == 0, stats
    replaced = [str(w.message) for w in caught if "was replaced since capture" in str(w.message)]
    assert len(replaced) == 1 and "0.weight" in replaced[0], replaced


def test_every_backend_serves_dynamos_graphs(any_device):
    """The CPU reference, the NPU backend over its simulator, CUDA where a GPU is visible."""
    dev = any_device
    TABLE.clear()
    TABLE["scale"] = 2.0
    model = nn.Sequential(_linear(0), nn.ReLU()).to(dev.torch_device).eval()

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x):
            return _helper_scale(self.inner(x))

    wrapped = M()
    graphed = devgraph.wrap(wrapped, device=dev, frontend="dynamo", batch_sizes=[2, 4])
    x = torch.randint(-2, 3, (3, 8)).float().to(dev.torch_device)
    with torch.no_grad():
        for scale in (2.0, 3.0):
            TABLE["scale"] = scale
            assert torch.equal(graphed(x), wrapped(x))
    assert graphed.stats.replays == 2 and graphed.stats.eager_calls == 0, graphed.stats
