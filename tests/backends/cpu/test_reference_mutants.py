"""Backend behaviours that earlier mutation testing left unchecked (issue 19).

* A re-issued task computes nothing into graph memory at update time: its fresh outputs land in the
  captured outputs at the next replay only (another thread may be reading the last replay's).
* The torch_npu simulator's ``ExternalEvent`` wait and reset, queued on a stream outside a graph,
  hold and clear as on hardware.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from _npu_sim_graphs import doubling_graph

import devgraph
from devgraph_sim.npu import simulated_torch_npu
from devgraph_sim.npu._streams import SimulatedHang


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode, torch.enable_grad])
def test_a_reissued_task_writes_its_fresh_output_at_replay_not_at_update(mode):
    graph = devgraph.device("cpu").graph()
    x = torch.arange(4.0)
    with mode():
        with graph.capture():
            with graph.task_group("scale") as group:
                y = torch.mul(x, 2.0)  # a fresh output; the host scalar is frozen at capture
            z = y + 1
    graph.replay()
    torch.testing.assert_close(y, x * 2)
    with mode():
        with graph.task_update(group):
            torch.mul(x, 3.0)
    torch.testing.assert_close(y, x * 2)  # the update wrote nothing into the graph's memory
    torch.testing.assert_close(z, x * 2 + 1)
    graph.replay()
    torch.testing.assert_close(y, x * 3)
    torch.testing.assert_close(z, x * 3 + 1)


@contextlib.contextmanager
def _event_and_doubling_graph():
    """On the simulator with lazy streams (a hang raises after 0.2 s): ``npu``, a doubling graph and
    its output ``y`` (2 until a replay runs, 10 after), and an ``ExternalEvent``."""
    with simulated_torch_npu(streams="lazy", hang_timeout=0.2) as sim:
        graph, _x, y = doubling_graph(sim.npu)  # _x lives as long as the graph
        yield sim.npu, graph, y, sim.npu.ExternalEvent()


def _replay_is_held(npu, graph, stream, y):
    """A replay queued on ``stream`` behind an event wait nothing satisfies: synchronising the stream
    hangs, and the graph's output keeps the value it had before the replay."""
    with npu.stream(stream):
        graph.replay()
    with pytest.raises(SimulatedHang):
        stream.synchronize()
    torch.testing.assert_close(y, torch.full((3,), 2.0))


def test_an_external_event_wait_outside_a_graph_holds_its_stream_until_recorded():
    with _event_and_doubling_graph() as (npu, graph, y, event):
        waiter = npu.Stream()
        event.wait(waiter)
        _replay_is_held(npu, graph, waiter, y)  # nothing records the event: the wait holds the replay


def test_an_external_event_wait_outside_a_graph_runs_once_another_stream_records_it():
    with _event_and_doubling_graph() as (npu, graph, y, event):
        waiter, recorder = npu.Stream(), npu.Stream()
        event.wait(waiter)
        with npu.stream(waiter):
            graph.replay()
        event.record(recorder)
        waiter.synchronize()  # the wait drives the stream holding the record, then runs the replay
        torch.testing.assert_close(y, torch.full((3,), 10.0))


def test_an_external_event_reset_outside_a_graph_clears_an_earlier_record():
    with _event_and_doubling_graph() as (npu, graph, y, event):
        stream = npu.Stream()
        event.record(stream)
        stream.synchronize()
        event.reset(stream)  # queued: clears the flag the record set
        event.wait(stream)
        _replay_is_held(npu, graph, stream, y)
