"""``Graph``'s public methods are final; backends override one private hook per decision.

A backend that overrides a public method (``replay``, ``update``...) is refused when its class is
defined, naming the hook to override instead; the built-in backends override hooks only, and the
hook a graph overrides is the one its public method runs.
"""

from __future__ import annotations

import pytest
import torch

from devgraph import ops
from devgraph._errors import DevgraphError
from devgraph.backends.accelerator._device import AcceleratorGraph
from devgraph.backends.cpu._device import CpuDevice, CpuGraph
from devgraph.backends.cuda._device import CudaGraph, DeviceMetadataGraph
from devgraph.backends.npu._device import NpuGraph
from devgraph.graph._contract import Graph

PUBLIC = sorted(Graph._FINAL_HOOKS)
OP = "devgraph::paged_decode_attention"


def _override(base: type, name: str) -> type:
    return type("ThirdPartyGraph", (base,), {name: lambda self, *args, **kwargs: None})


@pytest.mark.parametrize("base", [Graph, CpuGraph, NpuGraph], ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", PUBLIC)
def test_overriding_a_public_method_is_refused_at_class_definition(base, name):
    hooks = Graph._FINAL_HOOKS[name]
    with pytest.raises(TypeError, match=rf"ThirdPartyGraph overrides Graph\.{name}, which is final") as err:
        _override(base, name)
    assert all(hook in str(err.value) for hook in hooks)


def test_every_public_name_of_graph_is_final_and_names_existing_hooks():
    public = {name for name in vars(Graph) if not name.startswith("_")}
    assert public == set(Graph._FINAL_HOOKS)  # a new public method must be listed (and so final)
    for name in public:
        member = vars(Graph)[name]
        member = member.fget if isinstance(member, property) else member
        assert getattr(member, "__final__", False), f"Graph.{name} is not marked typing.final"
        for hook in Graph._FINAL_HOOKS[name]:
            assert callable(getattr(Graph, hook, None)), f"Graph.{name} names a missing hook {hook}"


def test_overriding_hooks_and_adding_public_names_is_allowed():
    class Graph2(CpuGraph):
        def _replay(self):
            super()._replay()

        @property
        def recorded(self):
            return self.recorded_ops

    assert issubclass(Graph2, Graph)


#: The hooks of the host-argument decisions each built-in backend overrides (its class or a base).
DECISIONS = ("_replay_with_host_args", "_update_tasks", "_settle_host_args", "_check_update_allowed")
OVERRIDES = {
    CpuGraph: set(),  # the reference: re-issue every task, then replay
    CudaGraph: {"_replay_with_host_args", "_settle_host_args"},  # note the values only
    NpuGraph: {
        "_replay_with_host_args",
        "_update_tasks",
        "_check_update_allowed",
        "_settle_host_args",
    },  # overlapped
    AcceleratorGraph: set(),  # task update refused by its _task_update_begin
}


@pytest.mark.parametrize("cls", list(OVERRIDES), ids=lambda c: c.__name__)
def test_each_backend_overrides_its_hooks_only(cls):
    overridden = {hook for hook in DECISIONS if getattr(cls, hook) is not getattr(Graph, hook)}
    assert overridden == OVERRIDES[cls]
    backend = [c for c in cls.__mro__ if issubclass(c, Graph) and c is not Graph]
    assert not set(Graph._FINAL_HOOKS) & {name for c in backend for name in vars(c)}


def test_the_cuda_fast_path_is_not_in_the_base_class():
    assert not any("note" in name or "host_only" in name for name in vars(Graph))
    assert issubclass(CudaGraph, DeviceMetadataGraph)


class _Seen(CpuGraph):
    def _replay_with_host_args(self, host_args):
        self.__dict__.setdefault("seen", []).append((dict(host_args), self._lock._is_owned()))
        super()._replay_with_host_args(host_args)


class _SeenDevice(CpuDevice):
    def graph(self, keep_graph: bool = False):
        return _Seen(self, keep_graph)


def test_replay_runs_the_host_args_hook_under_the_lock_after_the_state_checks():
    graph = _SeenDevice().graph()
    with pytest.raises(DevgraphError, match="never captured"):
        graph.replay(host_args={"seq_lens_host": [1, 1]})  # the state machine answers first
    q = torch.randn(2, 4, 8)
    k, v = torch.randn(8, 16, 2, 8), torch.randn(8, 16, 2, 8)
    table = torch.arange(1, 5, dtype=torch.int32).view(2, 2)
    seq = torch.tensor([5, 9], dtype=torch.int32)
    with graph.capture(auto_update_ops=[OP]):
        out = ops.paged_decode_attention(q, k, v, table, seq, [5, 9])
    graph.replay()
    assert "seen" not in vars(graph)  # a replay without host arguments does not run the hook
    seq.copy_(torch.tensor([3, 7], dtype=torch.int32))
    graph.replay(host_args={"seq_lens_host": [3, 7]})
    assert vars(graph)["seen"] == [({"seq_lens_host": [3, 7]}, True)]
    torch.testing.assert_close(out, ops.paged_decode_attention(q, k, v, table, seq, [3, 7]))


def test_a_third_party_backend_built_on_hooks_passes_conformance():
    from devgraph.testing import conformance

    calls = []

    class HookedGraph(CpuGraph):
        def _replay_with_host_args(self, host_args):
            calls.append(host_args)
            super()._replay_with_host_args(host_args)

    class HookedDevice(CpuDevice):
        def graph(self, keep_graph: bool = False):
            return HookedGraph(self, keep_graph)

    assert conformance.failures(HookedDevice()) == {}
    assert calls  # the suite's replays with host arguments ran the backend's hook
