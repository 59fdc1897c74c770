"""Task-update ordering of the NPU backend, on the asynchronous torch_npu simulator.

The simulator runs in ``streams="lazy"`` mode: a stream runs only when the host synchronises or
another stream waits on it, and on a device sync the side stream runs first. So every ordering
step of ``NpuGraph`` matters: without the update stream's fence a rewrite overtakes an earlier
replay (wrong result); without an event record the replay hangs (``SimulatedHang``) or runs the
old task (wrong result). ``test_removing_an_ordering_step_is_caught`` removes each step in turn.
"""

from __future__ import annotations

import contextvars
import threading
import time

import pytest
import torch
from _npu_sim_graphs import doubling_graph

import devgraph
import devgraph.ops as ops
from devgraph import DevgraphError
from devgraph.backends import _reference
from devgraph.backends.npu._device import NpuGraph
from devgraph_sim.npu import simulated_torch_npu
from devgraph_sim.npu._streams import SimulatedHang

OP = "devgraph::paged_decode_attention"
SCALE = 0.5
DTYPE = torch.bfloat16  # npu_fused_infer_attention_score takes float16/bfloat16/int8 queries
BLOCK = 16  # page attention: block_size a multiple of 16 for float16/bfloat16 caches
LAYERS = 2
CAPTURED, FIRST, SECOND = [5, 9], [30, 3], [1, 17]


def _device(streams: str, order: str):
    with simulated_torch_npu(streams=streams, hang_timeout=0.2):
        device = devgraph.device("npu")
        device.update_order = order
        yield device


@pytest.fixture(params=["overlap", "serial"])
def lazy(request):
    yield from _device("lazy", request.param)


@pytest.fixture(params=["overlap", "serial"])
def eager(request):
    yield from _device("eager", request.param)


class Decoder:
    """LAYERS attention calls captured in one graph; the graph adds each output into ``acc``.

    ``acc`` lives outside the graph, so it sums every replay: it shows which lengths each replay
    used even when replays are queued back to back without a sync in between.
    """

    def __init__(self, device) -> None:
        g = torch.Generator().manual_seed(0)
        batch, heads, kv_heads, dim, blocks = 2, 4, 2, 16, 8
        self.q = [torch.randn(batch, heads, dim, generator=g).to(DTYPE) for _ in range(LAYERS)]
        self.k = torch.randn(blocks, BLOCK, kv_heads, dim, generator=g).to(DTYPE)
        self.v = torch.randn(blocks, BLOCK, kv_heads, dim, generator=g).to(DTYPE)
        self.table = torch.randperm(blocks, generator=g)[: batch * 2].view(batch, 2).to(torch.int32)
        self.out = [torch.empty_like(q) for q in self.q]
        self.acc = torch.zeros(batch, heads, dim)
        seq = torch.tensor(CAPTURED, dtype=torch.int32)
        self.graph = device.graph()
        with self.graph.capture(auto_update_ops=[OP]):
            for q, out in zip(self.q, self.out):
                ops.paged_decode_attention(q, self.k, self.v, self.table, seq, CAPTURED, SCALE, out)
                self.acc.add_(out.float())
        device.synchronize()
        self.acc.zero_()  # the simulator runs the work once while capturing

    def expected(self, *lens) -> torch.Tensor:
        """What one replay adds to ``acc`` with ``lens`` (one list for every layer, or one per layer)."""
        total = torch.zeros_like(self.acc)
        per_layer = lens * LAYERS if len(lens) == 1 else lens
        for q, layer_lens in zip(self.q, per_layer):
            out = torch.empty_like(q, dtype=torch.float32)
            k, v = self.k.float(), self.v.float()
            _reference.paged_decode_attention_host_lens(q.float(), k, v, self.table, layer_lens, SCALE, out)
            total += out
        return total


def _close(got, want):
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


# -- the simulator's streams ----------------------------------------------------------------------


def test_lazy_stream_runs_only_when_the_host_synchronises():
    with simulated_torch_npu(streams="lazy") as sim:
        graph, _x, y = doubling_graph(sim.npu)
        graph.replay()
        torch.testing.assert_close(y, torch.full((3,), 2.0))  # queued, not run
        assert not sim.npu.current_stream().query()
        sim.npu.synchronize()
        torch.testing.assert_close(y, torch.full((3,), 10.0))


def test_event_completes_when_its_stream_reaches_it():
    with simulated_torch_npu(streams="lazy") as sim:
        npu = sim.npu
        graph, _x, y = doubling_graph(npu)
        side = npu.Stream()
        with npu.stream(side):
            graph.replay()
            event = side.record_event()
        assert not event.query()
        event.synchronize()
        assert event.query()
        torch.testing.assert_close(y, torch.full((3,), 10.0))


def test_a_stream_waiting_on_another_makes_it_run():
    with simulated_torch_npu(streams="lazy") as sim:
        npu = sim.npu
        graph, _x, y = doubling_graph(npu)
        producer, consumer = npu.Stream(), npu.Stream()
        with npu.stream(producer):
            graph.replay()
        consumer.wait_stream(producer)
        consumer.synchronize()  # only the consumer is synchronised; its wait runs the producer
        torch.testing.assert_close(y, torch.full((3,), 10.0))


def test_an_unordered_side_stream_overtakes_on_a_device_sync():
    # Lazy mode's worst case: of two streams with no wait between them, the one whose pending work
    # is newest runs first, so a missing dependency shows.
    with simulated_torch_npu(streams="lazy") as sim:
        npu = sim.npu
        graph_a, _x_a, y_a = doubling_graph(npu)
        x = torch.ones(3)
        graph_b = npu.NPUGraph()
        with npu.graph(graph_b):
            y_a.add_(x)  # reads what graph_a writes: needs graph_a to run first
        with npu.stream(npu.Stream()):
            graph_a.replay()
        with npu.stream(npu.Stream()):
            graph_b.replay()  # no wait on graph_a's stream
        npu.synchronize()
        torch.testing.assert_close(y_a, torch.full((3,), 10.0))  # graph_b ran first, then graph_a


# -- the scenarios (each one needs particular ordering steps) -----------------------------------


def back_to_back_replays(device) -> None:
    """Two replays with different lengths, no sync between: each runs with its own lengths."""
    model = Decoder(device)
    model.graph.replay(host_args={"seq_lens_host": FIRST})
    model.graph.replay(host_args={"seq_lens_host": SECOND})
    device.synchronize()
    _close(model.acc, model.expected(FIRST) + model.expected(SECOND))


def replay_with_new_lengths(device) -> None:
    model = Decoder(device)
    model.graph.replay(host_args={"seq_lens_host": FIRST})
    device.synchronize()
    _close(model.acc, model.expected(FIRST))


def replay_without_update(device) -> None:
    """Tasks nobody updated replay with the arguments they hold (and do not hang)."""
    model = Decoder(device)
    model.graph.replay()
    model.graph.replay()
    device.synchronize()
    _close(model.acc, 2 * model.expected(CAPTURED))


def replay_updating_one_task(device) -> None:
    """Per-task host arguments: layer 0 gets new lengths, layer 1 keeps its own."""
    model = Decoder(device)
    model.graph.replay(host_args=[{"seq_lens_host": FIRST}, {}])
    device.synchronize()
    _close(model.acc, model.expected(FIRST, CAPTURED))


def update_then_replay_with_other_lengths(device) -> None:
    """update() records the tasks' events; a replay(host_args) re-updating them must not overlap."""
    model = Decoder(device)
    model.graph.update({"seq_lens_host": FIRST})
    model.graph.replay(host_args={"seq_lens_host": SECOND})
    device.synchronize()
    _close(model.acc, model.expected(SECOND))


SCENARIOS = [
    update_then_replay_with_other_lengths,
    back_to_back_replays,
    replay_with_new_lengths,
    replay_without_update,
    replay_updating_one_task,
]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__)
def test_update_orders_are_correct_on_lazy_streams(lazy, scenario):
    scenario(lazy)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__)
def test_update_orders_are_correct_on_eager_streams(eager, scenario):
    scenario(eager)


#: Each ordering step of NpuGraph, and the scenario that fails without it.
STEPS = {
    "_fence_update_stream": back_to_back_replays,
    "_release_updated": replay_with_new_lengths,
    "_release_stale": replay_without_update,
}


@pytest.mark.parametrize("step", list(STEPS))
def test_removing_an_ordering_step_is_caught(lazy, monkeypatch, step):
    monkeypatch.setattr(NpuGraph, step, lambda self, *args, **kwargs: None)
    with pytest.raises((AssertionError, SimulatedHang)):
        STEPS[step](lazy)


def test_recording_the_event_without_marking_the_task_released_is_caught(monkeypatch):
    # Half of _release_updated (serial order): the stale-release before the next replay then records
    # the event on the replay's stream, ahead of the rewrite queued on the update stream.
    monkeypatch.setattr(
        NpuGraph, "_release_updated", lambda self, group, stream: group.handle[1].record(stream)
    )
    for device in _device("lazy", "serial"):
        with pytest.raises(AssertionError):
            replay_with_new_lengths(device)


# -- the overlapped order --------------------------------------------------------------------------


def test_overlapped_order_queues_the_replay_before_updating(monkeypatch):
    with simulated_torch_npu(streams="lazy") as sim:
        device = devgraph.device("npu")
        model = Decoder(device)
        calls = []
        for name in ("graph_task_update_begin",):
            real = getattr(sim.npu, name)
            monkeypatch.setattr(
                sim.npu, name, lambda *a, _real=real, _n=name: (calls.append(_n), _real(*a))[1]
            )
        real_replay = sim.npu.NPUGraph.replay
        monkeypatch.setattr(
            sim.npu.NPUGraph, "replay", lambda self: (calls.append("replay"), real_replay(self))[1]
        )
        model.graph.replay(host_args={"seq_lens_host": FIRST})
        assert calls == ["replay"] + ["graph_task_update_begin"] * LAYERS
        device.synchronize()
        _close(model.acc, model.expected(FIRST))


def test_overlapped_replay_blocks_until_each_task_is_updated():
    # Eager streams run as far as they can: the replay must stop at layer 0's event until the
    # update stream records it, then run layer by layer as the updates come.
    with simulated_torch_npu(streams="eager", hang_timeout=0.2) as sim:
        device = devgraph.device("npu")
        model = Decoder(device)
        stops = []
        real = sim.npu.graph_task_update_begin

        def spy(stream, handle):
            stops.append(model.acc.clone())  # what the replay in flight has added so far
            return real(stream, handle)

        sim.npu.graph_task_update_begin = spy
        model.graph.replay(host_args={"seq_lens_host": FIRST})
        assert [float(s.abs().sum()) for s in stops] == [0.0, pytest.approx(float(stops[1].abs().sum()))]
        assert float(stops[1].abs().sum()) > 0  # layer 0 ran before layer 1 was updated
        _close(model.acc, model.expected(FIRST))


# -- update lock, nesting, failed updates ----------------------------------------------------------------


def test_updates_from_two_threads_take_turns_on_the_update_stream(eager):
    first, second = Decoder(eager), Decoder(eager)
    (group,) = first.graph.tasks[:1]
    errors = []
    started = threading.Event()

    def other():
        started.wait()
        try:
            second.graph.update({"seq_lens_host": FIRST})
        except Exception as exc:
            errors.append(exc)

    thread = threading.Thread(target=contextvars.copy_context().run, args=(other,))  # the simulator's route
    thread.start()
    with first.graph.task_update(group):
        started.set()
        time.sleep(0.2)  # the other thread reaches the update stream while this update is open
        group.call_with({"seq_lens_host": SECOND})()
    thread.join()
    assert errors == []


def test_nested_update_is_refused_not_deadlocked(eager):
    first, second = Decoder(eager), Decoder(eager)
    (group, _) = first.graph.tasks
    with pytest.raises(DevgraphError, match="task updates cannot nest"):
        with first.graph.task_update(group):
            second.graph.update({"seq_lens_host": FIRST})
    with pytest.raises(DevgraphError, match="task updates cannot nest"):
        with first.graph.task_update(group):
            second.graph.replay(host_args={"seq_lens_host": FIRST})
    first.graph.replay(host_args={"seq_lens_host": FIRST})  # the device's update stream is free again
    _close(first.acc, first.expected(FIRST))


def test_nested_task_updates_of_two_graphs_are_refused_not_deadlocked(eager):
    first, second = Decoder(eager), Decoder(eager)
    outcome = []

    def nest():
        try:
            with first.graph.task_update(first.graph.tasks[0]):
                with second.graph.task_update(second.graph.tasks[0]):
                    pass
        except DevgraphError as exc:
            outcome.append(str(exc))

    thread = threading.Thread(target=contextvars.copy_context().run, args=(nest,), daemon=True)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive(), "nested task updates deadlocked"
    assert len(outcome) == 1 and "task updates cannot nest" in outcome[0]


def test_nested_update_is_refused_before_it_waits_on_the_other_graphs_lock(eager):
    """Thread A holds the update stream (a task update of ``first``) and nests an update of ``second``
    while thread B holds ``second``'s lock and waits for the update stream: A is refused before it
    takes that lock (``NpuGraph._check_update_allowed``), else each thread waits on the other."""
    first, second = Decoder(eager), Decoder(eager)
    a_updating, b_holds = threading.Event(), threading.Event()
    outcome = []

    def a():
        with first.graph.task_update(first.graph.tasks[0]):
            a_updating.set()
            b_holds.wait(timeout=10)
            time.sleep(0.1)  # B is waiting for the update stream now
            try:
                second.graph.update({"seq_lens_host": SECOND})
            except DevgraphError as exc:
                outcome.append(str(exc))
            first.graph.tasks[0].call_with({"seq_lens_host": FIRST})()

    def b():
        a_updating.wait(timeout=10)
        with second.graph._lock:  # what update() holds while it waits for the update stream
            b_holds.set()
            second.graph.update({"seq_lens_host": FIRST})

    threads = [
        threading.Thread(target=contextvars.copy_context().run, args=(f,), daemon=True) for f in (a, b)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert not any(thread.is_alive() for thread in threads), "a nested update deadlocked"
    assert len(outcome) == 1 and "task updates cannot nest" in outcome[0]
    second.graph.replay()
    eager.synchronize()
    _close(second.acc, second.expected(FIRST))


def test_failed_update_restores_the_previous_arguments(eager):
    # Regression: update() re-issued layer 0 with the new lengths, then layer 1 failed, and the graph
    # replayed layer 0 new and layer 1 old: a silent mix of two steps.
    model = Decoder(eager)
    with pytest.raises(
        DevgraphError, match=r"task update of task 1 .* failed .* keeps its previous arguments"
    ):
        model.graph.update([{"seq_lens_host": FIRST}, {"seq_lens_host": [1]}])  # one length for batch 2
    model.acc.zero_()
    model.graph.replay()
    _close(model.acc, model.expected(CAPTURED))


def test_failed_explicit_task_update_poisons_the_graph(eager):
    # torch_npu commits what a task update re-issued; an explicit group's block that raises half way
    # leaves the group half rewritten, and devgraph cannot re-issue the rest: it must refuse to replay.
    x, y, z = torch.ones(3), torch.zeros(3), torch.zeros(3)
    graph = eager.graph()
    with graph.capture():
        with graph.task_group() as group:
            torch.mul(x, 2.0, out=y)
            torch.mul(x, 3.0, out=z)
    with pytest.raises(ValueError, match="half way"):
        with graph.task_update(group):
            torch.mul(x, 20.0, out=y)
            raise ValueError("half way")
    with pytest.raises(
        DevgraphError, match="cannot replay: the task_update\\(\\) block of explicit task group 0"
    ):
        graph.replay()
    graph.reset()
    with graph.capture():
        torch.mul(x, 4.0, out=y)
    graph.replay()  # a reset graph is usable again
    torch.testing.assert_close(y, torch.full((3,), 4.0))
