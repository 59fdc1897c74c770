"""Graphs captured on devgraph's torch_npu simulator (tests/sim) that the stream and event tests share."""

from __future__ import annotations

import torch


def doubling_graph(npu):
    """``y = x * 2`` over ``x = ones(3)``, captured as an ``NPUGraph`` on the simulated ``npu``; ``x`` is
    then filled with 5, so ``y`` reads 2 until a replay runs and 10 after. Returns ``graph, x, y``: ``x``
    must outlive the graph (a device graph reads it by address)."""
    x = torch.ones(3)
    graph = npu.NPUGraph()
    with npu.graph(graph):
        y = x * 2
    x.fill_(5.0)
    return graph, x, y
