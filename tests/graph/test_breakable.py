"""Breakable capture (devgraph.graph.BreakableGraph): segments cut at break ops, equal or refused.

Every behaviour runs on the CPU reference and on the NPU backend over the torch_npu simulator
(``any_device``).
"""

from __future__ import annotations

import pytest
import torch

import devgraph
from devgraph import CaptureError, DevgraphError
from devgraph.graph import BreakableGraph, CapturedBreak, break_ops, mark_break, marked_breaks, unmark_break
from devgraph.testing.models import DecoderConfig, KVBlockManager, make_decoder
from devgraph.testing.varlen import VARLEN_ATTENTION, VarlenDecoder, packed_batch


def _decoder_case(device, num_layers=3):
    dtype = torch.bfloat16 if device.name == "npu" else torch.float32
    config = DecoderConfig(num_layers=num_layers, dtype=dtype)
    model = make_decoder(config, device=device.torch_device)
    blocks = KVBlockManager(config, device=device.torch_device)
    first = blocks.decode_batch([0, 1, 2, 3], [5, 17, 42, 3])
    static = {k: v.clone() if isinstance(v, torch.Tensor) else list(v) for k, v in first.items()}
    return model, blocks, static


def _load(static, batch):
    for name, value in batch.items():
        if isinstance(value, torch.Tensor):
            static[name].copy_(value)


def _capture_decoder(device, model, static):
    bg = BreakableGraph(device)
    with torch.no_grad():
        model(**static)  # warm-up
        with bg.capture(host_args={"seq_lens_host": static["seq_lens_host"]}):
            out = model(**static)
    return bg, out


def _decode_steps(model, blocks, static, bg, out, steps=4):
    """(replayed, eager) logits of ``steps`` decode steps whose lengths differ from capture's."""
    results = []
    for step in range(steps):
        batch = blocks.decode_batch([0, 1, 2, 3], [7 + step, 8, 9 + 2 * step, 1])
        with torch.no_grad():
            eager = model(**batch)
        _load(static, batch)
        bg.replay(host_args={"seq_lens_host": batch["seq_lens_host"]})
        results.append((out.clone(), eager))
    return results


def test_decoder_replay_equals_eager_over_calls_with_new_lengths(any_device):
    model, blocks, static = _decoder_case(any_device)
    bg, out = _capture_decoder(any_device, model, static)
    assert len(bg.graphs) == 4 and len(bg.captured_breaks) == 3  # a break per layer's attention
    assert {b.op for b in bg.captured_breaks} == {"devgraph::paged_decode_attention"}
    for replayed, eager in _decode_steps(model, blocks, static, bg, out):
        torch.testing.assert_close(replayed, eager)


def test_breaks_not_rerun_make_the_decoder_test_fail(any_device, monkeypatch):
    model, blocks, static = _decoder_case(any_device)
    bg, out = _capture_decoder(any_device, model, static)
    monkeypatch.setattr(CapturedBreak, "run", lambda self, host_args: None)
    replayed, eager = _decode_steps(model, blocks, static, bg, out, steps=1)[0]
    assert not torch.allclose(replayed.float(), eager.float(), atol=1e-2)


def test_breaks_replayed_with_frozen_lengths_make_the_decoder_test_fail(any_device):
    if any_device.name == "cuda":
        pytest.skip("CUDA's paged attention reads the lengths from the device tensor (DEVICE_METADATA_OPS)")
    model, blocks, static = _decoder_case(any_device)
    bg, out = _capture_decoder(any_device, model, static)
    batch = blocks.decode_batch([0, 1, 2, 3], [7, 8, 9, 1])
    with torch.no_grad():
        eager = model(**batch)
    _load(static, batch)
    bg.replay()  # no host_args: the capture's lengths, stale as on a device
    assert not torch.allclose(out.float(), eager.float(), atol=1e-2)


def _varlen_case(device, num_layers=2):
    model = VarlenDecoder(num_layers=num_layers).to(device.torch_device)
    if device.name == "npu":
        model = model.to(torch.bfloat16)
    static = _on(device, packed_batch([3, 5, 4]))
    with torch.no_grad():
        model(**static)  # warm-up (CUDA: cuBLAS creates its handle on first use, never inside a capture)
    return model, static


def _on(device, batch):
    """A packed batch with its token ids on ``device`` (its ``cu_seqlens`` stay a host list)."""
    return {k: v.to(device.torch_device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def test_varlen_prefill_marked_as_break_equals_eager_for_new_splits(any_device):
    model, static = _varlen_case(any_device)
    bg = BreakableGraph(any_device, breaks=[VARLEN_ATTENTION])
    with torch.no_grad():
        with bg.capture():
            out = model(**static)
        for seed, lengths in enumerate([[12], [1, 1, 10], [6, 6], [2, 3, 4, 3]], start=1):
            batch = _on(any_device, packed_batch(lengths, seed=seed))
            static["input_ids"].copy_(batch["input_ids"])
            bg.replay(host_args={"cu_seqlens": batch["cu_seqlens"]})
            torch.testing.assert_close(out, model(**batch))


def test_fresh_break_results_not_written_back_make_the_varlen_test_fail(any_device, monkeypatch):
    model, static = _varlen_case(any_device)
    bg = BreakableGraph(any_device, breaks=[VARLEN_ATTENTION])
    with torch.no_grad():
        with bg.capture():
            out = model(**static)
        assert all(b._outs for b in bg.captured_breaks)  # its results went to pool buffers
        for b in bg.captured_breaks:
            monkeypatch.setattr(b, "_outs", [])
        batch = _on(any_device, packed_batch([1, 1, 10], seed=3))
        static["input_ids"].copy_(batch["input_ids"])
        bg.replay(host_args={"cu_seqlens": batch["cu_seqlens"]})
        assert not torch.allclose(out.float(), model(**batch).float(), atol=1e-2)


def test_unmarked_varlen_attention_is_refused_by_name_and_line(any_device):
    """torchtitan #3685: an attention op with per-call host lengths that nobody marked as a break."""
    model, static = _varlen_case(any_device)
    bg = BreakableGraph(any_device)
    with torch.no_grad(), pytest.raises(CaptureError) as err:
        with bg.capture():
            model(**static)
    assert err.value.op == VARLEN_ATTENTION
    assert "cu_seqlens=[0, 3, 8, 12]" in str(err.value)
    assert (
        "varlen.py" in (err.value.source or "")
        and "varlen_attention(q, k, v, cu_seqlens)" in err.value.source
    )
    assert "mark it as a break" in (err.value.remedy or "")
    assert not bg.is_captured()


def test_a_plain_graph_captures_the_unmarked_op_silently_wrong():
    """Why the refusal matters: a whole-graph capture of the same model replays the capture's split."""
    device = devgraph.device("cpu")
    model, static = _varlen_case(device)
    graph = device.graph()
    with torch.no_grad():
        with graph.capture():
            out = model(**static)
        batch = packed_batch([1, 1, 10], seed=3)
        static["input_ids"].copy_(batch["input_ids"])
        graph.replay()
        assert not torch.allclose(out, model(**batch), atol=1e-3)


def test_segments_share_one_pool_and_the_breaks_hold_pool_memory_weakly(any_device):
    model, static = _varlen_case(any_device)
    pool = any_device.pool()
    bg = BreakableGraph(any_device, breaks=[VARLEN_ATTENTION])
    with torch.no_grad(), bg.capture(pool=pool):
        model(**static)
    assert bg.pool() is pool and all(g.pool() is pool for g in bg.graphs)
    q = bg.captured_breaks[0]._args[0]  # made in segment 0
    if any_device.torch_device.type == "cpu":  # the reference's (and simulator's) pool blocks
        from devgraph.backends.cpu._pool import block_of

        block = block_of(q)
        assert block is not None and not block.in_use()  # held weakly: the pool may reuse it
    # (A device pool's blocks are opaque: there the weak hold is the contract's Device.weak_ref.)
    assert bg.captured_breaks[0].host_args["cu_seqlens"] == [0, 3, 8, 12]


def test_host_args_no_break_takes_are_refused(any_device):
    model, _, static = _decoder_case(any_device, num_layers=1)
    bg, _ = _capture_decoder(any_device, model, static)
    with pytest.raises(DevgraphError, match=r"takes host argument\(s\) \[.seq_len.\]"):
        bg.replay(host_args={"seq_len": [1, 2, 3, 4]})


def test_a_declared_host_value_read_inside_a_segment_is_refused():
    device = devgraph.device("cpu")
    lengths = [2, 2]
    x = torch.randn(4, 3)
    bg = BreakableGraph(device)
    with pytest.raises(CaptureError, match="per-call host value 'lens'") as err:
        with bg.capture(host_args={"lens": lengths}):
            torch.split(x * 2, lengths)
    assert "test_breakable.py" in (err.value.source or "")


def test_a_break_called_inside_a_python_bodied_op_is_refused():
    @torch.library.custom_op("devgraph_testing::outer_op", mutates_args=())
    def outer(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.devgraph_testing.inner_break(x)

    @torch.library.custom_op("devgraph_testing::inner_break", mutates_args=())
    def inner(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    inner.register_fake(lambda x: torch.empty_like(x))
    outer.register_fake(lambda x: torch.empty_like(x))
    device = devgraph.device("cpu")
    bg = BreakableGraph(device, breaks=["devgraph_testing::inner_break"])
    with pytest.raises(CaptureError, match="break op reached a segment") as err:
        with bg.capture():
            outer(torch.randn(3) + 1)
    assert err.value.op == "devgraph_testing::inner_break"
    # Marking the outer op instead serves it.
    bg = BreakableGraph(device, breaks=["devgraph_testing::outer_op"])
    x = torch.randn(3)
    with bg.capture():
        y = outer(x + 1)
    x.copy_(torch.ones(3))
    bg.replay()
    torch.testing.assert_close(y, torch.full((3,), 4.0))


def test_a_torch_function_marked_as_a_break_runs_eagerly(any_device):
    """F.scaled_dot_product_attention is a torch function: marked by its aten name, it is a break."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8, device=any_device.torch_device) for _ in range(3))
    w = torch.randn(8, 8, device=any_device.torch_device)
    bg = BreakableGraph(any_device, breaks=["aten::scaled_dot_product_attention"])
    with bg.capture():
        out = torch.nn.functional.scaled_dot_product_attention(q @ w, k, v, is_causal=True) @ w
    assert [b.op for b in bg.captured_breaks] == ["aten::scaled_dot_product_attention"]
    for t in (q, k, v):
        t.copy_(torch.randn_like(t))
    bg.replay()
    torch.testing.assert_close(
        out, torch.nn.functional.scaled_dot_product_attention(q @ w, k, v, is_causal=True) @ w
    )


def test_mark_break_by_name_or_op_and_unmark():
    import devgraph.testing.varlen as varlen

    assert VARLEN_ATTENTION not in break_ops()
    try:
        mark_break(varlen.varlen_attention)
        assert VARLEN_ATTENTION in marked_breaks() and VARLEN_ATTENTION in break_ops()
        mark_break(f"{VARLEN_ATTENTION}.default")  # an overload spelling stands for the op
        assert marked_breaks().count(VARLEN_ATTENTION) == 1
    finally:
        unmark_break(VARLEN_ATTENTION)
    assert VARLEN_ATTENTION not in break_ops()
    assert break_ops()[0] == "devgraph::paged_decode_attention"


def test_mark_break_refuses_an_unknown_op_saying_how_to_spell_one():
    with pytest.raises(DevgraphError, match="spell a break op 'namespace::op'"):
        mark_break("devgraph_testing::no_such_op")
    with pytest.raises(DevgraphError, match="not a qualified op name"):
        mark_break("varlen_attention")


def test_plugins_contribute_break_ops_per_device(fresh_plugins):
    from devgraph._plugins import plugin_manager

    seen = []

    class Plugin:
        @devgraph.hookimpl
        def devgraph_register_break_ops(self, register, device):
            seen.append(device)
            if device is not None and device.name == "cpu":
                register(VARLEN_ATTENTION)

    plugin = Plugin()
    plugin_manager().register(plugin)
    try:
        device = devgraph.device("cpu")
        assert VARLEN_ATTENTION in BreakableGraph(device).breaks
        assert VARLEN_ATTENTION not in break_ops(None)
        assert device in seen
    finally:
        plugin_manager().unregister(plugin)


def test_a_failed_capture_releases_every_segment_graph():
    device = devgraph.device("cpu")
    model, static = _varlen_case(device)
    pool = device.pool()
    bg = BreakableGraph(device, breaks=[VARLEN_ATTENTION])
    with pytest.raises(CaptureError):
        with torch.no_grad(), bg.capture(pool=pool):
            model(**static).sum().item()  # a host sync in the last segment
    assert not bg.is_captured() and not pool._users()
    with pytest.raises(DevgraphError, match="never captured"):
        bg.replay()


def test_capture_twice_needs_reset(any_device):
    bg = BreakableGraph(any_device)
    x = torch.ones(2, device=any_device.torch_device)
    with bg.capture():
        y = x + 1
    with pytest.raises(DevgraphError, match="reset"):
        with bg.capture():
            pass
    bg.reset()
    with bg.capture():
        y = x * 3
    bg.replay()
    torch.testing.assert_close(y, torch.full((2,), 3.0, device=any_device.torch_device))


def test_a_break_inside_compiled_code_is_refused_naming_the_compiled_call():
    device = devgraph.device("cpu")
    model, static = _varlen_case(device)
    compiled = torch.compile(model, backend="eager")
    bg = BreakableGraph(device, breaks=[VARLEN_ATTENTION])
    with torch.no_grad(), pytest.raises(CaptureError, match=r"torch\.compile'd graph") as err:
        compiled(**static)
        with bg.capture():
            compiled(**static)
    assert err.value.op == VARLEN_ATTENTION and "varlen.py" in (err.value.source or "")
    assert "compile the code between the breaks" in (err.value.remedy or "")


def test_compiled_code_between_breaks_is_captured_in_its_segment():
    device = devgraph.device("cpu")
    model, static = _varlen_case(device)
    for layer in model.layers:  # compile the MLPs, not the attention
        layer.up = torch.compile(layer.up, backend="aot_eager")
    bg = BreakableGraph(device, breaks=[VARLEN_ATTENTION])
    with torch.no_grad():
        model(**static)
        with bg.capture():
            out = model(**static)
        batch = packed_batch([4, 8], seed=5)
        static["input_ids"].copy_(batch["input_ids"])
        bg.replay(host_args={"cu_seqlens": batch["cu_seqlens"]})
        torch.testing.assert_close(out, model(**batch))


def test_a_custom_op_reading_a_cpu_tensor_on_a_device_is_refused():
    """The rule behind it (a device graph's kernel reads host memory once, at launch), checked
    directly: the CPU reference and the simulator keep every tensor on the CPU."""
    from devgraph.graph._segment_check import refusal

    op = torch.ops.devgraph_testing.varlen_attention.default
    q = torch.randn(4, 2, 8)
    assert "reads a CPU tensor (4, 2, 8)" in refusal(op, (q, q, q, []), {}, allowed=(), device_type="cuda")
    assert refusal(op, (q, q, q, []), {}, allowed=(), device_type="cpu") is None
    assert "host list cu_seqlens=[0, 4]" in refusal(op, (q, q, q, [0, 4]), {}, allowed=(), device_type="cpu")
    assert refusal(op, (q, q, q, [0, 4]), {}, allowed={VARLEN_ATTENTION}, device_type="cpu") is None
