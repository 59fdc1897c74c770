"""CompileConfig, splitting-op names, compilers (compile_backend), and how devgraph.wrap routes piecewise options."""

from __future__ import annotations

import warnings

import attrs
import pytest
import torch

import devgraph
from devgraph import DevgraphError
from devgraph.compile import (
    CompileConfig,
    Pass,
    compile_option_names,
    compile_piece,
    resolve_passes,
    resolve_splitting_ops,
)
from devgraph.compile.passes import AddRmsNormFusion
from devgraph.runner import GraphRunner, RunnerConfig


class _Renamed(AddRmsNormFusion):
    """The same rewrite under a new version: a changed pass must change the cache key."""

    version = 2


def test_config_is_frozen_and_validates_mode_and_backend():
    config = CompileConfig()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        config.mode = "full"  # type: ignore[misc]
    with pytest.raises(DevgraphError, match="mode must be one of"):
        CompileConfig(mode="partial")
    with pytest.raises(DevgraphError, match="compile_backend must be a compiler's name"):
        CompileConfig(compile_backend="")


def test_a_compiler_the_device_lacks_is_refused_naming_the_ones_it_has():
    with pytest.raises(
        DevgraphError, match=r"compile_backend='tvm' is not a compiler of cpu.*'eager', 'inductor'"
    ):
        devgraph.wrap(torch.nn.Linear(4, 4), device="cpu", mode="piecewise", compile_backend="tvm")


def test_backends_contribute_compilers_for_their_device_only(npu_sim):
    from devgraph.compile import compilers_for

    assert sorted(compilers_for(devgraph.device("cpu"))) == ["eager", "inductor"]
    assert sorted(compilers_for(devgraph.device("npu"))) == ["eager", "inductor", "torchair"]


def test_unknown_splitting_op_is_a_clear_error():
    with pytest.raises(DevgraphError, match=r"unknown splitting op 'devgraph::flash_attn'.*namespace::op"):
        CompileConfig(splitting_ops=["devgraph::flash_attn"])
    with pytest.raises(DevgraphError, match=r"not a qualified op name.*'aten::scaled_dot_product_attention'"):
        CompileConfig(splitting_ops=["scaled_dot_product_attention"])
    with pytest.raises(DevgraphError, match="has overloads"):
        CompileConfig(splitting_ops=["aten::mm.nope"])


def test_splitting_ops_always_include_devgraph_attention():
    names = resolve_splitting_ops(["aten::scaled_dot_product_attention", "aten::mm.default"])
    assert names == ("devgraph::paged_decode_attention", "aten::scaled_dot_product_attention", "aten::mm")


def test_changing_the_pass_list_changes_the_cache_key():
    base = CompileConfig(passes=["add_rms_norm"])
    assert base.uuid() == CompileConfig(passes=["add_rms_norm"]).uuid()
    assert base.uuid() != CompileConfig(passes=["add_rms_norm", "split_qkv_rms_norm_rope"]).uuid()
    assert base.uuid() != CompileConfig(passes=()).uuid()
    assert base.uuid() != CompileConfig(passes=[_Renamed()]).uuid()
    assert CompileConfig().uuid() != CompileConfig(passes=()).uuid()


def test_runner_cache_key_folds_the_compile_config():
    dev = devgraph.device("cpu")
    model = torch.nn.Linear(4, 4)
    keys = {
        GraphRunner(model, dev, RunnerConfig(), CompileConfig(passes=p)).pieces.cache_key
        for p in (None, (), ("add_rms_norm",))
    }
    assert len(keys) == 3


def test_every_other_field_changes_the_uuid():
    base = CompileConfig()
    variants = [
        CompileConfig(mode="full_and_piecewise"),
        CompileConfig(splitting_ops=["aten::mm"]),
        CompileConfig(compile_backend="inductor"),
        CompileConfig(capture_sizes=[4, 8]),
        CompileConfig(capture_budget=64),
        CompileConfig(traffic={4: 1.0}),
        CompileConfig(is_decode=lambda **kw: True),
    ]
    assert len({base.uuid(), *(v.uuid() for v in variants)}) == len(variants) + 1


def test_unknown_pass_name_lists_the_known_ones():
    with pytest.raises(DevgraphError, match=r"unknown pass 'fuse_everything'; known passes: .*add_rms_norm"):
        resolve_passes(["fuse_everything"], None)


def test_default_passes_are_the_builtins_in_order():
    names = [p.name for p in resolve_passes(None, devgraph.device("cpu"))]
    assert names[:4] == [
        "split_qkv_rms_norm_rope",
        "add_rms_norm_quant",
        "add_rms_norm_dynamic_quant",
        "add_rms_norm",
    ]
    assert all(isinstance(p, Pass) for p in resolve_passes(None, None)[:4])


def test_device_default_compile_backend_is_eager_unless_the_device_says_otherwise():
    dev = devgraph.device("cpu")
    assert CompileConfig().compiler_for(dev) == "eager"
    assert CompileConfig(compile_backend="inductor").compiler_for(dev) == "inductor"


def test_torchair_without_torch_npu_is_a_clear_error():
    from devgraph.backends.npu._compilers import torchair

    gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    with pytest.raises(DevgraphError, match=r"compile_backend='torchair' needs torchair"):
        torchair(gm, [torch.zeros(2)])


def test_an_unknown_compiler_names_the_ones_there_are():
    gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    with pytest.raises(DevgraphError, match=r"unknown compile_backend 'torchair'.*\['eager', 'inductor'\]"):
        compile_piece("torchair", "submod_0", gm, [torch.zeros(2)])


def test_compile_option_names_exclude_the_shared_mode():
    names = compile_option_names()
    assert "mode" not in names and {"splitting_ops", "compile_backend", "passes", "capture_sizes"} <= set(
        names
    )


@pytest.mark.parametrize("frontend", ["dynamo", "raw"])
def test_wrap_routes_piecewise_options_to_the_compile_config(frontend):
    model = torch.nn.Linear(4, 4)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "devgraph: .*without Dynamo's guards", UserWarning)  # raw
        graphed = devgraph.wrap(
            model,
            device="cpu",
            mode="piecewise",
            frontend=frontend,
            splitting_ops=["aten::scaled_dot_product_attention"],
            compile_backend="eager",
            passes=["add_rms_norm"],
            capture_sizes=[2, 4],
            max_batch_size=8,
        )
    if frontend == "raw":
        runner = graphed.runner
    else:  # Dynamo's graphs get their runners as it hands them over, at the first call
        with torch.no_grad():
            torch.testing.assert_close(graphed(torch.ones(3, 4)), model(torch.ones(3, 4)))
        (runner,) = graphed.graphs.runners
    assert runner.pieces is not None and runner.full is None
    assert runner.pieces.compile_config.splitting_ops == ("aten::scaled_dot_product_attention",)
    assert runner.pieces.compile_config.passes == ("add_rms_norm",)
    assert runner.pieces.compile_config.compile_backend == "eager"
    assert runner.sizes == [2, 4] and runner.config.max_batch_size == 8
    assert runner.config.mode == runner.pieces.compile_config.mode == "piecewise"


def test_wrap_rejects_compile_options_in_full_mode():
    with pytest.raises(DevgraphError, match=r"\['splitting_ops'\] apply to mode='piecewise'"):
        devgraph.wrap(torch.nn.Linear(4, 4), device="cpu", splitting_ops=["aten::mm"])


def test_wrap_names_unknown_options_with_compile_options_listed():
    with pytest.raises(DevgraphError, match=r"unknown option\(s\) \['bogus'\].*splitting_ops"):
        devgraph.wrap(torch.nn.Linear(4, 4), device="cpu", mode="piecewise", bogus=1)


def test_full_and_piecewise_needs_a_decode_classifier():
    with pytest.raises(DevgraphError, match="is_decode"):
        devgraph.wrap(torch.nn.Linear(4, 4), device="cpu", mode="full_and_piecewise")


def test_backends_declare_their_default_compile_backend():
    from devgraph.backends.cuda._device import CudaDevice

    assert devgraph.device("cpu").default_compile_backend == "eager"
    assert CudaDevice.default_compile_backend == "inductor"


def test_npu_default_compile_backend_is_eager_without_torchair(npu_sim):
    assert devgraph.device("npu").default_compile_backend == "eager"


def test_runner_config_survives_evolve():
    import attrs

    from devgraph.runner import RunnerConfig

    config = RunnerConfig(pad_values={"a": 1}, host_args=["lens"], batch_dims={"x": 1})
    again = attrs.evolve(config, mode="piecewise")
    assert again.pad_values == config.pad_values and again.host_args == config.host_args
    assert again.batch_dims == config.batch_dims and again.mode == "piecewise"


def test_torchair_off_an_npu_is_a_clear_error_when_the_runner_is_built():
    with pytest.raises(DevgraphError, match=r"compile_backend='torchair' is not a compiler of cpu"):
        devgraph.wrap(torch.nn.Linear(4, 4), device="cpu", mode="piecewise", compile_backend="torchair")


def test_uuid_on_a_device_folds_the_effective_backend_and_stream_budget():
    dev = devgraph.device("cpu")
    # On cpu the default backend is eager and there is no budget: spelling them out changes nothing.
    assert CompileConfig().uuid(dev) == CompileConfig(compile_backend="eager").uuid(dev)
    assert CompileConfig().uuid(dev) != CompileConfig(compile_backend="inductor").uuid(dev)

    class Budgeted(type(dev)):  # type: ignore[misc]
        capture_stream_budget = 64
        default_compile_backend = "inductor"

    budgeted = Budgeted()
    assert CompileConfig().uuid(budgeted) == CompileConfig(
        compile_backend="inductor", capture_budget=64
    ).uuid(budgeted)
    assert CompileConfig().uuid(budgeted) != CompileConfig().uuid(dev)


def test_composite_splitting_ops_are_matched_with_their_namespace():
    from devgraph.compile._splitting_ops import keep_composite_ops_whole

    lib = torch.library.Library("devgraph_ns_test", "FRAGMENT")
    lib.define("scaled_dot_product_attention(Tensor q, Tensor k, Tensor v) -> Tensor")
    lib.impl("scaled_dot_product_attention", lambda q, k, v: q, "CompositeImplicitAutograd")

    def attend(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    gm = torch.fx.symbolic_trace(attend)
    # Same op name, other namespace: aten's SDPA must not be re-targeted to it.
    assert keep_composite_ops_whole(gm, ["devgraph_ns_test::scaled_dot_product_attention"]) == 0
    assert keep_composite_ops_whole(gm, ["aten::scaled_dot_product_attention"]) == 1
