"""NPU task update on torch_npu's handler registry (``_npugraph_handlers``), on the simulator."""

from __future__ import annotations

import pytest
import torch
from _npu_cases import SCALE, attention_case, expected_attention

import devgraph
from devgraph import DevgraphError
from devgraph.backends.npu import _handlers

IFA = "devgraph_npu_sim::npu_fused_infer_attention_score"
PA = "devgraph_npu_sim::_npu_paged_attention"


def _ifa(sim, case, lens):
    q, k, v, table = case
    nb, bs, hkv, d = k.shape
    return sim.npu_fused_infer_attention_score(
        q.unsqueeze(2), k.view(nb, bs, hkv * d), v.view(nb, bs, hkv * d),
        actual_seq_lengths_kv=lens, block_table=table, num_heads=q.shape[1], num_key_value_heads=hkv,
        scale=SCALE, input_layout="BNSD", block_size=bs,
    )  # fmt: skip


def test_the_device_reads_torch_npus_registry(npu, sim):
    registry = sim.npu._npugraph_handlers.npugraph_handler._NPU_GRAPH_OP_HANDLERS
    assert npu._handlers is registry
    # Every registry op the (simulated) torch_npu registers is updatable, after devgraph's own.
    assert npu.updatable_ops[0] == "devgraph::paged_decode_attention"
    assert IFA in npu.updatable_ops and PA in npu.updatable_ops
    # Ops the registry names but this torch_npu does not register are left out, not guessed.
    assert not any("v2" in n or "v3" in n or "latent" in n for n in npu.updatable_ops)


def test_a_handler_registered_later_makes_its_op_updatable(sim):
    core = sim.npu._npugraph_handlers
    registry = core.npugraph_handler._NPU_GRAPH_OP_HANDLERS
    assert "npu_rms_norm.default" not in registry

    @core.register_npu_graph_handler(["npu_rms_norm.default"])
    class _Norm(core.NpuGraphOpHandler):
        UPDATE_SPECS = {"npu_rms_norm.default": [("arg", 2, "epsilon")]}

    try:
        from devgraph import _plugins

        _plugins.forget_devices("npu")
        assert "devgraph_npu_sim::npu_rms_norm" in devgraph.device("npu").updatable_ops
    finally:
        del registry["npu_rms_norm.default"]


def test_ifa_default_called_directly_is_updated_through_the_registry(npu, sim):
    # A model calling torch_npu's attention itself (as vllm-ascend's do): the .default call is
    # captured as its handler captures it (.out over outputs allocated at capture), so a task update
    # rewrites the task into the buffers the rest of the graph reads.
    case = attention_case()
    graph = npu.graph()
    with graph.capture(auto_update_ops=npu.updatable_ops):
        attn, _lse = _ifa(sim, case, [5, 9])
        doubled = attn.squeeze(2) * 2
    (task,) = graph.tasks
    assert task.op == IFA and task.host_args["actual_seq_lengths_kv"] == [5, 9]
    graph.replay({"actual_seq_lengths_kv": [12, 3]})
    npu.synchronize()
    expected = expected_attention(*case, [12, 3])
    torch.testing.assert_close(attn.squeeze(2), expected)
    torch.testing.assert_close(doubled, expected * 2)
    graph.update({"actual_seq_lengths_kv": [2, 17]})
    graph.replay()
    npu.synchronize()
    torch.testing.assert_close(doubled, expected_attention(*case, [2, 17]) * 2)


def test_paged_attention_context_lens_is_updated_through_the_registry(npu, sim):
    q, k, v, table = attention_case()
    context_lens, out = torch.tensor([5, 9], dtype=torch.int32), torch.empty_like(q)
    graph = npu.graph()
    with graph.capture(auto_update_ops=npu.updatable_ops):
        sim._npu_paged_attention(q, k, v, k.shape[2], q.shape[1], SCALE, table, context_lens, out)
    graph.replay({"context_lens": torch.tensor([2, 13], dtype=torch.int32)})
    npu.synchronize()
    torch.testing.assert_close(out, expected_attention(q, k, v, table, [2, 13]))


def test_a_spec_that_disagrees_with_the_schema_is_refused(sim):
    core = sim.npu._npugraph_handlers

    class _Wrong(core.NpuGraphOpHandler):
        UPDATE_SPECS = {"_npu_paged_attention.default": [("arg", 6, "context_lens")]}  # 6 is block_table

    with pytest.raises(DevgraphError, match="schema names it 'block_table'"):
        _handlers.spec_names(sim._npu_paged_attention.default, _Wrong)


def test_without_the_registry_only_devgraphs_own_op_is_updatable(sim, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, _handlers.REGISTRY_MODULE, None)  # an older torch_npu
    from devgraph import _plugins

    _plugins.forget_devices("npu")
    device = devgraph.device("npu")
    assert device._handlers is None
    assert device.updatable_ops == ("devgraph::paged_decode_attention",)
