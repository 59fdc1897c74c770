"""Inductor-compiled pieces, captured as opaque tasks on the CPU reference backend.

Inductor's CPU code calls its kernels without the torch dispatcher, so the reference backend's op
recorder cannot see inside it: each compiled piece is captured through ``Graph.call_opaque`` as
one task replayed on the same tensors. (A cold inductor cache compiles C++: about 15 s here.)
"""

from __future__ import annotations

import pytest
import torch

import devgraph
from devgraph.testing.models import DecoderConfig, KVBlockManager, make_decoder


@pytest.fixture(scope="module")
def decoders():
    config = DecoderConfig(num_layers=1)
    model, reference = make_decoder(config), make_decoder(config)
    graphed = devgraph.wrap(
        model, device="cpu", mode="piecewise", capture_sizes=[2, 4, 8], compile_backend="inductor"
    )
    yield graphed, reference, KVBlockManager(config)


@pytest.mark.parametrize("tokens", [1, 3, 8, 11])
def test_inductor_pieces_equal_eager(decoders, tokens):
    graphed, reference, manager = decoders
    rows = [manager.decode_batch([tokens], [t]) for t in range(1, tokens + 1)]
    batch = {k: torch.cat([r[k] for r in rows]) for k in rows[0] if k != "seq_lens_host"}
    batch["seq_lens_host"] = [n for r in rows for n in r["seq_lens_host"]]
    got = graphed(**batch)
    with torch.no_grad():
        want = reference(**batch)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    manager.free(tokens)


def test_each_compiled_piece_is_one_opaque_task(decoders):
    graphed, _, manager = decoders
    graphed(**manager.decode_batch([99], [5]))
    module = graphed.runner.pieces.module
    assert [r.compiled.compiler for r in module.piece_graphs] == ["inductor", "inductor"]
    for graph in module.graphs(2):
        assert graph.recorded_ops == [
            f"{graph_piece} (inductor)" for graph_piece in _piece_names(module, graph)
        ]


def _piece_names(module, graph):
    return [r.piece.name for r in module.piece_graphs if any(g is graph for _, g in r.graphs.items())]
