"""vLLM's CPU kernels (``torch.ops._C.*``) in devgraph's graphs, without an engine.

With ``DEVGRAPH_VLLM=1`` on vLLM's CPU platform the model runs vLLM's custom ops (rotary, SiLU-and-mul,
RMSNorm, ...) as ``enforce_eager`` does: their C++ kernels. The config check resolves them so
(vLLM's own rule applied to the compilation devgraph runs, which is never inductor), and each
kernel the tiny test models reach is recorded by the CPU reference and replayed on the memory it
was captured on: every output, written in place (``Tensor(a!)`` arguments), equals vLLM's kernel
run eagerly on the replay's inputs, bit for bit.
"""

from __future__ import annotations

import os

import pytest
import torch
from vllm import _custom_ops as vllm_ops

import devgraph

# -- the config check: which implementation vLLM's custom ops resolve to -------------------------


@pytest.fixture
def cpu_platform():
    from _fake_engine import platform_on

    saved = dict(os.environ)  # vLLM's config resolution sets process-wide variables
    try:
        with platform_on("cpu") as platform:
            yield platform
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _compilation(model, *, enforce_eager=False, **compilation):
    """The compilation config vLLM builds for the tiny model (the current platform's check included)."""
    from vllm.config import CompilationConfig, ModelConfig, VllmConfig

    config = VllmConfig(
        model_config=ModelConfig(
            model=str(model), dtype="float32", max_model_len=128, enforce_eager=enforce_eager
        ),
        compilation_config=CompilationConfig(**compilation),
    )
    return config.compilation_config


def _base(cc) -> list[str]:
    return [op for op in cc.custom_ops if op in ("all", "none")]


@pytest.mark.parametrize(
    "compilation",
    [{}, {"cudagraph_mode": "FULL"}, {"cudagraph_mode": "PIECEWISE"}],
    ids=["default", "FULL", "PIECEWISE"],
)
def test_graph_modes_resolve_vllms_custom_ops_to_its_kernels_as_enforce_eager_does(
    cpu_platform, tiny_model, compilation
):
    # vLLM picks "none" (torch implementations, for inductor) for these configs; devgraph runs them
    # uncompiled or as eager pieces, never through inductor: "all", what enforce_eager gets.
    cc = _compilation(tiny_model, **compilation)
    assert cc.backend != "inductor" or cc.mode.name == "NONE"
    assert _base(cc) == ["all"]
    assert _base(_compilation(tiny_model, enforce_eager=True)) == ["all"]


def test_a_base_mode_the_user_chose_stays(cpu_platform, tiny_model):
    assert _base(_compilation(tiny_model, custom_ops=["none"])) == ["none"]
    assert _base(_compilation(tiny_model, custom_ops=["none", "+rotary_embedding"])) == ["none"]


def test_without_graphs_vllms_own_choice_stays(cpu_platform, tiny_model):
    # No graphs, no enforce_eager: devgraph leaves vLLM's CPU compilation (a Dynamo trace for
    # inductor) and its choice for it.
    cc = _compilation(tiny_model, cudagraph_mode="NONE")
    assert cc.backend == "inductor" and cc.mode.name != "NONE"
    assert _base(cc) == ["none"]


# -- each kernel the test models reach, captured and replayed ------------------------------------


def _replays_as_eager(make_inputs, call):
    """Capture ``call(inputs)`` in a CPU reference graph; write new values into the inputs; replay.

    Every tensor the call writes (returned, or written in place) must equal ``call`` run eagerly on
    copies of the new inputs, bit for bit, and must differ from what the capture computed (so an
    entry the replay skipped would show).
    """
    torch.manual_seed(0)
    inputs = make_inputs()
    graph = devgraph.device("cpu").graph()
    with torch.inference_mode():
        with graph.capture():
            outs = call(inputs)
        captured = [o.clone() for o in outs]
        for name, fresh in make_inputs().items():
            inputs[name].copy_(fresh)
        expected = call({name: t.clone() for name, t in inputs.items()})
        graph.replay()
    assert len(outs) == len(expected)
    for out, want, before in zip(outs, expected, captured):
        assert not torch.equal(want, before)  # the replay has something new to compute
        assert torch.equal(out, want)


def _rotary_inputs():
    tokens, heads, kv_heads, head = 5, 4, 2, 32
    return {
        "positions": torch.randint(0, 64, (tokens,)),
        "query": torch.randn(tokens, heads * head),
        "key": torch.randn(tokens, kv_heads * head),
        "cache": torch.randn(128, head),
    }


def _rotary(t):
    # In place on query and key (vLLM's RotaryEmbedding.forward_cpu).
    vllm_ops.rotary_embedding(t["positions"], t["query"], t["key"], 32, t["cache"], True)
    return [t["query"], t["key"]]


#: Weights (made before the capture, once): not inputs a step rewrites.
_WEIGHTS: dict[str, torch.Tensor] = {}


def _linear_inputs():
    if "handler" not in _WEIGHTS:
        # vLLM's CPU linear layers (``dispatch_cpu_unquantized_gemm``) prepack the weight for oneDNN.
        _WEIGHTS["handler"] = vllm_ops.create_onednn_mm(torch.randn(96, 128).t(), 32)
    return {"x": torch.randn(5, 128)}


def _linear(t):
    return [vllm_ops.onednn_mm(_WEIGHTS["handler"], t["x"], None)]  # its output written in place


def _moe_inputs():
    experts, hidden, inter, tokens, topk = 4, 128, 64, 5, 2
    if "w13" not in _WEIGHTS:
        _WEIGHTS["w13"] = vllm_ops.cpu_prepack_moe_weight(torch.randn(experts, 2 * inter, hidden), "vec")
        _WEIGHTS["w2"] = vllm_ops.cpu_prepack_moe_weight(torch.randn(experts, hidden, inter), "vec")
    ids = torch.stack([torch.randperm(experts)[:topk] for _ in range(tokens)]).to(torch.int32)
    return {"x": torch.randn(tokens, hidden), "ids": ids, "weights": torch.rand(tokens, topk)}


def _moe(t):
    # vLLM's CPU fused MoE experts (CPUUnquantizedExperts.apply): the output written in place.
    out = torch.empty_like(t["x"])
    vllm_ops.cpu_fused_moe(
        out, t["x"], _WEIGHTS["w13"], _WEIGHTS["w2"], None, None, t["weights"], t["ids"], "silu", "vec"
    )
    return [out]


def _silu_and_mul(t):
    out = torch.empty(t["x"].shape[0], t["x"].shape[1] // 2)
    torch.ops._C.silu_and_mul(out, t["x"])
    return [out]


def _rms_norm(t):
    out = torch.empty_like(t["x"])
    vllm_ops.rms_norm(out, t["x"], t["w"], 1e-6)
    return [out]


def _fused_add_rms_norm(t):
    vllm_ops.fused_add_rms_norm(t["x"], t["residual"], t["w"], 1e-6)  # in place on both
    return [t["x"], t["residual"]]


def _norm_inputs():
    return {"x": torch.randn(5, 128), "residual": torch.randn(5, 128), "w": torch.randn(128)}


KERNELS = {
    # what the tiny Llama, Qwen2 and Qwen2-MoE run on x86 with enforce_eager (besides the attention)
    "rotary_embedding": (_rotary_inputs, _rotary),
    "onednn_mm": (_linear_inputs, _linear),
    "cpu_fused_moe": (_moe_inputs, _moe),
    # vLLM's CPU kernels for SiLU-and-mul and RMSNorm (its Arm/PowerPC paths, other priorities)
    "silu_and_mul": (_linear_inputs, _silu_and_mul),
    "rms_norm": (_norm_inputs, _rms_norm),
    "fused_add_rms_norm": (_norm_inputs, _fused_add_rms_norm),
}


@pytest.mark.parametrize("name", list(KERNELS))
def test_vllm_cpu_kernel_captured_replays_as_vllm_runs_it(name):
    op = getattr(torch.ops._C, name).default
    assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), torch._C.DispatchKey.CPU)
    assert any(a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments)
    make_inputs, call = KERNELS[name]
    _replays_as_eager(make_inputs, call)
