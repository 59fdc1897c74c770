"""``torch.compile``'d code inside a capture runs compiled and is recorded whole.

Dynamo skips compiled frames under a dispatch mode that does not declare
``ignore_compile_internals``, and inductor's CPU kernels bypass the dispatcher, so an op recorder
would either run the eager fallback or record the compiled graph partially (replaying it wrong).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import devgraph
from devgraph._errors import CaptureError


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles its own modules: no cache entries or recompile counts carried over."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class CountingBackend:
    """A Dynamo backend whose compiled graphs count their calls (proof the compiled code ran)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, gm, example_inputs):
        def run(*args):
            self.calls += 1
            return gm(*args)

        return run


class Block(torch.nn.Module):
    """Linear, GELU, residual: enough for inductor to fuse into one C++ kernel plus an mm."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(width, width)

    def forward(self, x):
        return torch.nn.functional.gelu(self.lin(x)) + x * 0.5


class Outer(torch.nn.Module):
    """An eager model whose middle is a ``torch.compile``'d submodule."""

    def __init__(self, backend, width: int = 8) -> None:
        super().__init__()
        self.pre = torch.nn.Linear(width, width)
        self.block = torch.compile(Block(width), backend=backend)

    def forward(self, x):
        return self.block(self.pre(x)).relu() * 2


def _capture(device, model, x):
    graph = device.graph()
    with torch.no_grad():
        model(x)  # warm-up: compiles outside the capture
        with graph.capture():
            out = model(x)
    return graph, out


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compiled_submodule_replays_new_inputs_like_eager(backend):
    torch.manual_seed(0)
    model = Outer(backend)
    x = torch.randn(4, 8)
    graph, out = _capture(devgraph.device("cpu"), model, x)
    for _ in range(2):
        fresh = torch.randn(4, 8)
        x.copy_(fresh)
        graph.replay()
        with torch.no_grad():
            want = model.block._orig_mod(model.pre(fresh)).relu() * 2
        torch.testing.assert_close(out, want)


def test_compiled_submodule_replays_like_eager_on_every_backend(any_device):
    model = Outer("aot_eager").to(any_device.torch_device)
    x = torch.randn(4, 8, device=any_device.torch_device)
    graph, out = _capture(any_device, model, x)
    fresh = torch.randn(4, 8, device=any_device.torch_device)
    x.copy_(fresh)
    graph.replay()
    with torch.no_grad():
        want = model.block._orig_mod(model.pre(fresh)).relu() * 2
    torch.testing.assert_close(out, want)


def test_compiled_code_runs_during_capture_and_replay():
    backend = CountingBackend()
    model = Outer(backend)
    x = torch.randn(4, 8)
    graph = devgraph.device("cpu").graph()
    with torch.no_grad():
        model(x)
        before = backend.calls
        with graph.capture():
            model(x)
        assert backend.calls == before + 1, (
            "the eager fallback ran inside the capture, not the compiled graph"
        )
        graph.replay()
    assert backend.calls == before + 2


def test_compiled_graph_is_recorded_as_one_task():
    model = Outer("inductor")
    graph, _ = _capture(devgraph.device("cpu"), model, torch.randn(4, 8))
    ops = graph.recorded_ops
    compiled = [op for op in ops if op.startswith("torch.compile'd graph")]
    assert len(compiled) == 1
    assert "test_compiled_capture.py" in compiled[0]
    # Only the eager parts around it are recorded op by op (the block's addmm/gelu are not).
    assert [op for op in ops if op not in compiled] == ["aten::addmm", "aten::relu", "aten::mul"]


def test_host_sync_inside_compiled_code_is_refused():
    class Syncing(torch.nn.Module):
        def forward(self, x):
            return x * x.abs().max().item()

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.compile(Syncing(), backend="aot_eager")

        def forward(self, x):
            return self.inner(x + 1)

    model, x = Model(), torch.randn(4, 8)
    graph = devgraph.device("cpu").graph()
    with torch.no_grad():
        model(x)
        with pytest.raises(CaptureError, match=r"item"):
            with graph.capture():
                model(x)


@pytest.mark.parametrize(
    ("backend", "batch_sizes", "calls", "replays"),
    [("aot_eager", [2, 4], (1, 3, 4), 3), ("inductor", [4], (3, 4), 2)],
)
def test_wrap_of_compiled_module_serves_calls_from_graphs_equal_to_eager(
    backend, batch_sizes, calls, replays
):
    torch.manual_seed(0)
    block = Block()
    graphed = devgraph.wrap(torch.compile(block, backend=backend), device="cpu", batch_sizes=batch_sizes)
    for rows in calls:
        x = torch.randn(rows, 8)
        got = graphed(x)
        with torch.no_grad():
            torch.testing.assert_close(got, block(x))
    assert graphed.stats.replays == replays
    assert graphed.stats.fallbacks == {}


class VarArgs(torch.nn.Module):
    """A forward taking ``*args, **kwargs`` (wrappers and adapters often look like this)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, *args, **kwargs):
        x, gate = args
        return self.lin(x) * gate + kwargs["bias"] * kwargs.get("scale", 1.0)


def test_wrap_of_varargs_forward_serves_calls_from_graphs():
    torch.manual_seed(0)
    model = VarArgs()
    bias = torch.randn(8)
    graphed = devgraph.wrap(model, device="cpu", batch_sizes=[2, 4], static_args=["bias"])
    for rows in (1, 3, 4):
        x, gate = torch.randn(rows, 8), torch.randn(rows, 1)
        got = graphed(x, gate, bias=bias, scale=0.5)
        with torch.no_grad():
            torch.testing.assert_close(got, model(x, gate, bias=bias, scale=0.5))
    assert graphed.stats.replays == 3
    assert graphed.stats.fallbacks == {}


@pytest.mark.parametrize("frontend", ["raw", "dynamo"])
def test_varargs_call_with_other_constants_falls_back_or_is_traced_again(frontend):
    model = VarArgs()
    bias = torch.randn(8)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*untraced")
        graphed = devgraph.wrap(model, device="cpu", batch_sizes=[2], static_args=["bias"], frontend=frontend)
    x, gate = torch.randn(2, 8), torch.randn(2, 1)
    graphed(x, gate, bias=bias, scale=0.5)
    if frontend == "raw":  # the call template names the constant that differs
        with pytest.warns(UserWarning, match="scale"):
            got = graphed(x, gate, bias=bias, scale=2.0)
    else:  # Dynamo guards kwargs['scale']: another trace and graph, served
        got = graphed(x, gate, bias=bias, scale=2.0)
    with torch.no_grad():
        torch.testing.assert_close(got, model(x, gate, bias=bias, scale=2.0))
    if frontend == "raw":
        assert graphed.stats.fallbacks == {"signature_mismatch": 1}
    else:
        assert graphed.stats.fallbacks == {} and graphed.stats.recompiles == 1 and graphed.stats.replays == 2


def test_piecewise_trace_names_the_host_sync_and_its_line():
    class Syncing(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            y = self.lin(x)
            return y * y.abs().max().item()

    with pytest.warns(UserWarning, match="without Dynamo's guards"):
        graphed = devgraph.wrap(Syncing(), device="cpu", mode="piecewise", frontend="raw", capture_sizes=[4])
    with pytest.raises(CaptureError) as info:
        graphed(torch.randn(3, 8))
    assert info.value.op == "Tensor.item"
    assert "test_compiled_capture.py" in info.value.source
    assert "y.abs().max().item()" in info.value.source
    # With Dynamo in front (the default) the host read is a graph break, run eagerly at every call.
    model = Syncing().requires_grad_(False)
    traced = devgraph.wrap(model, device="cpu", mode="piecewise", capture_sizes=[4])
    x = torch.randn(3, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the graph break is named once
        torch.testing.assert_close(traced(x), model(x))
    assert traced.stats.graph_breaks


def test_unrecognised_compiled_code_is_refused_not_recorded_in_part(monkeypatch):
    # As if a future Dynamo called its compiled graphs some other way: devgraph cannot find the
    # graph's boundaries, sees inductor's code run, and refuses instead of recording part of it.
    from devgraph.graph import _compiled_regions

    monkeypatch.setattr(_compiled_regions, "_COMPILED_GRAPH_REASON", "a reason torch never gives")
    model, x = Outer("inductor"), torch.randn(4, 8)
    graph = devgraph.device("cpu").graph()
    with torch.no_grad():
        model(x)
        with pytest.raises(CaptureError, match="inductor-generated code"):
            with graph.capture():
                model(x)


def test_updatable_op_inside_compiled_code_is_refused():
    import devgraph.ops as ops

    class Attention(torch.nn.Module):
        def forward(self, q, k, v, table, seq, lens):
            return ops.paged_decode_attention(q, k, v, table, seq, lens) * 1.0

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 8, generator=g)
    k, v = torch.randn(16, 4, 2, 8, generator=g), torch.randn(16, 4, 2, 8, generator=g)
    table = torch.arange(1, 7, dtype=torch.int32).view(2, 3)
    seq = torch.tensor([5, 9], dtype=torch.int32)
    attention = torch.compile(Attention(), backend="aot_eager")
    dev = devgraph.device("cpu")
    graph = dev.graph()
    with torch.no_grad():
        attention(q, k, v, table, seq, [5, 9])
        with pytest.raises(CaptureError, match="updatable op inside a compiled graph"):
            with graph.capture(auto_update_ops=dev.updatable_ops):
                attention(q, k, v, table, seq, [5, 9])


def test_graph_break_gives_one_task_per_compiled_graph_and_replays_like_eager():
    def body(x, w):
        y = torch.nn.functional.gelu(x @ w)
        torch._dynamo.graph_break()  # the eager code here is recorded op by op
        return (y.sin() + x).relu()

    compiled = torch.compile(body, backend="inductor")
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    graph = devgraph.device("cpu").graph()
    with torch.no_grad():
        compiled(x, w)
        with graph.capture():
            out = compiled(x, w)
    assert sum(op.startswith("torch.compile'd graph") for op in graph.recorded_ops) == 2
    fresh = torch.randn(4, 8)
    x.copy_(fresh)
    graph.replay()
    torch.testing.assert_close(out, body(fresh, w))


def _called_after_the_capture() -> None:
    """A function the profiler must see (it runs after the capture, while profiling)."""


def test_a_capture_under_cprofile_completes_and_hands_the_profiler_back():
    # Regression: the capture put cProfile's profiler object back with sys.setprofile, which refuses
    # it (TypeError mid-capture); a C profiler re-installs itself instead. Whether the profiler is
    # still profiling is read from what it recorded: from Python 3.12 on cProfile runs on
    # sys.monitoring and sys.getprofile() no longer returns it.
    import cProfile
    import pstats

    import devgraph

    dev = devgraph.device("cpu")
    x = torch.ones(4)
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        graph = dev.graph()
        with graph.capture():
            y = x * 2
        _called_after_the_capture()
    finally:
        profiler.disable()
    seen = {name for _, _, name in pstats.Stats(profiler).stats}
    assert "_called_after_the_capture" in seen  # profiling goes on after the capture
    x.fill_(3.0)
    graph.replay()
    torch.testing.assert_close(y, torch.full((4,), 6.0))
