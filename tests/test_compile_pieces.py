"""Per-piece capture mechanics on the CPU reference backend, with tiny toy models."""

from __future__ import annotations

import warnings

import pytest
import torch

import devgraph
from devgraph import DevgraphError
from devgraph.backends.cpu._pool import block_of
from devgraph.compile import CompileConfig, DevgraphBackend, PiecewiseRunner
from devgraph.runner import RunnerConfig

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


def _toy(**options):
    import devgraph.ops

    model = Toy().requires_grad_(False)
    options.setdefault("capture_sizes", [2, 4, 8])
    graphed = devgraph.wrap(
        model, device="cpu", mode="piecewise", splitting_ops=["devgraph::rms_norm"], **options
    )
    return model, graphed


@pytest.fixture(scope="module")
def toy():
    return _toy()


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
    before = graphed.runner.module.input_copies
    graphed(_x(3))
    assert graphed.runner.module.input_copies == before + 1


def test_piece_outputs_are_weak_references_so_the_pool_can_reuse_them(toy):
    _, graphed = toy
    graphed(_x(4))
    module = graphed.runner.module
    outputs = [
        t
        for runner in module.runners
        for entry in runner.entries.values()
        for t in (entry.output if isinstance(entry.output, (tuple, list)) else [entry.output])
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
    graphed = devgraph.wrap(model, device="cpu", mode="piecewise", capture_sizes=[4])
    x = _x(3)
    torch.testing.assert_close(graphed(x), model(x))
    with pytest.warns(UserWarning, match="signature_mismatch"):
        got = graphed(x, scale=3.0)
    torch.testing.assert_close(got, model(x, scale=3.0))
    assert graphed.stats.fallbacks == {"signature_mismatch": 1}


def test_reset_then_capture_builds_again(toy):
    _, graphed = toy
    graphed.runner.reset()
    assert graphed.runner.module is None
    graphed.capture(_x(2))
    assert graphed.runner.module is not None and graphed.stats.captured_sizes == (2, 4, 8)


class HostScaled(torch.nn.Module):
    """Scales row i by the host value factors[i] through a custom op taking an int[]."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, factors):
        return self.lin(torch.ops.devgraph_test.scale_rows(torch.tanh(x), factors))


def test_host_lists_reach_splitting_ops_with_each_calls_values():
    model = HostScaled().requires_grad_(False)
    graphed = devgraph.wrap(
        model,
        device="cpu",
        mode="piecewise",
        capture_sizes=[4],
        host_args=["factors"],
        pad_values={"factors": 0},
        splitting_ops=["devgraph_test::scale_rows"],
    )
    for factors in ([1, 2, 3], [5, 0, 7]):
        x = _x(3)
        torch.testing.assert_close(graphed(x, factors), model(x, factors))
    assert graphed.stats.replays == 2


def test_host_list_frozen_inside_a_captured_piece_is_a_clear_error():
    model = HostScaled().requires_grad_(False)
    graphed = devgraph.wrap(model, device="cpu", mode="piecewise", capture_sizes=[4], host_args=["factors"])
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

    graphed = devgraph.wrap(Breaks(), device="cpu", mode="piecewise", capture_sizes=[4])
    with pytest.raises(DevgraphError, match="could not trace the model as one graph"):
        graphed(_x(3))


def test_devgraph_backend_works_as_a_plain_torch_compile_backend():
    model = Toy().requires_grad_(False)
    backend = DevgraphBackend(devgraph.device("cpu"), CompileConfig(splitting_ops=["devgraph::rms_norm"]))
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
    runner = PiecewiseRunner(
        model,
        devgraph.device("cpu"),
        RunnerConfig(strict=True),
        CompileConfig(splitting_ops=["devgraph::rms_norm"], capture_sizes=[4]),
    )
    runner(_x(2))
    with pytest.raises(DevgraphError, match="strict=True"), warnings.catch_warnings():
        runner(_x(2)[:, :4])
