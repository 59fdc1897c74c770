"""What one step's task update costs the host on NPU, in torch_npu calls (issue 37), and who submits it.

Counted on devgraph's torch_npu simulator, never timed: per ``replay(host_args)`` no host sync, one
entry onto the update stream, one fence, and per layer the begin / re-issue / end / event record
torch_npu needs; the lengths built once per step; an attention task re-issued from the torch_npu call
it launched (not by running the devgraph op again) unless an argument besides its lengths changes;
and task updates from two host threads never interleaving (one submitter per device: CANN fails
otherwise, sglang-omni #2160). ``benchmarks/npu_task_update.py`` measures the same against
vllm-ascend's update loop.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections import Counter

import pytest
import torch

import devgraph
import devgraph.ops as ops
from devgraph import DevgraphError
from devgraph.backends import _reference
from devgraph.backends.npu import _kernels as npu_kernels
from devgraph.backends.npu._device import NpuGraph
from devgraph.ops import _registry
from devgraph_sim.npu import _runtime as sim_runtime
from devgraph_sim.npu import simulated_torch_npu
from devgraph_sim.npu._streams import SimulatedHang

OP = "devgraph::paged_decode_attention"
SCALE = 0.5
LAYERS = 3
CAPTURED, NEW = [5, 9], [12, 3]


@pytest.fixture(params=["overlap", "serial"])
def npu(request):
    with simulated_torch_npu(hang_timeout=0.5):
        device = devgraph.device("npu")
        device.update_order = request.param
        yield device


class Layers:
    """LAYERS attention calls over one paged cache, captured in one graph (bfloat16)."""

    def __init__(self, device, layers: int = LAYERS, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        batch, heads, kv_heads, dim, block, blocks = 2, 4, 2, 8, 16, 8
        self.q = [torch.randn(batch, heads, dim, generator=g).to(torch.bfloat16) for _ in range(layers)]
        self.k = torch.randn(blocks, block, kv_heads, dim, generator=g).to(torch.bfloat16)
        self.v = torch.randn(blocks, block, kv_heads, dim, generator=g).to(torch.bfloat16)
        self.table = torch.randperm(blocks, generator=g)[: batch * 2].view(batch, 2).to(torch.int32)
        self.out = [torch.empty_like(q) for q in self.q]
        seq = torch.tensor(CAPTURED, dtype=torch.int32)
        self.graph = device.graph()
        with self.graph.capture(auto_update_ops=[OP]):
            for q, out in zip(self.q, self.out):
                ops.paged_decode_attention(q, self.k, self.v, self.table, seq, CAPTURED, SCALE, out)
        self.device = device

    def check(self, lens, scale: float = SCALE) -> None:
        """The outputs of the last replay are attention over ``lens`` with ``scale``, every layer."""
        self.device.synchronize()
        for q, out in zip(self.q, self.out):
            want = torch.empty_like(q)
            _reference.paged_decode_attention_host_lens(q, self.k, self.v, self.table, lens, scale, want)
            torch.testing.assert_close(out, want)


@contextlib.contextmanager
def counting(npu_module):
    """Count the torch_npu calls of the block (outermost only), by name."""
    counts: Counter = Counter()
    depth = [0]
    stack = contextlib.ExitStack()

    def wrap(owner, attr, name):
        real = getattr(owner, attr)

        def spy(*args, **kwargs):
            if not depth[0]:
                counts[name] += 1
            depth[0] += 1
            try:
                return real(*args, **kwargs)
            finally:
                depth[0] -= 1

        setattr(owner, attr, spy)
        stack.callback(setattr, owner, attr, real)

    for attr in ("synchronize", "stream", "graph_task_update_begin", "graph_task_update_end"):
        wrap(npu_module, attr, attr)
    for cls, attr in [("Stream", "synchronize"), ("Stream", "wait_stream"), ("Event", "synchronize"),
                      ("Event", "record"), ("ExternalEvent", "record"), ("NPUGraph", "replay")]:  # fmt: skip
        wrap(getattr(npu_module, cls), attr, f"{cls}.{attr}")
    with stack:
        yield counts


HOST_SYNCS = ("synchronize", "Stream.synchronize", "Event.synchronize")


def test_replay_with_host_args_makes_no_host_sync(npu):
    model = Layers(npu)
    with counting(npu._npu) as counts:
        for lens in (NEW, [1, 30], NEW):
            model.graph.replay(host_args={"seq_lens_host": lens})
    assert {name: counts[name] for name in HOST_SYNCS} == dict.fromkeys(HOST_SYNCS, 0)
    assert counts["NPUGraph.replay"] == 3
    model.check(NEW)


def test_one_step_is_one_update_submission(npu):
    model = Layers(npu)
    with counting(npu._npu) as counts:
        model.graph.replay(host_args={"seq_lens_host": NEW})
    assert counts == {
        "stream": 1,  # one entry onto the update stream for every layer
        "Stream.wait_stream": 1,  # one fence behind the work already queued
        "graph_task_update_begin": LAYERS,  # torch_npu: one task-group handle per begin
        "graph_task_update_end": LAYERS,
        "ExternalEvent.record": LAYERS,  # each layer released once its rewrite is in
        "NPUGraph.replay": 1,
    }
    model.check(NEW)


def test_update_alone_is_one_submission_too(npu):
    model = Layers(npu)
    with counting(npu._npu) as counts:
        model.graph.update({"seq_lens_host": NEW})
    assert counts["stream"] == 1 and counts["Stream.wait_stream"] == 1
    assert counts["graph_task_update_begin"] == counts["ExternalEvent.record"] == LAYERS
    model.graph.replay()
    model.check(NEW)


def _counting_kernel(monkeypatch) -> list[int]:
    """Count the runs of devgraph's NPU attention kernel (registered over itself, same arguments)."""
    runs: list[int] = []
    kernel = npu_kernels.paged_decode_attention

    def counted(*args, **kwargs):
        runs.append(1)
        return kernel(*args, **kwargs)

    monkeypatch.setitem(_registry._kernels, ("paged_decode_attention", "PrivateUse1"), counted)
    return runs


def test_a_lengths_update_reissues_the_captured_launch_not_the_op(npu, monkeypatch):
    model = Layers(npu)
    runs = _counting_kernel(monkeypatch)
    model.graph.replay(host_args={"seq_lens_host": NEW})
    assert runs == []
    model.check(NEW)


def test_the_lengths_are_built_once_per_step(npu, monkeypatch):
    model = Layers(npu)
    built = []
    real = npu_kernels.attention_lengths
    monkeypatch.setattr(
        npu_kernels, "attention_lengths", lambda lens, batch: built.append(1) or real(lens, batch)
    )
    model.graph.replay(host_args={"seq_lens_host": NEW})  # one list for every layer
    assert len(built) == 1
    model.check(NEW)
    built.clear()
    model.graph.replay(host_args=[{"seq_lens_host": list(NEW)} for _ in range(LAYERS)])  # one each
    assert len(built) == LAYERS
    model.check(NEW)


def test_other_arguments_reissue_the_op_and_later_lengths_updates_keep_them(npu, monkeypatch):
    # The launch a lengths update re-issues must be the one the last re-issue made: a launch kept
    # from capture would bring the captured scale back.
    model = Layers(npu)
    runs = _counting_kernel(monkeypatch)
    model.graph.replay(host_args={"seq_lens_host": NEW, "scale": 0.25})
    assert len(runs) == LAYERS
    model.check(NEW, scale=0.25)
    model.graph.replay(host_args={"seq_lens_host": [1, 30]})
    assert len(runs) == LAYERS  # the launches made with the new scale, re-issued
    model.check([1, 30], scale=0.25)


def test_an_explicit_task_update_of_an_auto_task_is_what_later_lengths_updates_reissue(npu):
    model = Layers(npu, layers=1)
    (group,) = model.graph.tasks
    with model.graph.task_update(group):
        group.call_with({"seq_lens_host": NEW, "scale": 0.25})()
    group.remember({"seq_lens_host": NEW, "scale": 0.25})
    model.graph.replay(host_args={"seq_lens_host": [1, 30]})
    model.check([1, 30], scale=0.25)


def test_wrong_lengths_are_refused_before_anything_is_queued(npu):
    model = Layers(npu)
    model.graph.replay(host_args={"seq_lens_host": NEW})
    with counting(npu._npu) as counts:
        with pytest.raises(
            DevgraphError, match=r"task update of task 0 .*B = 2 lengths.* Nothing was re-issued"
        ):
            model.graph.replay(host_args={"seq_lens_host": [7]})
    assert counts == {}
    model.graph.replay()
    model.check(NEW)


# -- one submitter per device ---------------------------------------------------------------------------


def _interleaved(log) -> list[str]:
    """Where one thread's step (the begin/end of every task of its graph, groups 0 to LAYERS - 1) was
    cut by another thread's begin or end."""
    cuts, open_thread = [], None
    for thread, what, _graph, group in log:
        if open_thread is not None and thread != open_thread:
            cuts.append(f"thread {open_thread}'s step cut by thread {thread} ({what} of group {group})")
        if what == "begin" and group == 0:
            open_thread = thread
        elif what == "end" and group == LAYERS - 1:
            open_thread = None
    return cuts


def _replay_from_threads(device, steps: int = 6) -> tuple[list, list]:
    models = [Layers(device, seed=seed) for seed in (0, 1)]
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def run(model):
        try:
            start.wait()
            for i in range(steps):
                model.graph.replay(host_args={"seq_lens_host": [1 + i, 30 - i]})
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=contextvars.copy_context().run, args=(run, m)) for m in models]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a thread hung"
    return errors, sim_runtime.update_log()


@pytest.fixture
def slow_updates(monkeypatch):
    """Every task update takes a little while on the host, so a second thread gets to run meanwhile."""
    real = sim_runtime.graph_task_update_begin

    def slow(stream, handle):
        real(stream, handle)
        time.sleep(0.002)

    monkeypatch.setattr(sim_runtime, "graph_task_update_begin", slow)  # the simulator copies it in


@pytest.mark.parametrize("order", ["overlap", "serial"])
def test_two_threads_replaying_with_host_args_never_interleave_their_updates(slow_updates, order):
    with simulated_torch_npu(hang_timeout=2.0) as sim:
        assert sim.npu.graph_task_update_begin is sim_runtime.graph_task_update_begin
        device = devgraph.device("npu")
        device.update_order = order
        errors, log = _replay_from_threads(device)
        assert errors == []
        assert {thread for thread, *_ in log} and len(log) == 2 * 6 * 2 * LAYERS
        assert _interleaved(log) == []


def test_the_interleaving_check_sees_two_unserialised_submitters(slow_updates, monkeypatch):
    # The same run without the device's update lock: the sequences interleave (or CANN's refusal,
    # the simulator's "already open on this stream", fails a thread): what the test above rules out.
    monkeypatch.setattr(NpuGraph, "_updating", _unlocked_updating)
    with contextlib.suppress(SimulatedHang):  # a thread's failed update may leave a replay waiting
        with simulated_torch_npu(hang_timeout=0.5):
            device = devgraph.device("npu")
            errors, log = _replay_from_threads(device)
    assert errors or _interleaved(log)


@contextlib.contextmanager
def _unlocked_updating(self):
    update_stream = self.device._update_stream()
    self._fence_update_stream(update_stream)
    yield update_stream


def test_the_tasks_record_the_lengths_of_the_last_step(npu):
    model = Layers(npu)
    model.graph.replay(host_args={"seq_lens_host": [1, 30]})
    model.graph.replay(host_args={"seq_lens_host": NEW})
    assert [task.host_args["seq_lens_host"] for task in model.graph.tasks] == [NEW] * LAYERS
    assert {task.host_args["scale"] for task in model.graph.tasks} == {SCALE}


def test_a_failed_lengths_step_gives_every_task_the_last_steps_lengths_back(npu, monkeypatch):
    model = Layers(npu)
    model.graph.replay(host_args={"seq_lens_host": NEW})
    real, calls = npu_kernels.Launch.reissue, []

    def second_fails(self, lengths):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("re-issue refused")
        return real(self, lengths)

    monkeypatch.setattr(npu_kernels.Launch, "reissue", second_fails)
    with pytest.raises(DevgraphError, match=r"task update of task 1 .*re-issue refused.*keeps its previous"):
        model.graph.replay(host_args={"seq_lens_host": [1, 30]})
    monkeypatch.setattr(npu_kernels.Launch, "reissue", real)
    npu.synchronize()
    assert [task.host_args["seq_lens_host"] for task in model.graph.tasks] == [NEW] * LAYERS
    model.graph.replay()
    model.check(NEW)
