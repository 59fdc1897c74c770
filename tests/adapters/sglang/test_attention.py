"""The ``devgraph`` attention backend refuses, when it is built (engine start), layers it would get wrong."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

# "sglang.srt", not "sglang": this directory is itself importable as a namespace package "sglang".
pytest.importorskip("sglang.srt")

import torch
from sglang.srt.layers.radix_attention import RadixAttention

from devgraph import DevgraphError
from devgraph.adapters.sglang._attention import DevgraphAttentionBackend, check_model


def _model(**attention) -> torch.nn.Module:
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(
        [RadixAttention(num_heads=4, head_dim=16, scaling=0.25, num_kv_heads=2, layer_id=i) for i in (0, 1)]
    )
    model.layers.append(
        RadixAttention(num_heads=4, head_dim=16, scaling=0.25, num_kv_heads=2, layer_id=2, **attention)
    )
    return model


@pytest.mark.parametrize(
    ("attention", "named"),
    [
        (dict(sliding_window_size=31), "a sliding window of 31"),
        (dict(logit_cap=50.0), "attention logit soft-capping (logit_cap 50.0)"),
        (dict(is_cross_attention=True), "cross attention"),
        (dict(v_head_dim=8), "qk_head_dim 16 != v_head_dim 8"),
    ],
)
def test_backend_refuses_unsupported_layers_when_built(attention, named):
    runner = SimpleNamespace(model=_model(**attention))  # nothing else: the check runs first
    with pytest.raises(DevgraphError, match=re.escape(f"layers.2 (layer 2) uses {named}")):
        DevgraphAttentionBackend(runner)


def test_plain_layers_pass_the_check():
    check_model(_model())
    check_model(_model(sliding_window_size=-1, logit_cap=0.0))
