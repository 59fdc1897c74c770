"""Per-piece capture mechanics on the CPU reference backend, with tiny toy models.

Both front ends serve the pieces with one ``GraphRunner`` per traced graph: ``frontend='raw'`` (one
trace of the forward, ``graphed.runner``) and the default Dynamo front end (``graphed.graphs.runners``).
Tests of what only the raw trace does (one trace for every call, host lists reaching its splitting
ops, its refusals, its rollback and reset) pass ``frontend='raw'``; the staging and weak references of
the pieces are checked on both.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import devgraph
from devgraph import DevgraphError
from devgraph.backends.cpu._pool import block_of
from devgraph.compile import CompileConfig, DevgraphCompiler
from devgraph.frontend import TracedModule
from devgraph.runner import GraphRunner, RunnerConfig

_lib = torch.library.Library("devgraph_test", "FRAGMENT")
_lib.define("scale_rows(Tensor x, int[] factors) -> Tensor")


@torch.library.impl(_lib, "scale_rows", "CPU")
def _scale_rows(x, factors):
    return x * torch.tensor(factors, dtype=x.dtype).unsqueeze(-1)


@torch.library.register_fake("devgraph_test::scale_rows", lib=_lib)
def _scale_rows_fake(x, factors):
    return torch.empty_like(x)


class Toy(torch.nn.Module):
    """Two linear layers around an RMSNorm the tests split at (it returns a fresh tensor per call)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin1 = torch.nn.Linear(8, 8)
        self.lin2 = torch.nn.Linear(8, 8)
        self.weight = torch.nn.Parameter(torch.rand(8) + 0.5)

    def forward(self, x):
        h = torch.ops.devgraph.rms_norm(torch.tanh(self.lin1(x)), self.weight, 1e-6)
        return {"y": self.lin2(h) * 2, "scale": 3, "first": h[:, :2]}


#: The one warning of a wrap served without Dynamo in front (``frontend='raw'``).
UNTRACED = "without Dynamo's guards"


def _wrap(model, **options):
    """``devgraph.wrap(model, mode='piecewise')``; with ``frontend='raw'``, its one warning expected."""
    if options.get("frontend") != "raw":
        return devgraph.wrap(model, device="cpu", mode="piecewise", **options)
    with pytest.warns(UserWarning, match=UNTRACED):
        return devgraph.wrap(model, device="cpu", mode="piecewise", **options)


def _runner(graphed) -> GraphRunner:
    """The runner serving the pieces: the raw trace's, or that of the latest graph Dynamo handed over
    with a dynamic token count (a call of one token gets a graph of its own, captured whole; a module
    fixture's model is traced again after the reset of Dynamo between tests)."""
    if isinstance(graphed, TracedModule):
        return [r for r in graphed.graphs.runners if r.pieces is not None][-1]
    return graphed.runner


def _toy(**options):
    import devgraph.ops  # noqa: F401  (registers devgraph::rms_norm)

    model = Toy().requires_grad_(False)
    options.setdefault("capture_sizes", [2, 4, 8])
    graphed = _wrap(model, splitting_ops=["devgraph::rms_norm"], **options)
    return model, graphed


@pytest.fixture(scope="module", params=["dynamo", "raw"])
def toy(request):
    return _toy(frontend=request.param)


def _x(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n", [1, 3, 4, 8, 11])
def test_output_structure_and_values_match_eager(toy, n):
    model, graphed = toy
    got, want = graphed(_x(n, n)), model(_x(n, n))
    assert set(got) == {"y", "scale", "first"} and got["scale"] == 3
    assert got["y"].shape == (n, 8) and got["first"].shape == (n, 2)
    torch.testing.assert_close(got["y"], want["y"])
    torch.testing.assert_close(got["first"], want["first"])


def test_eager_splitting_op_outputs_are_copied_into_the_captured_inputs(toy):
    _, graphed = toy
    graphed(_x(2))
    before = _runner(graphed).pieces.module.input_copies
    graphed(_x(3))
    assert _runner(graphed).pieces.module.input_copies == before + 1


def test_piece_outputs_are_weak_references_so_the_pool_can_reuse_them(toy):
    _, graphed = toy
    graphed(_x(4))
    module = _runner(graphed).pieces.module
    outputs = [
        t
        for piece in module.piece_graphs
        for out in piece.graphs.outputs().values()
        for t in (out if isinstance(out, (tuple, list)) else [out])
        if isinstance(t, torch.Tensor) and block_of(t) is not None
    ]
    assert outputs and not any(block_of(t).in_use() for t in outputs)
    pool = module.graphs(8)[0].pool()
    assert pool.allocated_bytes() == 0 < pool.reserved_bytes()


def test_outputs_are_graph_memory_overwritten_by_the_next_call_unless_cloned():
    _, graphed = _toy(capture_sizes=[4])
    first = graphed(_x(4, 1))["y"]
    kept = first.clone()
    graphed(_x(4, 2))
    assert not torch.equal(first, kept)
    _, cloning = _toy(capture_sizes=[4], clone_outputs=True)
    first = cloning(_x(4, 1))["y"]
    kept = first.clone()
    cloning(_x(4, 2))
    assert torch.equal(first, kept)


def test_token_dimension_other_than_zero_is_padded_and_sliced():
    class Seq(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):  # x: [1, T, 8]
            return torch.ops.devgraph.rms_norm(self.lin(x), torch.ones(8), 1e-6).cumsum(1)

    model = Seq().requires_grad_(False)
    graphed = devgraph.wrap(model, device="cpu", mode="piecewise", capture_sizes=[4, 8], batch_dims={"x": 1})
    x = torch.randn(1, 5, 8)
    got = graphed(x)
    assert got.shape == (1, 5, 8) and graphed.stats.replays == 1
    torch.testing.assert_close(got, model(x))


class Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, scale: float = 2.0):
        return torch.ops.devgraph.rms_norm(self.lin(x), torch.ones(8), 1e-6) * scale


def test_call_that_differs_from_the_traced_one_falls_back_with_a_warning():
    model = Scaled().requires_grad_(False)
    graphed = _wrap(model, frontend="raw", capture_sizes=[4])
    x = _x(3)
    torch.testing.assert_close(graphed(x), model(x))
    with pytest.warns(UserWarning, match="signature_mismatch"):
        got = graphed(x, scale=3.0)
    torch.testing.assert_close(got, model(x, scale=3.0))
    assert graphed.stats.fallbacks == {"signature_mismatch": 1}
    # With Dynamo in front its guard on ``scale`` fails instead: a trace of its own, replayed.
    traced = _wrap(model, capture_sizes=[4])
    torch.testing.assert_close(traced(x), model(x))
    torch.testing.assert_close(traced(x, scale=3.0), model(x, scale=3.0))
    assert traced.stats.fallbacks == {} and traced.stats.traces == 2 and traced.stats.replays == 2


def test_reset_then_capture_builds_again():
    _, graphed = _toy(frontend="raw")
    graphed.runner.reset()
    assert graphed.runner.pieces.module is None
    graphed.capture(_x(2))
    assert graphed.runner.pieces.module is not None and graphed.stats.captured_sizes == (2, 4, 8)


class HostScaled(torch.nn.Module):
    """Scales row i by the host value factors[i] through a custom op taking an int[]."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, factors):
        return self.lin(torch.ops.devgraph_test.scale_rows(torch.tanh(x), factors))


def test_host_lists_reach_splitting_ops_with_each_calls_values():
    model = HostScaled().requires_grad_(False)
    options = dict(
        capture_sizes=[4],
        host_args=["factors"],
        pad_values={"factors": 0},
        splitting_ops=["devgraph_test::scale_rows"],
    )
    graphed = _wrap(model, frontend="raw", **options)
    for factors in ([1, 2, 3], [5, 0, 7]):
        x = _x(3)
        torch.testing.assert_close(graphed(x, factors), model(x, factors))
    assert graphed.stats.replays == 2
    # Through Dynamo a host list is a constant of its graph: host_args is refused there.
    with pytest.raises(DevgraphError, match=r"host_args=.*frontend='raw'"):
        _wrap(model, **options)


def test_host_list_frozen_inside_a_captured_piece_is_a_clear_error():
    model = HostScaled().requires_grad_(False)
    graphed = _wrap(model, frontend="raw", capture_sizes=[4], host_args=["factors"])
    with pytest.raises(
        DevgraphError, match=r"host argument 'factors' reaches devgraph_test::scale_rows.*splitting_ops"
    ):
        graphed(_x(3), [1, 2, 3])


def test_graph_breaks_are_a_clear_error():
    class Breaks(torch.nn.Module):
        def forward(self, x):
            if x.sum().item() > 0:  # a host read Dynamo cannot keep in one graph
                return x + 1
            return x - 1

    graphed = _wrap(Breaks(), frontend="raw", capture_sizes=[4])
    with pytest.raises(DevgraphError, match="could not trace the model as one graph"):
        graphed(_x(3))
    # With Dynamo in front the host read runs eagerly between the graphs, counted, at every call.
    traced = _wrap(Breaks(), capture_sizes=[4])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the graph break and the fallback each say so once
        for seed in (0, 1):
            torch.testing.assert_close(traced(_x(3, seed)), Breaks()(_x(3, seed)))
    assert traced.stats.graph_breaks


def test_more_models_than_dynamos_recompile_limit_are_traced_in_one_process():
    # Dynamo gives up on a code object after recompile_limit cache entries; each trace must compile
    # a frame of its own (torch 2.11 funnelled them all through one shared wrapper frame).
    limit = 2
    with torch._dynamo.config.patch(recompile_limit=limit):
        for i in range(2 * limit + 1):
            model, graphed = _toy(capture_sizes=[2, 4])
            x = _x(3, seed=i)
            torch.testing.assert_close(graphed(x)["y"], model(x)["y"])
            assert graphed.stats.captured_sizes == (2, 4), f"model {i} was not traced and captured"


def test_devgraph_backend_works_as_a_plain_torch_compile_backend():
    model = Toy().requires_grad_(False)
    backend = DevgraphCompiler(devgraph.device("cpu"), CompileConfig(splitting_ops=["devgraph::rms_norm"]))
    x = _x(5)
    with torch.no_grad():
        got = torch.compile(model, backend=backend, fullgraph=True)(x)
    torch.testing.assert_close(got["y"], model(x)["y"])
    pieces = backend.compiled[-1].split.pieces
    assert [p.is_splitting_op for p in pieces] == [False, True, False]


def test_inference_mode_calls_are_served():
    model, graphed = _toy(capture_sizes=[4])
    with torch.inference_mode():
        got = graphed(_x(3))
        torch.testing.assert_close(got["y"], model(_x(3))["y"])
    assert graphed.stats.replays == 1


def test_strict_mode_raises_instead_of_falling_back():
    model = Toy().requires_grad_(False)
    runner = GraphRunner(
        model,
        devgraph.device("cpu"),
        RunnerConfig(strict=True),
        CompileConfig(splitting_ops=["devgraph::rms_norm"], capture_sizes=[4]),
    )
    runner(_x(2))
    with pytest.raises(DevgraphError, match="strict=True"), warnings.catch_warnings():
        runner(_x(2)[:, :4])


# -- capture all or nothing, staging of eager values, trace-time checks --------------------------


def test_a_failed_capture_leaves_nothing_half_captured(monkeypatch):
    from devgraph import CaptureError
    from devgraph.compile._pieces import PieceGraphs

    model, graphed = _toy(frontend="raw", capture_sizes=[2, 4, 8])
    real = PieceGraphs._capture
    seen = []

    def fails_at_size_2(self, args):
        seen.append(self)
        if self.state.size == 2 and self.last:  # sizes 8 and 4 and the first piece of 2 captured
            raise CaptureError("refused for the test", op="test::op", remedy="none")
        return real(self, args)

    monkeypatch.setattr(PieceGraphs, "_capture", fails_at_size_2)
    with pytest.raises(CaptureError) as info:
        graphed(_x(3))
    assert info.value.batch_size == 2 and "capture_sizes" in info.value.remedy
    runner = graphed.runner
    assert not runner.captured and runner.pieces.module is None and runner.pieces.plan is None
    assert all(not piece.entries for piece in seen)  # every graph of 8, 4 and 2 was reset
    monkeypatch.setattr(PieceGraphs, "_capture", real)
    got = graphed(_x(3))  # builds again from scratch; never "submod_0 has no graph for size 2"
    torch.testing.assert_close(got["y"], model(_x(3))["y"])
    assert graphed.stats.replays == 1


class ViewBetweenSplits(torch.nn.Module):
    """Two splitting ops with only a view between them (a piece that does no work), and a later
    piece that reads that view of the first splitting op's fresh output."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin1 = torch.nn.Linear(8, 8)
        self.lin2 = torch.nn.Linear(8, 8)
        self.w8 = torch.nn.Parameter(torch.rand(8) + 0.5)
        self.w4 = torch.nn.Parameter(torch.rand(4) + 0.5)

    def forward(self, x):
        h = torch.ops.devgraph.rms_norm(torch.tanh(self.lin1(x)), self.w8, 1e-6)
        v = h.view(-1, 2, 4)
        g = torch.ops.devgraph.rms_norm(v, self.w4, 1e-6)
        return self.lin2(g.reshape(-1, 8)) + v.reshape(-1, 8)


@pytest.mark.parametrize("frontend", ["dynamo", "raw"])
def test_a_view_of_an_eager_output_read_by_a_later_piece_is_held_strongly(frontend):
    import gc

    import devgraph.ops  # noqa: F401  (registers devgraph::rms_norm)

    model = ViewBetweenSplits().requires_grad_(False)
    graphed = _wrap(model, frontend=frontend, splitting_ops=["devgraph::rms_norm"], capture_sizes=[4, 8])
    for n, seed in [(3, 0), (8, 1), (4, 2), (5, 3)]:
        got = graphed(_x(n, seed))
        gc.collect()
        [torch.full((64,), 7.0) for _ in range(64)]  # churn: reuse any memory that was freed
        torch.testing.assert_close(got, model(_x(n, seed)))
    runner = _runner(graphed)
    assert [p.does_work for p in runner.pieces.traced.compiled.split.pieces if not p.is_splitting_op] == [
        True,
        False,
        True,
    ]
    last = runner.pieces.module.piece_graphs[-1]
    staged = {b.untyped_storage().data_ptr() for b in last.staging.values()}
    owned = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *runner.inputs.buffers.values()]}
    for entry in last.entries.values():
        for _, kept, _ in entry.tensors:
            ptr = kept.untyped_storage().data_ptr()
            # Pool memory (weak), the runner's or the model's own tensors, or the piece's staging
            # buffer: never a weak view of an eager output nothing keeps alive.
            assert block_of(kept) is not None or ptr in owned or ptr in staged
    assert staged and runner.pieces.module.input_copies > 0


class LaterAttention(torch.nn.Module):
    """Attention calls (splitting ops) whose outputs are combined after a later one has run.

    ``cat``: DiffLlama's layer (issue 48: logits tenths off in piecewise mode, no warning): the first
    output is transposed in the piece between the two calls, that view is joined to the second by
    ``cat``. ``add3``: three calls, summed. ``read_late``: the first output is read by another op
    after the second call. ``untouched``: the first output reaches the last piece without a view.
    """

    def __init__(self, combine: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.combine = combine
        self.q, self.k = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
        self.v = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))
        self.o = torch.nn.Linear(32, 16)

    def forward(self, x):  # x: [T, 16], two heads of 8
        def heads(t):
            return t.view(t.shape[0], 2, 8).transpose(0, 1)

        def attend(v):  # causal: a real row never reads a padding row
            return torch.nn.functional.scaled_dot_product_attention(
                heads(self.q(x)), heads(self.k(x)), heads(v(x)), is_causal=True
            )

        n = x.shape[0]
        if self.combine == "untouched":
            first = attend(self.v[0])
            second = attend(self.v[1])
            return (first - second).transpose(0, 1).reshape(n, 16)
        first = attend(self.v[0]).transpose(0, 1)  # a view of the eager output, in the piece between
        second = attend(self.v[1]).transpose(0, 1)
        if self.combine == "cat":
            return self.o(torch.cat([first, second], -1).reshape(n, 32))
        if self.combine == "add3":
            return (first + second + attend(self.v[2]).transpose(0, 1)).reshape(n, 16)
        return (second * 2).reshape(n, 16) - first.reshape(n, 16).sin()  # read_late


_COMBINES = ["cat", "add3", "read_late", "untouched"]


def _later(combine: str, frontend: str = "dynamo"):
    model = LaterAttention(combine).requires_grad_(False)
    return model, _wrap(
        model,
        frontend=frontend,
        splitting_ops=["aten::scaled_dot_product_attention"],
        capture_sizes=[4, 8],
        debug=False,  # debug mode copies every input that moved, which hid the stale one
    )


@pytest.fixture(scope="module", params=[(c, f) for f in ("dynamo", "raw") for c in _COMBINES], ids=str)
def later_attention(request):
    return _later(*request.param)


def _x16(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 16, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n", [8, 4, 5, 3], ids=["largest", "smaller", "padded_to_8", "padded_to_4"])
def test_attention_outputs_combined_after_a_later_attention_equal_eager(later_attention, n):
    model, graphed = later_attention
    for seed in (n, n + 100):  # a second call: a value frozen at capture cannot pass twice
        got, want = graphed(_x16(n, seed)), model(_x16(n, seed))
        if n in (4, 8):  # a capture size: bit for bit
            assert torch.equal(got, want)
        else:  # padded: eager on the call's own rows may round the projections differently
            torch.testing.assert_close(got, want)
    assert graphed.stats.fallbacks == {} and graphed.stats.eager_calls == 0


def test_every_staged_piece_input_is_copied_at_every_replay(later_attention):
    # A piece reads an input it staged only from its staging buffer: a staged input that a replay
    # does not copy into (DiffLlama's first attention output once was) is read stale, silently.
    _, graphed = later_attention
    graphed(_x16(5, 0))
    module = _runner(graphed).pieces.module
    for piece in module.piece_graphs:
        staged = {b.untyped_storage().data_ptr() for b in piece.staging.values()}
        for size, entry in piece.entries.items():
            moving = {i for i, _, _ in entry.moving}
            for i, kept, _ in entry.tensors:
                if kept.untyped_storage().data_ptr() in staged:
                    assert i in moving, f"{piece.piece.name} input {i} (size {size}) is staged, never copied"


@pytest.mark.parametrize("frontend", ["dynamo", "raw"])
def test_a_later_piece_reads_an_earlier_pieces_view_of_attention_where_that_piece_leaves_it(frontend):
    # DiffLlama's shape: the piece between the two attention calls returns a view of its staged input
    # (the first attention output, transposed); the last piece reads that view in place, not a copy
    # of it made once at capture.
    _, graphed = _later("cat", frontend)
    graphed(_x16(8, 0))
    between, last = _runner(graphed).pieces.module.piece_graphs[1:]
    (buffer,) = between.staging.values()
    (second,) = last.staging.values()  # the second attention output only
    for entry in last.entries.values():
        storages = {kept.untyped_storage().data_ptr() for _, kept, _ in entry.tensors}
        assert buffer.untyped_storage().data_ptr() in storages
        assert second.untyped_storage().data_ptr() in storages


@pytest.mark.parametrize("frontend", ["dynamo", "raw"])
def test_eager_outputs_are_staged_in_one_buffer_per_argument_for_all_sizes(frontend):
    _, graphed = _toy(frontend=frontend, capture_sizes=[2, 4, 8])
    graphed(_x(3))
    last = _runner(graphed).pieces.module.piece_graphs[-1]
    assert len(last.staging) == 1
    (index, buffer), *_ = last.staging.items()
    assert buffer.numel() == 8 * 8  # the largest size's rms_norm output
    # Every size's capture read that one buffer (not a capture-time output of its own per size).
    held = [t for e in last.entries.values() for i, t, _ in e.tensors if i == index]
    assert [t.shape[0] for t in held] == [8, 4, 2]
    assert {t.untyped_storage().data_ptr() for t in held} == {buffer.untyped_storage().data_ptr()}


def test_an_output_flattened_over_tokens_is_a_clear_error():
    class Flat(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.ops.devgraph.rms_norm(self.lin(x), torch.ones(8), 1e-6).reshape(-1)

    graphed = _wrap(Flat().requires_grad_(False), frontend="raw", capture_sizes=[4])
    with pytest.raises(DevgraphError, match=r"output 0 .*depends on the token count without being it"):
        graphed(_x(3))
    assert not graphed.runner.captured
    traced = _wrap(Flat().requires_grad_(False), capture_sizes=[4])  # Dynamo's graph refused alike
    with pytest.raises(DevgraphError, match=r"output 0 .*depends on the token count without being it"):
        traced(_x(3))


def test_a_call_of_zero_tokens_falls_back_as_an_empty_batch():
    _, graphed = _toy(capture_sizes=[4])
    graphed(_x(2))
    with pytest.warns(UserWarning, match="empty_batch"):
        got = graphed(_x(0))
    assert got["y"].shape == (0, 8)
    assert graphed.stats.fallbacks == {"empty_batch": 1}


def test_the_capture_stream_waits_for_the_padding_fill_before_each_warm_up(monkeypatch):
    from devgraph.compile._pieces import PiecewiseModule

    stream_type = type(devgraph.device("cpu").stream())
    events = []
    real_wait, real_call = stream_type.wait_stream, PiecewiseModule.__call__

    def wait_stream(self, other):
        events.append("wait")
        return real_wait(self, other)

    def call(self, *inputs, host=None):
        events.append("warm")
        return real_call(self, *inputs, host=host)

    monkeypatch.setattr(stream_type, "wait_stream", wait_stream)
    monkeypatch.setattr(PiecewiseModule, "__call__", call)
    _, graphed = _toy(capture_sizes=[2, 4, 8])
    graphed.capture(_x(2))
    firsts = [i for i, e in enumerate(events) if e == "warm" and (i == 0 or events[i - 1] != "warm")]
    assert len(firsts) >= 3 and all(events[i - 1] == "wait" for i in firsts[-3:])
