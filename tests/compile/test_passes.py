"""The PassManager and the fusion passes on tiny Llama and Qwen3 graphs (traced as devgraph traces them)."""

from __future__ import annotations

import operator

import pytest
import torch
from _fusion_models import FusionConfig, make_tiny_llama, make_tiny_qwen3
from torch.fx.experimental.proxy_tensor import make_fx

import devgraph
from devgraph import hookimpl
from devgraph._plugins import plugin_manager
from devgraph.compile import (
    CompileConfig,
    DevgraphCompiler,
    Pass,
    PassContext,
    PassManager,
    builtin_passes,
    resolve_passes,
)
from devgraph.compile.passes import AddRmsNormFusion, match_rms_norm

TOKENS = 7


def _inputs(kind: str) -> tuple[torch.Tensor, ...]:
    ids = torch.randint(0, 64, (TOKENS,), generator=torch.Generator().manual_seed(0))
    return (ids, torch.arange(TOKENS)) if kind == "qwen3" else (ids,)


def _compile(model, kind: str, passes=None):
    """Trace ``model`` as the piecewise runner does (Dynamo, token dim dynamic); run the fused graph."""
    backend = DevgraphCompiler(devgraph.device("cpu"), CompileConfig(passes=passes))
    args = _inputs(kind)
    for a in args:
        torch._dynamo.mark_dynamic(a, 0)
    with torch.no_grad():
        fused = torch.compile(model, backend=backend, fullgraph=True)(*args)
        eager = model(*args)
    return backend.compiled[-1], fused, eager


_CACHE: dict = {}


def _case(name: str):
    if name not in _CACHE:
        kind, quant, rot, passes = {
            "llama": ("llama", None, None, None),
            "llama-static": ("llama", "static", None, None),
            "llama-dynamic": ("llama", "dynamic", None, None),
            "qwen3": ("qwen3", None, None, None),
            "qwen3-partial-rotary": ("qwen3", None, 4, None),
            "llama-static-only-add-rms-norm": ("llama", "static", None, ["add_rms_norm"]),
        }[name]
        config = FusionConfig(quant=quant, rotary_dim=rot)
        model = make_tiny_qwen3(config) if kind == "qwen3" else make_tiny_llama(config)
        _CACHE[name] = _compile(model, kind, passes)
    return _CACHE[name]


def _targets(graph) -> list:
    return [n.target for n in graph.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize(
    "case, expected",
    [
        ("llama", {"add_rms_norm": 4}),
        ("llama-static", {"add_rms_norm_quant": 3, "add_rms_norm": 1}),
        ("llama-dynamic", {"add_rms_norm_dynamic_quant": 3, "add_rms_norm": 1}),
        ("qwen3", {"split_qkv_rms_norm_rope": 2, "add_rms_norm": 4}),
        ("qwen3-partial-rotary", {"split_qkv_rms_norm_rope": 2, "add_rms_norm": 4}),
        ("llama-static-only-add-rms-norm", {"add_rms_norm": 4}),
    ],
)
def test_each_pass_rewrites_the_expected_number_of_matches(case, expected):
    compiled, _, _ = _case(case)
    assert {k: v for k, v in compiled.pass_counts.items() if v} == expected


@pytest.mark.parametrize(
    "case",
    [
        "llama",
        "llama-static",
        "llama-dynamic",
        "qwen3",
        "qwen3-partial-rotary",
        "llama-static-only-add-rms-norm",
    ],
)
def test_fused_graph_output_matches_the_model(case):
    _, fused, eager = _case(case)
    torch.testing.assert_close(fused, eager, atol=1e-4, rtol=1e-4)


def test_fused_ops_replace_the_pattern_nodes():
    compiled, _, _ = _case("qwen3")
    targets = _targets(compiled.graph)
    assert targets.count(torch.ops.devgraph.split_qkv_rms_norm_rope.default) == 2
    assert targets.count(torch.ops.devgraph.add_rms_norm.default) == 4
    assert torch.ops.aten.split_with_sizes.default not in targets
    assert torch.ops.aten.index_select.default not in targets  # the cos/sin lookup went with it
    # Only the first layer's input norm (no residual add before it) is still written out.
    assert targets.count(torch.ops.aten.rsqrt.default) == 1


def test_quant_fusion_swallows_the_quantisation():
    compiled, _, _ = _case("llama-static")
    targets = _targets(compiled.graph)
    assert targets.count(torch.ops.aten.round.default) == 1  # the unfused first-layer norm's quant only


def test_head_sizes_come_from_the_graph():
    config = FusionConfig(num_heads=8, num_kv_heads=1, head_dim=4, hidden_size=16, num_layers=1)
    compiled, fused, eager = _compile(make_tiny_qwen3(config), "qwen3")
    node = next(
        n
        for n in compiled.graph.graph.nodes
        if n.target == torch.ops.devgraph.split_qkv_rms_norm_rope.default
    )
    assert node.args[5:8] == (8, 1, 4)
    torch.testing.assert_close(fused, eager, atol=1e-4, rtol=1e-4)


def test_bf16_norms_with_float32_round_trips_are_fused():
    model = make_tiny_llama(FusionConfig(dtype=torch.bfloat16))
    compiled, fused, eager = _compile(model, "llama")
    assert compiled.pass_counts["add_rms_norm"] == 4
    # The fused kernel adds in float32 before rounding: bf16-level differences only.
    torch.testing.assert_close(fused.float(), eager.float(), atol=0.1, rtol=0.05)


def test_passes_leave_graphs_without_their_patterns_alone():
    from devgraph.testing.models import DecoderConfig, make_decoder

    model = make_decoder(DecoderConfig(num_layers=1))
    gm = make_fx(lambda x, r: torch.ops.devgraph.add_rms_norm(x, r, model.final_norm, 1e-6)[0])(
        torch.randn(3, 64), torch.randn(3, 64)
    )
    report = PassManager(resolve_passes(None, None))(gm.graph)
    assert set(report.values()) == {0}


def _norm_graph(leak: bool):
    def f(x, r, w):
        s = x + r
        var = s.pow(2).mean(-1, keepdim=True)
        out = w * (s * torch.rsqrt(var + 1e-5))
        return (out, s, var) if leak else (out, s)

    return make_fx(f)(torch.randn(3, 8), torch.randn(3, 8), torch.randn(8))


def test_a_pattern_whose_intermediate_is_used_elsewhere_is_not_fused():
    assert AddRmsNormFusion()(_norm_graph(leak=True).graph) == 0


def test_fused_graph_returns_the_sum_for_the_next_residual():
    gm = _norm_graph(leak=False)
    x, r, w = torch.randn(3, 8), torch.randn(3, 8), torch.rand(8)
    expected = gm(x, r, w)
    assert AddRmsNormFusion()(gm.graph) == 1
    gm.recompile()
    for got, want in zip(gm(x, r, w), expected):
        torch.testing.assert_close(got, want)


def _norm_after_in_place_write(write_operand: bool):
    def f(x, r, w, other):
        s = x + r
        (x if write_operand else other).add_(1)  # between the residual add and the norm reading it
        var = s.pow(2).mean(-1, keepdim=True)
        out = w * (s * torch.rsqrt(var + 1e-5))
        return out, s

    return make_fx(f)(torch.randn(3, 8), torch.randn(3, 8), torch.rand(8), torch.zeros(2))


def test_a_residual_add_whose_operand_is_written_in_place_before_the_norm_is_not_fused():
    gm = _norm_after_in_place_write(write_operand=True)
    args = (torch.randn(3, 8), torch.randn(3, 8), torch.rand(8), torch.zeros(2))
    expected = gm(*(a.clone() for a in args))
    # The fused op would go right before the outputs, after x.add_(1), and read the new x.
    assert AddRmsNormFusion()(gm.graph) == 0
    gm.recompile()
    for got, want in zip(gm(*(a.clone() for a in args)), expected):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    "write",
    [
        lambda x, s: s[:1].zero_(),  # through a view of the residual sum itself
        lambda x, s: x.chunk(2, -1)[0].add_(1),  # through getitem of a list-returning view
    ],
    ids=["view_of_the_sum", "chunk_of_an_operand"],
)
def test_writes_through_views_stop_the_fusion(write):
    def f(x, r, w):
        s = x + r
        write(x, s)
        var = s.pow(2).mean(-1, keepdim=True)
        return w * (s * torch.rsqrt(var + 1e-5)), s

    args = (torch.randn(3, 8), torch.randn(3, 8), torch.rand(8))
    gm = make_fx(f)(*args)
    expected = gm(*(a.clone() for a in args))
    assert AddRmsNormFusion()(gm.graph) == 0
    gm.recompile()
    for got, want in zip(gm(*(a.clone() for a in args)), expected):
        torch.testing.assert_close(got, want)


def test_an_in_place_write_to_another_tensor_does_not_stop_the_fusion():
    assert AddRmsNormFusion()(_norm_after_in_place_write(write_operand=False).graph) == 1


def test_rms_norm_matcher_reads_eps_and_weight_from_the_graph():
    gm = _norm_graph(leak=False)
    out = next(iter(n for n in gm.graph.nodes if n.op == "output")).args[0][0]
    match = match_rms_norm(out)
    assert match is not None and match.eps == pytest.approx(1e-5)
    assert match.weight is [n for n in gm.graph.nodes if n.op == "placeholder"][2]


class _Counting(Pass):
    name = "counting"

    def __init__(self, applicable: bool = True) -> None:
        self.applicable = applicable
        self.calls = 0

    def is_applicable(self, ctx: PassContext) -> bool:
        return self.applicable

    def __call__(self, graph) -> int:
        self.calls += 1
        return sum(1 for n in graph.nodes if n.op == "call_function" and n.target is operator.getitem)


def test_manager_reports_per_pass_and_skips_passes_that_do_not_apply():
    applicable, skipped = _Counting(), _Counting(applicable=False)
    skipped.name = "skipped"
    gm = _norm_graph(leak=False)
    report = PassManager([AddRmsNormFusion(), applicable, skipped])(gm.graph)
    assert report == {"add_rms_norm": 1, "counting": 2}
    assert skipped.calls == 0


def test_manager_uuid_follows_the_pass_list():
    assert PassManager([AddRmsNormFusion()]).uuid() != PassManager([AddRmsNormFusion(), _Counting()]).uuid()
    assert PassManager([_Counting()]).uuid() == PassManager([_Counting()]).uuid()


class _Plugin:
    def __init__(self) -> None:
        self.devices = []
        self.contributed = _Counting()

    @hookimpl
    def devgraph_register_passes(self, register, device):
        self.devices.append(device)
        register(self.contributed)


@pytest.fixture
def contributing_plugin():
    plugin = _Plugin()
    pm = plugin_manager()
    pm.register(plugin, name="test-contributed-pass")
    yield plugin
    pm.unregister(plugin)


def test_backends_contribute_passes_through_the_hook(contributing_plugin):
    dev = devgraph.device("cpu")
    passes = resolve_passes(None, dev)
    assert passes[-1] is contributing_plugin.contributed and contributing_plugin.devices == [dev]
    assert [p.name for p in resolve_passes(["counting"], dev)] == ["counting"]
    assert PassManager(passes).uuid() != PassManager(builtin_passes()).uuid()


def test_contributed_passes_run_in_the_backend(contributing_plugin):
    compiled, _, _ = _compile(make_tiny_llama(FusionConfig(num_layers=1)), "llama")
    assert contributing_plugin.contributed.calls == 1 and "counting" in compiled.pass_counts
