"""Collectives inside a capture: replay re-issues them on the capture-time buffers (2 spawned gloo ranks).

Each rank captures one graph per collective kind (point-to-point send/recv included) on a static input, then copies two new inputs in,
replays, and compares with the eager call on those inputs. Refused collectives raise ``CaptureError``
naming the op. The ranks run once per backend (a module-scoped fixture); each kind is its own test.
"""

from __future__ import annotations

import warnings

import pytest

from devgraph.testing.distributed import run_ranks

WORLD = 2


def _kinds():
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc

    g = dist.group.WORLD

    def all_reduce(x):
        y = x * 2
        dist.all_reduce(y)
        return y

    def all_reduce_max(x):
        y = x + 1
        dist.all_reduce(y, op=dist.ReduceOp.MAX)
        return y

    def all_reduce_async(x):
        y = x * 3
        work = dist.all_reduce(y, async_op=True)
        z = x + 1  # independent work between issue and wait
        work.wait()
        return y + z

    def all_gather_into_tensor(x):
        out = torch.empty(WORLD * x.shape[0], *x.shape[1:])
        dist.all_gather_into_tensor(out, x + 1)
        return out * 2

    def reduce_scatter_tensor(x):
        out = torch.empty(x.shape[0] // WORLD, *x.shape[1:])
        dist.reduce_scatter_tensor(out, x * x)
        return out

    def broadcast(x):
        y = x.clone()
        dist.broadcast(y, src=1)
        return y - x

    def all_gather_list(x):
        outs = [torch.empty_like(x) for _ in range(WORLD)]
        dist.all_gather(outs, x.sin())
        return torch.cat(outs)

    def all_to_all_single(x):
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x + 0.5)
        return out

    def functional_all_reduce(x):
        return fc.all_reduce(x * 2, "sum", g) + 1

    def functional_all_gather(x):
        return fc.all_gather_tensor(x.cos(), 0, g) * 3

    def functional_reduce_scatter(x):
        return fc.reduce_scatter_tensor(x + 2, "sum", 0, g).relu()

    def row_parallel_linear(x):
        # a tensor-parallel row-parallel linear: local matmul, then all-reduce of the partial sums
        w = torch.arange(16.0).reshape(4, 4) / 10 + dist.get_rank()
        y = x @ w
        dist.all_reduce(y)
        return torch.relu(y)

    peer = 1 - dist.get_rank()

    def send_recv(x):
        # blocking point-to-point with explicit peers, in an order that pairs up: 0 sends first
        y, out = x * 2, torch.empty_like(x)
        if dist.get_rank() == 0:
            dist.send(y, dst=peer)
            dist.recv(out, src=peer)
        else:
            dist.recv(out, src=peer)
            dist.send(y, dst=peer)
        return out + x

    def isend_irecv(x):
        # a ring exchange: each rank sends before it receives, so neither send may be waited alone
        y, out = x + 1, torch.empty_like(x)
        works = [dist.isend(y, dst=peer), dist.irecv(out, src=peer)]
        z = x * x  # independent work while the exchange is in flight
        for work in works:
            work.wait()
        return out * z

    def batch_isend_irecv(x):
        y, out = x.sin(), torch.empty_like(x)
        ops = [dist.P2POp(dist.isend, y, peer), dist.P2POp(dist.irecv, out, peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return out - x

    return {
        f.__name__: f
        for f in [
            all_reduce,
            all_reduce_max,
            all_reduce_async,
            all_gather_into_tensor,
            reduce_scatter_tensor,
            broadcast,
            all_gather_list,
            all_to_all_single,
            functional_all_reduce,
            functional_all_gather,
            functional_reduce_scatter,
            row_parallel_linear,
            send_recv,
            isend_irecv,
            batch_isend_irecv,
        ]
    }


def _refused():
    import torch
    import torch.distributed as dist

    def all_gather_object(x):
        objs = [None] * WORLD
        dist.all_gather_object(objs, {"rank": dist.get_rank()})
        return x + 1

    def broadcast_object_list(x):
        objs = [dist.get_rank()]
        dist.broadcast_object_list(objs, src=0)
        return x + 1

    def barrier(x):
        y = x + 1
        dist.barrier()
        return y

    scattered = torch.empty(16 // WORLD)  # made before capture, as an engine's buffer is

    def reduce_scatter_async(x):
        # gloo's Work.wait() copies the result out of scratch memory: called here, by the user,
        # that copy would be recorded and replay stale scratch memory over the fresh result.
        work = dist.reduce_scatter_tensor(scattered, x.flatten() * 2, async_op=True)
        work.wait()
        return scattered + 1

    def recv_any_source(x):
        # every rank receives (refused before it is issued), so no send is left waiting for a peer
        out = torch.empty_like(x)
        dist.recv(out)
        return out + x

    kinds = [all_gather_object, broadcast_object_list, barrier, reduce_scatter_async, recv_any_source]
    return {f.__name__: f for f in kinds}


def _device(backend):
    import contextlib

    import devgraph

    if backend == "cpu":
        return contextlib.nullcontext(), lambda: devgraph.device("cpu")
    from devgraph_sim.npu import simulated_torch_npu

    return simulated_torch_npu(), lambda: devgraph.device("npu")


def _rank(rank, world_size, backend):
    import torch

    from devgraph import CaptureError

    warnings.filterwarnings("ignore", category=FutureWarning)
    results = {}
    ctx, make = _device(backend)
    with ctx:
        dev = make()
        for name, body in _kinds().items():
            torch.manual_seed(rank)
            static = torch.randn(4, 4)
            graph = dev.graph()
            try:
                with graph.capture():
                    out = body(static)
                diffs = []
                for step in range(2):
                    torch.manual_seed(100 * step + rank)
                    new = torch.randn(4, 4)
                    static.copy_(new)
                    graph.replay()
                    dev.synchronize()
                    expected = body(new)
                    diffs.append(bool(torch.equal(out, expected)))
                results[name] = ("ok", diffs)
            except Exception as e:
                results[name] = ("error", f"{type(e).__name__}: {e}")
        for name, body in _refused().items():
            static = torch.randn(4, 4)
            graph = dev.graph()
            try:
                with graph.capture():
                    body(static)
                results[name] = ("captured", "")
            except CaptureError as e:
                results[name] = ("refused", str(e))
            except Exception as e:
                results[name] = ("error", f"{type(e).__name__}: {e}")
    return results


@pytest.fixture(scope="module", params=["cpu", "npu-sim"])
def per_rank(request):
    return request.param, run_ranks(_rank, WORLD, args=(request.param,), timeout=240)


KINDS = [
    "all_reduce",
    "all_reduce_max",
    "all_reduce_async",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "broadcast",
    "all_gather_list",
    "all_to_all_single",
    "functional_all_reduce",
    "functional_all_gather",
    "functional_reduce_scatter",
    "row_parallel_linear",
    "send_recv",
    "isend_irecv",
    "batch_isend_irecv",
]


@pytest.mark.parametrize("kind", KINDS)
def test_replay_of_a_captured_collective_equals_eager_on_new_inputs(per_rank, kind):
    _, results = per_rank
    for rank, result in enumerate(results):
        assert result[kind] == ("ok", [True, True]), f"rank {rank}: {result[kind]}"


@pytest.mark.parametrize(
    ("kind", "named"),
    [
        ("all_gather_object", "torch.distributed.all_gather_object"),
        ("broadcast_object_list", "torch.distributed.broadcast_object_list"),
        ("barrier", "c10d::barrier"),
        ("reduce_scatter_async", "c10d::_reduce_scatter_base_ with async_op=True"),
        ("recv_any_source", "c10d::recv_any_source_"),
    ],
)
def test_host_side_collectives_are_refused_naming_the_op_and_line(per_rank, kind, named):
    backend, results = per_rank
    for result in results:
        status, message = result[kind]
        assert status == "refused", message
        assert named in message
        if backend == "cpu" or kind != "reduce_scatter_async":
            # The simulator records a stream's work when the stream runs, off the user's stack.
            assert "test_collectives_capture.py" in message  # the user's line


def test_a_collective_on_host_tensors_inside_a_device_capture_is_refused():
    # A gloo collective on CPU tensors inside a CUDA capture would run once and never at replay.
    import torch
    import torch.distributed  # registers the c10d ops

    from devgraph import CaptureError
    from devgraph.graph._collectives import refuse_collective

    func = torch.ops.c10d.allreduce_.default
    with pytest.raises(CaptureError, match="collective on cpu tensors inside a cuda capture") as info:
        refuse_collective(func, ([torch.ones(2)], None, None, None, False), {}, "cuda", lambda: "model.py:3")
    assert "c10d::allreduce_" in str(info.value) and "nccl" in str(info.value)
    refuse_collective(func, ([torch.ones(2)], None, None, None, False), {}, "cpu", lambda: None)


def _compiled_and_task_group(rank, world_size):
    import torch
    import torch.distributed as dist

    import devgraph

    warnings.filterwarnings("ignore", category=FutureWarning)
    dev = devgraph.device("cpu")

    @torch.compile(backend="inductor")
    def compiled(x):
        y = x * 2
        dist.all_reduce(y)  # traced into a functional collective inside the compiled graph
        return y + 1

    static = torch.randn(4, 4)
    compiled(static)  # compile before capture
    graph = dev.graph()
    with graph.capture():
        out = compiled(static)
    same = []
    for step in range(2):
        new = torch.randn(4, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        static.copy_(new)
        graph.replay()
        same.append(bool(torch.equal(out, compiled(new))))
    graph = dev.graph()
    try:
        with graph.capture(), graph.task_group():
            y = static + 1
            dist.all_reduce(y)
        refused = ""
    except devgraph.CaptureError as e:
        refused = str(e)
    return same, refused


@pytest.fixture(scope="module")
def compiled_and_task_group():
    return run_ranks(_compiled_and_task_group, WORLD, timeout=300)


def test_an_inductor_compiled_region_holding_a_collective_replays_equal_to_eager(compiled_and_task_group):
    for same, _ in compiled_and_task_group:
        assert same == [True, True]


def test_a_collective_inside_an_updatable_task_group_is_refused(compiled_and_task_group):
    # a task update would re-issue the group's collective on one rank alone
    for _, refused in compiled_and_task_group:
        assert "collective inside an updatable task group" in refused
        assert "c10d::allreduce_" in refused and "test_collectives_capture.py" in refused
