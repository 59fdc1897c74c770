"""The per-call hot path: what it skips, and that skipping never changes a result.

Padding rows are refilled only where an earlier call left data; a call shape binds in full once;
a graph whose tasks need no re-issue (CUDA) records host values without per-task work; piecewise
pieces check the addresses of inputs that cannot move only in debug mode; ``full_and_piecewise``
binds a call once.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

import devgraph
import devgraph.ops as ops
from devgraph import DevgraphError
from devgraph.backends.cpu._device import CpuDevice, CpuGraph
from devgraph.backends.cuda._device import DeviceMetadataGraph
from devgraph.runner._calls import CallReader
from devgraph.runner._config import RunnerConfig

OP = "devgraph::paged_decode_attention"


def _raw(model, **options):
    """``devgraph.wrap(model, frontend="raw", ...)``: the test's subject is the raw path's own
    mechanism (its one warning of what it leaves unchecked is expected, not counted)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*captures the forward as it runs, untraced")
        return devgraph.wrap(model, frontend="raw", **options)


# -- padding ---------------------------------------------------------------------------------------


class SlotWriter(torch.nn.Module):
    """Writes each row's value into a static cache at the row's slot (padded rows: slot 0, scratch)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(16))

    def forward(self, x: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        self.cache.index_copy_(0, slot, x)
        return x * 2


def _slot_writer(frontend=None):
    model = SlotWriter()
    if frontend == "raw":
        return model, _raw(model, device="cpu", batch_sizes=[4])
    return model, devgraph.wrap(model, device="cpu", batch_sizes=[4])


def test_padding_rows_an_earlier_call_used_are_refilled():
    model, graphed = _slot_writer()
    graphed(torch.tensor([10.0, 20.0, 30.0, 40.0]), torch.tensor([1, 2, 3, 4]))
    model.cache.zero_()
    graphed(torch.tensor([50.0, 60.0, 70.0]), torch.tensor([5, 6, 7]))
    # Row 3 is padding now: it writes the scratch slot 0, not the previous call's slot 4 with 40.
    assert model.cache.tolist() == [0, 0, 0, 0, 0, 50, 60, 70] + [0] * 8


def test_padding_rows_still_padded_are_not_filled_again():
    _model, graphed = _slot_writer("raw")  # the raw runner's own input buffers
    x, slot = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1, 2, 3])
    graphed(x, slot)
    buffers = graphed.runner.inputs.buffers
    before = {name: buf._version for name, buf in buffers.items()}
    graphed(x, slot)  # the same 3 rows of bucket 4: row 3 still holds padding
    assert {name: buf._version - before[name] for name, buf in buffers.items()} == {
        "x": 1,
        "slot": 1,
    }  # copies only
    graphed(torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([1, 2, 3, 4]))
    before = {name: buf._version for name, buf in buffers.items()}
    graphed(x, slot)  # row 3 held data: copy and fill
    assert {name: buf._version - before[name] for name, buf in buffers.items()} == {"x": 2, "slot": 2}


class InputScaler(torch.nn.Module):
    """Scales its input in place (so replay writes the runner's buffer), then stores it at the slots."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(8))

    def forward(self, x: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        self.cache.index_copy_(0, slot, x)
        return x + 0


def test_padding_of_an_input_the_model_writes_is_refilled_every_call():
    model = InputScaler()
    graphed = _raw(model, device="cpu", batch_sizes=[4], pad_values={"x": 1.0})  # its runner's buffers
    x, slot = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1, 2, 3])
    for _ in range(3):
        graphed(x.clone(), slot)
        # The padded row was refilled with 1.0 before each replay doubled it; left alone it would
        # read 2, 4, 8 at the scratch slot.
        assert model.cache[0].item() == 2.0
    assert "x" in graphed.runner.inputs.written_by_model


_BUMP = torch.library.Library("devgraph_test_hot_path", "DEF")
_BUMP.define("bump_(Tensor(a!) x) -> ()")
# The kernel writes memory behind autograd's back (``.data``), as a C++/CUDA extension kernel
# does: the schema says the op writes ``x``, but ``x``'s version counter does not move.


def _bump(x: torch.Tensor) -> None:
    x.data.add_(1)


_BUMP.impl("bump_", _bump, "CPU")


class BumpsInputDirectly(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.ops.devgraph_test_hot_path.bump_(x)
        return x * 1


def test_padding_of_an_input_written_without_a_version_bump_is_refilled_every_call():
    graphed = _raw(BumpsInputDirectly(), device="cpu", batch_sizes=[4])  # its runner's buffers
    padded_row = []
    for _ in range(3):
        assert graphed(torch.tensor([1.0, 2.0, 3.0])).tolist() == [2.0, 3.0, 4.0]
        padded_row.append(graphed.runner.inputs.buffers["x"][3].item())
    # The padded row holds padding (0) bumped once by each replay, not the previous replay's write
    # bumped again (1, 2, 3). (Rows are independent here: a model that reduces over the batch would
    # be served eagerly for padded sizes, see test_wrap_promise.py.)
    assert padded_row == [1.0, 1.0, 1.0]
    assert "x" in graphed.runner.inputs.written_by_model


# -- reading a call: the remembered binding gives what a full bind gives ----------------------------


def _many(x, scale=2.0, *rest, mode="a", **extra):
    return x


def _plain(x, y, lens, flag=True):
    return x


CALLS = [
    (_plain, (torch.ones(2, 3), torch.ones(2)), {"lens": [1, 2]}),
    (_plain, (torch.ones(2, 3),), {"y": torch.ones(2), "lens": [1, 2], "flag": False}),
    (_plain, (), {"lens": [1, 2], "y": torch.ones(2), "x": torch.ones(2, 3)}),
    (_many, (torch.ones(2, 3),), {}),
    (_many, (torch.ones(2, 3), 3.0, torch.ones(2), torch.zeros(2)), {"mode": "b", "extra_t": torch.ones(2)}),
    (_many, (torch.ones(2, 3),), {"extra_a": 1, "scale": 4.0, "extra_b": (1, 2)}),
]


@pytest.mark.parametrize("fn, args, kwargs", CALLS)
def test_remembered_binding_reads_calls_as_a_full_bind_does(fn, args, kwargs):
    signature = inspect.signature(fn)
    config = RunnerConfig(host_args=["lens"] if fn is _plain else ())
    reader = CallReader(signature, config)
    first = reader.read(args, kwargs)  # binds in full and remembers the shape
    assert reader._shapes[(len(args), tuple(kwargs))] is not None, "this shape should be remembered"
    fast = reader.read(args, kwargs)
    for field in ("batch", "order", "host", "consts"):
        assert getattr(fast, field) == getattr(first, field), field
    for field in ("batched", "static"):
        assert list(getattr(fast, field)) == list(getattr(first, field))
        assert all(a is b for a, b in zip(getattr(fast, field).values(), getattr(first, field).values()))
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    assert reader.arguments(fast).keys() == bound.arguments.keys()
    for name, value in bound.arguments.items():
        got = reader.arguments(fast)[name]
        assert got is value or got == value, name


def test_a_call_that_does_not_bind_is_refused_on_every_call():
    reader = CallReader(inspect.signature(_plain), RunnerConfig())
    for _ in range(2):
        with pytest.raises(Exception, match="do not match the signature"):
            reader.read((torch.ones(2),), {"nope": 1})
    assert not any(reader._shapes.values())


def test_remembered_binding_serves_graphed_calls_with_other_values():
    class Model(torch.nn.Module):
        def forward(self, x, y, scale=1.0):
            return x * scale + y

    graphed = _raw(Model(), device="cpu", batch_sizes=[2, 4])  # the raw runner's remembered binding
    for rows in (3, 1, 4, 2):
        x, y = torch.randn(rows, 5), torch.randn(rows, 5)
        torch.testing.assert_close(graphed(x, y=y), x + y)
        torch.testing.assert_close(graphed(x, y, scale=1.0), x + y)  # the default, spelled out
    assert graphed.stats.eager_calls == 0
    with pytest.warns(UserWarning, match="signature_mismatch"):
        out = graphed(torch.ones(2, 5), torch.ones(2, 5), scale=3.0)  # another constant: eager, correct
    torch.testing.assert_close(out, torch.full((2, 5), 4.0))
    assert graphed.stats.fallbacks == {"signature_mismatch": 1}


# -- task updates with nothing to re-issue (the CUDA path) -------------------------------------------


class _DeviceReadsLengths(DeviceMetadataGraph, CpuGraph):
    """A CPU graph declaring what CUDA declares: its updatable op reads lengths from device memory
    (CUDA's ``replay(host_args)`` hook, ``DeviceMetadataGraph``)."""

    def _needs_reissue(self, group) -> bool:
        return False


class DeviceReadsLengths(CpuDevice):
    def graph(self, keep_graph: bool = False):
        return _DeviceReadsLengths(self, keep_graph)


def _attention_graph(dev, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 8, generator=g).to(dtype)
    k = torch.randn(8, 16, 2, 8, generator=g).to(dtype)
    v = torch.randn(8, 16, 2, 8, generator=g).to(dtype)
    table = torch.arange(1, 5, dtype=torch.int32).view(2, 2)
    seq = torch.tensor([5, 9], dtype=torch.int32)
    graph = dev.graph()
    with graph.capture(auto_update_ops=[OP]):
        for _ in range(3):  # three "layers", three tasks
            ops.paged_decode_attention(q, k, v, table, seq, [5, 9])
    graph.test_inputs = (q, k, v, table, seq)  # tasks hold their tensors weakly: keep them alive
    return graph


class _Counter:
    def __init__(self, monkeypatch, module, name):
        self.calls = 0
        real = getattr(module, name)

        def counting(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, counting)


def test_replay_does_no_per_task_work_when_no_task_needs_a_reissue(monkeypatch):
    import devgraph.graph._contract as contract

    graph = _attention_graph(DeviceReadsLengths())
    per_task = _Counter(monkeypatch, contract, "apply_host_args")
    for n in range(5):
        graph.replay(host_args={"seq_lens_host": [6 + n, 2]})
    assert per_task.calls == 0
    assert [t.host_args["seq_lens_host"] for t in graph.tasks] == [[10, 2]] * 3  # recorded when read
    with pytest.raises(DevgraphError, match="no updatable task takes host argument"):
        graph.replay(host_args={"lengths": [1, 2]})


def test_update_after_noted_replays_keeps_the_latest_values():
    graph = _attention_graph(DeviceReadsLengths())
    graph.replay(host_args={"seq_lens_host": [7, 7]})
    graph.update({"seq_lens_host": [8, 8]})
    assert [t.host_args["seq_lens_host"] for t in graph.tasks] == [[8, 8]] * 3
    graph.reset()
    assert graph.tasks == ()


def _reissues_every_task_at_every_replay(graph, monkeypatch, hook="_task_update_begin", owner=None):
    reissued = _Counter(monkeypatch, type(graph) if owner is None else owner, hook)
    for n in range(2):
        graph.replay(host_args={"seq_lens_host": [6 + n, 2]})
    assert reissued.calls == 2 * 3


def test_the_reference_backend_reissues_every_task_at_every_replay(monkeypatch):
    _reissues_every_task_at_every_replay(_attention_graph(devgraph.device("cpu")), monkeypatch)


def test_the_npu_simulator_reissues_every_task_at_every_replay(monkeypatch):
    from devgraph_sim.npu import simulated_torch_npu

    with simulated_torch_npu() as torch_npu:
        graph = _attention_graph(devgraph.device("npu"), torch.bfloat16)
        # its own update path: one torch_npu task update per task
        _reissues_every_task_at_every_replay(graph, monkeypatch, "graph_task_update_begin", torch_npu.npu)


# -- piecewise: address checks of inputs that cannot move, in debug mode only -------------------------


def _piecewise(debug):
    from devgraph.testing.models import DecoderConfig, KVBlockManager, make_decoder

    config = DecoderConfig(num_layers=2)
    model = make_decoder(config)
    graphed = devgraph.wrap(model, device="cpu", mode="piecewise", capture_sizes=[2, 4], debug=debug)
    manager = KVBlockManager(config)
    batch = manager.decode_batch([0, 1], [3, 4])
    graphed(**batch)
    return model, graphed, batch


def test_debug_mode_checks_every_piece_input_and_names_a_moved_weight():
    model, graphed, batch = _piecewise(debug=True)
    module = graphed.runner.pieces.module
    entries = [e for r in module.piece_graphs for e in r.entries.values()]
    assert any(len(e.moving) < len(e.tensors) for e in entries)  # some inputs cannot move...
    model.lm_head.weight.data = model.lm_head.weight.data.clone()
    with pytest.raises(DevgraphError, match=r"parameter .lm_head.weight.*capture"):
        graphed(**batch)  # ...and debug mode still finds the one that did


def test_pieces_check_only_inputs_that_may_move_outside_debug_mode():
    _, graphed, _batch = _piecewise(debug=False)
    module = graphed.runner.pieces.module
    # Moving a piece's stable input (a runner buffer) is not looked for outside debug mode...
    (runner,) = [r for r in module.piece_graphs if r.entries][:1]
    entry = runner.entries[2]
    stable = [i for i, _, _ in entry.tensors if all(i != j for j, _, _ in entry.moving)]
    assert stable
    inputs = graphed.runner.pieces._replay_inputs[2]
    before = module.input_copies
    module.replay(inputs, 2, graphed.runner.inputs.padded_host_args({}, 2))
    assert module.input_copies == before
    # ...and in debug mode the same replay checks it: a moved one is copied into place.
    moved = list(inputs)
    moved_index = next(k for k, x in enumerate(inputs) if isinstance(x, torch.Tensor) and x.dim() >= 1)
    moved[moved_index] = inputs[moved_index].clone()
    module.replay(moved, 2, graphed.runner.inputs.padded_host_args({}, 2), debug=True)
    assert module.input_copies > before


# -- full_and_piecewise: one bind per call ----------------------------------------------------------


def test_full_and_piecewise_binds_a_call_shape_once(monkeypatch):
    from devgraph.testing.models import DecoderConfig, KVBlockManager, make_decoder

    config = DecoderConfig(num_layers=1)
    graphed = devgraph.wrap(
        make_decoder(config),
        device="cpu",
        mode="full_and_piecewise",
        batch_sizes=[1, 2],
        capture_sizes=[4],
        is_decode=lambda block_table, **_: True,
    )
    manager = KVBlockManager(config)
    graphed(**manager.decode_batch([0, 1], [3, 4]))  # captures both kinds
    binds = _Counter(monkeypatch, inspect.Signature, "bind")
    for step in range(3):
        graphed(**manager.decode_batch([0, 1], [5 + step, 6]))
    assert binds.calls == 0
    assert graphed.stats.full.replays == 4
