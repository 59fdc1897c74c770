"""Task update on the core Graph API (CPU reference backend; NPU in test_npu_backend.py)."""

from __future__ import annotations

import threading

import pytest
import torch

import devgraph
import devgraph.ops as ops
from devgraph import DevgraphError

OP = "devgraph::paged_decode_attention"


def _attention_case(batch=2, block_size=4, heads=4, kv_heads=2, dim=8, blocks=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, dim, generator=g)
    k = torch.randn(blocks, block_size, kv_heads, dim, generator=g)
    v = torch.randn(blocks, block_size, kv_heads, dim, generator=g)
    table = torch.arange(1, 1 + batch * 3, dtype=torch.int32).view(batch, 3)
    return q, k, v, table


def _capture(dev, lens, auto=True):
    q, k, v, table = _attention_case()
    seq = torch.tensor(lens, dtype=torch.int32)
    graph = dev.graph()
    with graph.capture(auto_update_ops=[OP] if auto else ()):
        out = ops.paged_decode_attention(q, k, v, table, seq, list(lens))
    return graph, out, (q, k, v, table, seq)


def _expected(args, lens):
    q, k, v, table, _seq = args
    return ops.paged_decode_attention(q, k, v, table, torch.tensor(lens, dtype=torch.int32), list(lens))


def test_auto_tasks_are_listed_with_frozen_host_args():
    graph, _, _ = _capture(devgraph.device("cpu"), [5, 9])
    (task,) = graph.tasks
    assert task.op == OP and task.is_auto and task.host_args["seq_lens_host"] == [5, 9]


def test_replay_without_update_uses_stale_host_arguments():
    graph, out, args = _capture(devgraph.device("cpu"), [5, 9])
    args[4].copy_(torch.tensor([3, 11], dtype=torch.int32))  # the device tensor changes...
    graph.replay()  # ...but the host list was frozen at capture
    torch.testing.assert_close(out, _expected(args, [5, 9]))
    assert not torch.allclose(out, _expected(args, [3, 11]))


def test_replay_with_update_uses_new_host_arguments():
    graph, out, args = _capture(devgraph.device("cpu"), [5, 9])
    args[4].copy_(torch.tensor([3, 11], dtype=torch.int32))
    graph.replay(host_args={"seq_lens_host": [3, 11]})
    torch.testing.assert_close(out, _expected(args, [3, 11]))
    assert graph.tasks[0].host_args["seq_lens_host"] == [3, 11]


def test_update_per_task_sequence_form():
    graph, out, args = _capture(devgraph.device("cpu"), [5, 9])
    graph.update([{"seq_lens_host": [2, 2]}])
    graph.replay()
    torch.testing.assert_close(out, _expected(args, [2, 2]))


def test_explicit_task_group_is_reissued_by_the_caller():
    dev = devgraph.device("cpu")
    q, k, v, table = _attention_case()
    seq = torch.tensor([5, 9], dtype=torch.int32)
    out = torch.empty_like(q)
    graph = dev.graph()
    with graph.capture():
        with graph.task_group() as group:
            ops.paged_decode_attention(q, k, v, table, seq, [5, 9], out=out)
        final = out * 2
    with graph.task_update(group):
        ops.paged_decode_attention(q, k, v, table, seq, [4, 4], out=out)
    graph.replay()
    torch.testing.assert_close(final, 2 * _expected((q, k, v, table, seq), [4, 4]))


def test_update_of_unknown_host_argument_names_the_updatable_ops():
    graph, _, _ = _capture(devgraph.device("cpu"), [5, 9])
    with pytest.raises(
        DevgraphError, match=r"no updatable task takes host argument\(s\) \['lens'\].*paged_decode"
    ):
        graph.update({"lens": [1, 2]})


def test_update_with_wrong_number_of_mappings():
    graph, _, _ = _capture(devgraph.device("cpu"), [5, 9])
    with pytest.raises(DevgraphError, match="2 host-argument mappings for 1 updatable tasks"):
        graph.update([{}, {}])


def test_update_of_explicit_group_points_to_task_update():
    dev = devgraph.device("cpu")
    graph = dev.graph()
    x = torch.ones(2)
    with graph.capture():
        with graph.task_group():
            x.add_(1)
    with pytest.raises(DevgraphError, match="task_update"):
        graph.update([{"alpha": 2}])


def test_update_before_capture_is_an_error():
    with pytest.raises(DevgraphError, match="captured graph"):
        devgraph.device("cpu").graph().update({"seq_lens_host": [1]})


def test_task_group_outside_capture_is_an_error():
    graph = devgraph.device("cpu").graph()
    with pytest.raises(DevgraphError, match=r"only valid inside graph\.capture"):
        with graph.task_group():
            pass


def test_reissue_with_different_tensors_is_an_error():
    q = torch.randn(2, 4, 8)
    graph = devgraph.device("cpu").graph()
    with graph.capture():
        with graph.task_group() as group:
            y = q * 2
    with pytest.raises(DevgraphError, match="shape"):
        with graph.task_update(group):
            torch.ones(3) * 2  # not the captured call
    del y


def test_update_from_a_worker_thread_while_replaying():
    graph, out, args = _capture(devgraph.device("cpu"), [5, 9])
    lengths = [[1 + i % 12, 1 + (i * 5) % 12] for i in range(30)]
    results = []
    lock = threading.Lock()

    def updater():
        for lens in lengths:
            graph.update({"seq_lens_host": lens})

    def replayer():
        for _ in lengths:
            with lock:
                graph.replay()
                results.append(out.clone())

    threads = [threading.Thread(target=updater), threading.Thread(target=replayer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    valid = [_expected(args, lens) for lens in [[5, 9], *lengths]]
    for r in results:  # every replay saw one complete set of lengths, never a torn update
        assert any(torch.allclose(r, v) for v in valid)


def test_an_error_inside_task_update_propagates_and_keeps_the_task():
    graph, out, args = _capture(devgraph.device("cpu"), [5, 9])
    with pytest.raises(ZeroDivisionError):
        with graph.task_update(graph.tasks[0]):
            1 / 0  # noqa: B018
    graph.replay()
    torch.testing.assert_close(out, _expected(args, [5, 9]))


def test_replay_after_reset_says_to_capture_first():
    graph, _, _ = _capture(devgraph.device("cpu"), [5, 9])
    graph.reset()
    with pytest.raises(DevgraphError, match=r"never captured \(or was reset\).*graph\.capture"):
        graph.replay()


def test_a_failed_task_group_begin_leaves_the_graph_capturable(monkeypatch):
    dev = devgraph.device("cpu")
    graph = dev.graph()
    x = torch.ones(2)

    def refuse(group):
        raise RuntimeError("backend refused the group")

    monkeypatch.setattr(graph, "_task_group_begin", refuse)
    with pytest.raises(RuntimeError, match="refused"):
        with graph.capture():
            with graph.task_group():
                x.add_(1)
    monkeypatch.undo()
    with graph.capture():  # neither "already capturing" nor "task groups cannot nest"
        with graph.task_group():
            x.add_(1)
    assert len(graph.tasks) == 1


def test_update_changes_no_output_before_the_replay():
    """A device's task update rewrites parameters and runs nothing: the last replay's outputs stay
    as they were until the next replay (another thread may be reading them)."""
    graph, out, args = _capture(devgraph.device("cpu"), [5, 9])
    graph.replay()
    before = out.clone()
    graph.update({"seq_lens_host": [2, 3]})
    torch.testing.assert_close(out, before)
    graph.replay()
    torch.testing.assert_close(out, _expected(args, [2, 3]))


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("devgraph::nope", r"unknown auto-update op 'devgraph::nope': torch.ops.devgraph has no op 'nope'"),
        ("paged_decode_attention", r"not a qualified op name.*'devgraph::paged_decode_attention'"),
        ("aten::add.nope", r"unknown auto-update op 'aten::add.nope'.*has overloads"),
    ],
)
def test_capture_refuses_an_unknown_auto_update_op_before_capturing(name, message):
    graph = devgraph.device("cpu").graph()
    with pytest.raises(DevgraphError, match=message), graph.capture(auto_update_ops=[name]):
        pytest.fail("the capture block ran")
    with graph.capture():  # nothing was left half-captured
        torch.ones(2) + 1


def test_an_overload_spelling_updates_every_call_of_the_op():
    x = torch.ones(3)
    graph = devgraph.device("cpu").graph()
    with graph.capture(auto_update_ops=["aten::add.Tensor"]):
        torch.add(x, x, alpha=2)
    assert [task.op for task in graph.tasks] == ["aten::add"]
