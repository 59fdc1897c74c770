"""A speculative draft of k steps captured as one graph (issue 47): equal to k eager steps, one update.

The draft is the reference ``PagedDecoder`` (paged attention, one updatable task per layer): each
step feeds its argmax to the next inside the graph, positions and lengths grow by one per step, and
every step's metadata is built on the host before the one replay (``devgraph.testing.speculative``).
Run on the CPU reference, on devgraph's torch_npu simulator (eager streams, and lazy streams where
only events order the update before the tasks that read it), and on CUDA where a GPU is visible.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch

import devgraph
import devgraph.ops as ops
from devgraph import DevgraphError
from devgraph.graph import MultiStepGraph, TaskGroup, step_lengths
from devgraph.testing.models import DecoderConfig, KVBlockManager, make_decoder
from devgraph.testing.speculative import MergedDraft, SeparateDraft, draft_metadata, eager_draft

STEPS = 3
ROWS = [0, 1, 2]
PROMPTS = {0: [3, 1, 4], 1: [1, 5, 9, 2, 6, 5, 3], 2: [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5]}
OP = "devgraph::paged_decode_attention"


def _devices():
    params: list = ["cpu", "npu-sim", "npu-sim-lazy", "npu-sim-serial"]
    if torch.cuda.is_available():
        params.append(pytest.param("cuda", marks=pytest.mark.cuda))
    return params


@pytest.fixture(params=_devices())
def dev(request):
    if request.param in ("cpu", "cuda"):
        yield devgraph.device(request.param)
        return
    from devgraph_sim.npu import simulated_torch_npu

    streams = "lazy" if request.param.endswith("lazy") else "eager"
    with simulated_torch_npu(streams=streams, hang_timeout=0.5):
        device = devgraph.device("npu")
        # serial: update every task, then replay; the default overlaps them (NpuDevice.update_order)
        device.update_order = "serial" if request.param.endswith("serial") else "overlap"
        yield device


def _config(dev) -> DecoderConfig:
    """bfloat16 on npu (its fused attention refuses float32); 2 layers: 2 updatable tasks per step."""
    return DecoderConfig(dtype=torch.bfloat16) if dev.name == "npu" else DecoderConfig()


class Setup:
    """An eager draft model and a graphed copy (same weights, own KV caches), the prompts prefilled
    in both (rows of different lengths), and the host's block manager."""

    def __init__(self, dev) -> None:
        config = _config(dev)
        self.dev = dev
        self.eager = make_decoder(config, seed=3, device=dev.torch_device)
        self.graphed = make_decoder(config, seed=3, device=dev.torch_device)
        self.manager = KVBlockManager(config, device=dev.torch_device)
        longest = max(len(p) for p in PROMPTS.values())
        with torch.no_grad():
            for t in range(longest - 1):  # every prompt token but the last: the draft starts from it
                rows = [r for r in ROWS if t < len(PROMPTS[r]) - 1]
                batch = self.manager.decode_batch(rows, [PROMPTS[r][t] for r in rows])
                self.eager(**batch)
                self.graphed(**batch)
        self.first = torch.tensor([PROMPTS[r][-1] for r in ROWS], device=dev.torch_device)

    def rounds(self, draft, count: int = 3):
        """``count`` draft rounds (each starting from the eager draft's last token, the lengths grown
        by ``STEPS``): yields (eager tokens, graphed tokens, step 0's host lengths) per round."""
        first = self.first
        for _ in range(count):
            metas = draft_metadata(self.manager, ROWS, STEPS)
            want = eager_draft(self.eager, first, metas)
            got = draft.propose(first, metas)
            self.dev.synchronize()  # reading the tokens on the host (an engine verifies on the device)
            yield want.cpu(), got.cpu().clone(), metas[0]["seq_lens_host"]
            first = want[-1]


def test_merged_draft_equals_k_eager_steps_for_several_replays(dev):
    setup = Setup(dev)
    draft = MergedDraft(setup.graphed, dev, len(ROWS), STEPS)
    assert draft.graph.tasks_per_step == setup.graphed.config.num_layers
    lengths = []
    for want, got, lens in setup.rounds(draft):
        assert torch.equal(got, want), f"drafted {got.T.tolist()}, eager {want.T.tolist()} (lengths {lens})"
        lengths.append(lens)
    assert lengths == [[3, 7, 12], [6, 10, 15], [9, 13, 18]]  # rows of different lengths, growing
    assert draft.graph.stats.replays == 3 and draft.graph.stats.update_submissions == 3


def test_k_separate_replays_draft_the_same_tokens(dev, request):
    if request.node.callspec.params["dev"] == "npu-sim-lazy":
        pytest.skip(
            "the baseline copies each step's metadata in between replays with host tensor ops, which the "
            "lazy simulator runs at once (it queues only graph work: tests/sim/devgraph_sim/npu/_streams.py)"
        )
    setup = Setup(dev)
    draft = SeparateDraft(setup.graphed, dev, len(ROWS), STEPS)
    for want, got, _ in setup.rounds(draft, count=2):
        assert torch.equal(got, want)


def test_updating_only_step_0_drafts_wrong_tokens(dev):
    """The negative control: the same graph, every step's tasks but step 0's left with the lengths of
    the capture (what a merged graph updated like a single step gets). The tokens must differ."""
    if dev.name == "cuda":
        pytest.skip("CUDA's paged attention reads the lengths from the device tensors: nothing goes stale")
    setup = Setup(dev)
    draft = MergedDraft(setup.graphed, dev, len(ROWS), STEPS)
    graph, per_task = draft.graph.graph, draft.graph.tasks_per_step
    wrong = 0
    for _ in range(2):
        metas = draft_metadata(setup.manager, ROWS, STEPS)
        want = eager_draft(setup.eager, setup.first, metas)
        draft.buffers.load(setup.first, metas)
        step0 = [{"seq_lens_host": metas[0]["seq_lens_host"]}] * per_task
        graph.replay(host_args=step0 + [{}] * (per_task * (STEPS - 1)))
        dev.synchronize()
        wrong += int(not torch.equal(draft.buffers.ids[1:].cpu(), want.cpu()))
        assert torch.equal(draft.buffers.ids[1].cpu(), want[0].cpu())  # step 0 itself is right
    assert wrong == 2


# -- counts: one update submission per replay, no device-wide sync ----------------------------------


@contextlib.contextmanager
def _counting(dev, graph):
    """Count, for the block: device-wide and stream/event host syncs, and the update submissions (on
    NPU the torch_npu simulator's calls: entries onto the update stream and fences; elsewhere the
    graph's ``update``, which ``replay(host_args)`` runs once per call)."""
    counts: Counter = Counter()
    stack = contextlib.ExitStack()

    def spy(owner, attr, name):
        real = getattr(owner, attr)

        def counted(*args, **kwargs):
            counts[name] += 1
            return real(*args, **kwargs)

        setattr(owner, attr, counted)
        stack.callback(setattr, owner, attr, real)

    if dev.name == "npu":
        npu = dev._npu
        for attr in ("synchronize", "stream", "graph_task_update_begin"):
            spy(npu, attr, attr)
        for cls, attr in [("Stream", "synchronize"), ("Stream", "wait_stream"), ("Event", "synchronize"),
                          ("NPUGraph", "replay")]:  # fmt: skip
            spy(getattr(npu, cls), attr, f"{cls}.{attr}")
    else:
        spy(dev, "synchronize", "synchronize")  # the device object's own, devgraph's (not torch's)
        spy(graph, "update", "update")
    with stack:
        yield counts


def test_one_update_submission_and_no_device_sync_per_replay(dev):
    setup = Setup(dev)
    draft = MergedDraft(setup.graphed, dev, len(ROWS), STEPS)
    layers = draft.graph.tasks_per_step
    metas = [draft_metadata(setup.manager, ROWS, STEPS) for _ in range(2)]
    counts: Counter = Counter()
    for meta in metas:
        with _counting(dev, draft.graph.graph) as one:
            draft.propose(setup.first, meta)
        counts += one
        # Outside the count: the next round's metadata is copied in by host tensor ops, which the lazy
        # simulator does not queue behind the replay (an engine's copies are stream-ordered).
        dev.synchronize()
    replays = len(metas)
    if dev.name == "npu":
        assert counts == {
            "stream": replays,  # one entry onto the update stream per replay, every step's tasks inside
            "Stream.wait_stream": replays,  # one fence
            "graph_task_update_begin": replays * STEPS * layers,  # torch_npu: one handle per begin
            "NPUGraph.replay": replays,
        }
    else:
        assert counts == {"update": replays}
    assert draft.graph.stats.update_submissions == replays
    setup.dev.synchronize()
    want = [eager_draft(setup.eager, setup.first, meta) for meta in metas][-1]  # both rounds: the KV cache
    assert torch.equal(draft.buffers.ids[1:].cpu(), want.cpu())


def test_npu_builds_each_steps_lengths_once_for_all_its_layers(monkeypatch):
    from devgraph.backends.npu import _kernels as npu_kernels
    from devgraph_sim.npu import simulated_torch_npu

    with simulated_torch_npu(hang_timeout=0.5):
        dev = devgraph.device("npu")
        setup = Setup(dev)
        draft = MergedDraft(setup.graphed, dev, len(ROWS), STEPS)
        assert draft.graph.tasks_per_step > 1
        built = []
        real = npu_kernels.attention_lengths
        monkeypatch.setattr(
            npu_kernels, "attention_lengths", lambda lens, b: built.append(lens) or real(lens, b)
        )
        metas = draft_metadata(setup.manager, ROWS, STEPS)
        draft.propose(setup.first, metas)
        assert built == [meta["seq_lens_host"] for meta in metas]  # one list per step, shared by its layers
        dev.synchronize()


def test_k_separate_replays_submit_k_updates(dev):
    setup = Setup(dev)
    draft = SeparateDraft(setup.graphed, dev, len(ROWS), STEPS)
    with _counting(dev, draft.graph) as counts:
        draft.propose(setup.first, draft_metadata(setup.manager, ROWS, STEPS))
    dev.synchronize()  # while the model the replays read is alive
    key = "stream" if dev.name == "npu" else "update"
    assert counts[key] == STEPS
    assert not counts["synchronize"]


# -- what it refuses --------------------------------------------------------------------------------


@pytest.fixture
def cpu():
    return devgraph.device("cpu")


class Attention:
    """Paged attention calls over one small cache (float32, the CPU reference)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.q = torch.randn(2, 4, 8, generator=g)
        self.k = torch.randn(4, 16, 2, 8, generator=g)
        self.v = torch.randn(4, 16, 2, 8, generator=g)
        self.table = torch.tensor([[1, 0], [2, 3]], dtype=torch.int32)
        self.seq = torch.tensor([5, 20], dtype=torch.int32)

    def __call__(self) -> torch.Tensor:
        return ops.paged_decode_attention(self.q, self.k, self.v, self.table, self.seq, [5, 20], 0.5)


def _capture(cpu, calls_per_step, steps=None):
    attn = Attention()
    graph = MultiStepGraph(cpu, steps or len(calls_per_step))
    with graph.capture():
        for i, calls in enumerate(calls_per_step):
            with graph.step(i):
                for _ in range(calls):
                    attn()
    graph.inputs = attn  # the graph reads them at every replay: keep them alive with it
    return graph


def test_steps_whose_task_counts_differ_are_refused(cpu):
    with pytest.raises(DevgraphError, match=r"step 1 captured 1 updatable task.*step 0 captured 2"):
        _capture(cpu, [2, 1])


def test_a_capture_of_fewer_steps_than_declared_is_refused_and_reset(cpu):
    attn = Attention()
    graph = MultiStepGraph(cpu, 3)
    with pytest.raises(DevgraphError, match=r"held 2 step\(s\).*steps=3"):
        with graph.capture():
            for i in range(2):
                with graph.step(i):
                    attn()
    assert not graph.graph.is_captured()


def test_steps_out_of_order_or_beyond_k_are_refused(cpu):
    graph = MultiStepGraph(cpu, 1)
    with pytest.raises(DevgraphError, match="capture the steps in order"):
        with graph.capture(), graph.step(1):
            pass
    graph = MultiStepGraph(cpu, 1)
    with pytest.raises(DevgraphError, match="made with steps=1"):
        with graph.capture():
            for i in range(2):
                with graph.step(i):
                    pass


def test_an_updatable_task_outside_every_step_is_refused(cpu):
    attn = Attention()
    graph = MultiStepGraph(cpu, 1)
    with pytest.raises(DevgraphError, match="outside every step"):
        with graph.capture():
            with graph.step(0):
                attn()
            attn()


def test_an_explicit_task_group_is_refused(cpu):
    graph = MultiStepGraph(cpu, 1)
    x = torch.ones(2)
    with pytest.raises(DevgraphError, match="explicit task group"):
        with graph.capture(), graph.step(0), graph.graph.task_group():
            x.add_(1)


def test_a_replay_must_give_every_step_its_host_arguments(cpu):
    graph = _capture(cpu, [1, 1, 1])
    lens = step_lengths([5, 20], 3)
    with pytest.raises(DevgraphError, match=r"got 2 mapping.*for 3 steps"):
        graph.replay([{"seq_lens_host": x} for x in lens[:2]])
    with pytest.raises(DevgraphError, match="got one mapping for 3 steps"):
        graph.replay({"seq_lens_host": lens[0]})
    with pytest.raises(DevgraphError, match="step 2 got no host arguments"):
        graph.replay([{"seq_lens_host": lens[0]}, {"seq_lens_host": lens[1]}, {}])
    with pytest.raises(DevgraphError, match="without host arguments"):
        graph.replay()
    with pytest.raises(
        DevgraphError, match=r"step 1: no updatable task takes host argument\(s\) \['seq_len'\]"
    ):
        graph.replay([{"seq_lens_host": lens[0]}, {"seq_len": lens[1]}, {"seq_lens_host": lens[2]}])
    assert graph.stats.replays == 0
    graph.replay([{"seq_lens_host": x} for x in lens])
    assert [t.host_args["seq_lens_host"] for t in graph.graph.tasks] == lens


def test_a_step_task_no_given_name_reaches_is_refused(cpu):
    attn = Attention()
    other = torch.ones(2)
    graph = MultiStepGraph(cpu, 1)
    with graph.capture(auto_update_ops=[OP, "aten::add.Tensor"]), graph.step(0):
        attn()
        torch.add(other, other, alpha=2)
    with pytest.raises(DevgraphError, match=r"task 1 \(aten::add.*takes none of \['seq_lens_host'\]"):
        graph.replay([{"seq_lens_host": [6, 21]}])


def test_a_second_capture_is_refused_and_the_first_still_replays(cpu):
    graph = _capture(cpu, [1, 1])
    with pytest.raises(DevgraphError, match="already captured; call reset"):
        with graph.capture():
            pass
    graph.replay([{"seq_lens_host": x} for x in step_lengths([6, 21], 2)])
    graph.reset()
    with pytest.raises(DevgraphError, match="needs a captured graph"):
        graph.replay([{"seq_lens_host": [6, 21]}] * 2)


def test_step_lengths_grow_by_one_per_step():
    assert step_lengths([3, 7], 3) == [[3, 7], [4, 8], [5, 9]]
    with pytest.raises(DevgraphError):
        step_lengths([3], 0)


def test_cuda_code_path_notes_every_steps_lengths_and_reissues_nothing():
    """No GPU here: a ``CudaGraph`` (constructing it makes no CUDA call) is given two steps' tasks as a
    capture would leave them, and its replay stubbed. ``replay`` must reach CUDA's update path, which
    only notes each step's lengths (its kernel reads the device tensors), and re-issue nothing."""
    from devgraph.backends.cuda._device import CudaDevice

    attn = Attention()
    op = torch.ops.devgraph.paged_decode_attention.default
    args = (attn.q, attn.k, attn.v, attn.table, attn.seq, [5, 20], 0.5)
    graph = MultiStepGraph(CudaDevice(0), 2)
    native = graph.graph
    native._tasks = [TaskGroup.for_call(i, op, args, {}) for i in range(4)]  # 2 layers per step
    native._state = "captured"
    graph._step_tasks = [tuple(native._tasks[:2]), tuple(native._tasks[2:])]
    replays = []
    native._replay = lambda: replays.append(1)  # the instance's: no CUDA call
    native._task_update_begin = lambda group: pytest.fail(f"task {group.index} re-issued on CUDA")
    lens = step_lengths([6, 21], 2)
    graph.replay([{"seq_lens_host": x} for x in lens])
    assert replays == [1]
    assert [t.host_args["seq_lens_host"] for t in native.tasks] == [lens[0], lens[0], lens[1], lens[1]]
