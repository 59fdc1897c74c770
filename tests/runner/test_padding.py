"""Padding, property-tested: any batch inside the buckets equals eager; padded rows hold pad values."""

from __future__ import annotations

import functools

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import devgraph
from devgraph.testing.models import KVBlockManager, make_decoder

SIZES = (1, 2, 4, 8)


@functools.cache
def _pair():
    eager, model = make_decoder(seed=3), make_decoder(seed=3)
    # frontend='raw': the decoder's host lengths (host_args) are served without Dynamo only
    graphed = devgraph.wrap(model, device="cpu", batch_sizes=SIZES, frontend="raw")
    graphed.capture(**model.dummy_inputs(1))
    return eager, graphed


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 8),
    lengths=st.lists(st.integers(1, 40), min_size=8, max_size=8),
    seed=st.integers(0, 2**16),
)
def test_padded_batches_equal_eager_and_pad_rows_hold_pad_values(n, lengths, seed):
    eager, graphed = _pair()
    runner, pads = graphed.runner, graphed.module.pad_values()
    g = torch.Generator().manual_seed(seed)
    managers = [KVBlockManager(eager.config) for _ in range(2)]
    for step in range(max(lengths[:n])):  # sequences of different lengths, one token per step
        active = [i for i in range(n) if step < lengths[i]]
        tokens = torch.randint(0, eager.config.vocab_size, (len(active),), generator=g).tolist()
        ref = eager(**managers[0].decode_batch(active, tokens))
        got = graphed(**managers[1].decode_batch(active, tokens))
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    rows = len(active)
    bucket = next(s for s in SIZES if s >= rows)
    for name, buf in runner.inputs.buffers.items():
        padded = buf.narrow(0, rows, bucket - rows)
        assert bool((padded == pads[name]).all()), f"{name}: padded rows do not hold the pad value"
    for task in runner.graph(bucket).tasks:
        assert task.host_args["seq_lens_host"][rows:] == [pads["seq_lens_host"]] * (bucket - rows)
