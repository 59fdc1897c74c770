"""devgraph.wrap's sharp edges: torch devices, module methods that return the module, options that
name nothing, bad batch sizes, eager fallback errors, and ``devgraph.ops`` after a plain import."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import traceback
import warnings

import pytest
import torch

import devgraph
from devgraph import DevgraphError


class Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x, slot):
        return self.drop(self.lin(x)) + slot[:, None]


def _inputs(n: int = 2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g), torch.arange(n, dtype=torch.float32)


# -- devices ----------------------------------------------------------------------------------


def test_wrap_accepts_a_torch_device():
    graphed = devgraph.wrap(Scaled().eval(), device=torch.device("cpu"), batch_sizes=[2])
    assert graphed.device is devgraph.device("cpu")


def test_device_accepts_a_torch_device_with_its_index():
    assert devgraph.device(torch.device("cpu", 0)) is devgraph.device("cpu", 0)


def test_device_of_something_else_names_what_it_takes():
    with pytest.raises(DevgraphError, match=r"a torch\.device or a devgraph\.Device"):
        devgraph.device(3.5)


# -- nn.Module methods keep the wrapper -------------------------------------------------------


@pytest.mark.parametrize("method", ["eval", "train", "requires_grad_", "float", "to"])
def test_module_methods_return_the_wrapper(method):
    graphed = devgraph.wrap(Scaled().eval(), device="cpu", batch_sizes=[2])
    args = (torch.float32,) if method == "to" else ()
    assert getattr(graphed, method)(*args) is graphed


def test_eval_after_capture_in_train_mode_captures_again_and_equals_eager():
    model = Scaled().train()
    graphed = devgraph.wrap(model, device="cpu", batch_sizes=[2])
    with pytest.warns(UserWarning, match="training mode"):
        graphed(*_inputs())  # captured with dropout on
    graphed.eval()  # on the wrapper, as on the model
    x, slot = _inputs(seed=1)
    torch.testing.assert_close(graphed(x, slot), model(x, slot))


class Embed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(16, 4)

    def forward(self, ids):
        return self.emb(ids) * 2


def test_a_cast_after_capture_captures_again_in_the_new_dtype():
    model = Embed()
    graphed = devgraph.wrap(model, device="cpu", batch_sizes=[2])
    ids = torch.tensor([3, 5])
    graphed(ids)
    graphed.double()  # integer inputs: the call still matches the captured one
    out = graphed(ids)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, model(ids))


def _raw(model, **options):
    """``devgraph.wrap(model, frontend="raw", ...)`` (its one warning of what it leaves unchecked is
    expected, not counted)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*captures the forward as it runs, untraced")
        return devgraph.wrap(model, frontend="raw", **options)


def _runner(graphed):
    """The one runner of a wrapper: the raw path's, or that of the one graph Dynamo handed over."""
    if isinstance(graphed, devgraph.frontend.TracedModule):
        (runner,) = graphed.graphs.runners
        return runner
    return graphed.runner


@pytest.mark.parametrize("frontend", ["raw", "dynamo"])
def test_methods_that_change_nothing_keep_the_graphs(frontend):
    graphed = _raw(Scaled().eval(), device="cpu", batch_sizes=[2]) if frontend == "raw" else None
    graphed = graphed or devgraph.wrap(Scaled().eval(), device="cpu", batch_sizes=[2])
    graphed(*_inputs())
    runner = _runner(graphed)
    graph = runner.graph(2)
    graphed.eval().requires_grad_(False).to("cpu")
    assert _runner(graphed) is runner and runner.graph(2) is graph
    graphed(*_inputs())
    assert graphed.stats.replays == 2 and graphed.stats.recaptures == 0


def test_moving_to_another_device_type_is_refused():
    graphed = devgraph.wrap(Scaled().eval(), device="cpu", batch_sizes=[2])
    with pytest.raises(DevgraphError, match=r"captures on cpu.*Wrap the moved model again"):
        graphed.to("meta")


# -- options naming arguments and batch sizes ------------------------------------------------


@pytest.mark.parametrize(
    "option",
    [
        {"static_args": ["slots"]},
        {"static_args": "slots"},
        {"pad_values": {"solt": 0}},
        {"batch_dims": {"xs": 1}},
        {"host_args": ["lens"]},
    ],
    ids=lambda o: next(iter(o)),
)
@pytest.mark.parametrize("frontend", ["raw", "dynamo"])
def test_an_option_naming_no_argument_is_an_error_listing_the_arguments(option, frontend):
    name = next(iter(option))
    if frontend == "raw":
        with pytest.raises(DevgraphError, match=rf"{name} names .* it takes: x, slot"):
            _raw(Scaled(), device="cpu", **option)
        return
    if name == "host_args":  # refused through Dynamo whatever it names, naming the way to serve it
        match = r"host_args=\['lens'\]: .*Pass frontend='raw'"
    else:  # the same check and message as the raw path's (RunnerConfig.check_arguments)
        match = rf"{name} names .* it takes: x, slot"
    with pytest.raises(DevgraphError, match=match):
        devgraph.wrap(Scaled(), device="cpu", **option)


def test_an_option_naming_no_argument_is_refused_in_piecewise_mode_too():
    with pytest.raises(DevgraphError, match=r"pad_values names \['solt'\]"):
        devgraph.wrap(Scaled(), device="cpu", mode="piecewise", pad_values={"solt": 0})


@pytest.mark.parametrize("bad", [2.5, "4", True, 0, -2])
@pytest.mark.parametrize("option", ["batch_sizes", "max_batch_size", "capture_sizes"])
def test_a_batch_size_that_is_not_a_positive_integer_is_an_error(option, bad):
    value = bad if option == "max_batch_size" else [1, bad]
    extra = {"mode": "piecewise"} if option == "capture_sizes" else {}
    with pytest.raises(DevgraphError, match=rf"{option} must be a positive integer, got {bad!r}"):
        devgraph.wrap(Scaled(), device="cpu", **{option: value}, **extra)


def test_integer_like_batch_sizes_are_accepted():
    np = pytest.importorskip("numpy")
    graphed = _raw(Scaled().eval(), device="cpu", batch_sizes=[np.int64(2), 4])
    assert graphed.runner.sizes == [2, 4]
    traced = devgraph.wrap(Scaled().eval(), device="cpu", batch_sizes=[np.int64(2), 4])
    assert list(traced.graphs.config.batch_sizes) == [2, 4]  # each graph's runner takes these
    traced(*_inputs(3))
    assert _runner(traced).sizes == [2, 4] and traced.stats.replays == 1


# -- eager fallback errors ------------------------------------------------------------------


class RaisesAtFive(torch.nn.Module):
    def forward(self, x):
        if x.shape[0] == 5:
            raise ValueError("the model's own error")
        return x + 1


def test_an_eager_fallbacks_error_is_the_models_own_without_a_devgraph_chain():
    graphed = devgraph.wrap(RaisesAtFive(), device="cpu", batch_sizes=[1, 2])
    graphed(torch.ones(2, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="the model's own error") as info:
            graphed(torch.ones(5, 3))  # above the buckets: runs eagerly
    assert info.value.__context__ is None and info.value.__cause__ is None
    assert "During handling" not in "".join(traceback.format_exception(info.value))


# -- devgraph.ops ---------------------------------------------------------------------------


def test_ops_is_reachable_after_a_plain_import_without_loading_an_accelerator():
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                """
                import sys
                import devgraph
                cheap = "torch" not in sys.modules
                rms_norm = devgraph.ops.rms_norm
                import torch
                print(cheap, callable(rms_norm), "torch_npu" in sys.modules, torch.cuda.is_initialized())
                """
            ),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.split() == ["True", "True", "False", "False"]


@pytest.mark.parametrize("mode", ["full", "piecewise"])
def test_hf_wrapper_methods_keep_the_graphed_causal_lm_and_recapture_after_a_cast(mode):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    graphed = devgraph.wrap(model, "cpu", batch_sizes=[2], max_cache_len=16, mode=mode)
    ids = torch.randint(3, 64, (2, 5), generator=torch.Generator().manual_seed(0))
    graphed.generate(ids, max_new_tokens=4)  # captured in float32
    assert graphed.eval().double() is graphed
    replays = graphed.stats.replays
    prefills = graphed.prefill_stats.replays if mode == "piecewise" else 0
    out = graphed.generate(ids, max_new_tokens=4)
    assert torch.equal(out, model.generate(ids, do_sample=False, max_new_tokens=4))
    assert graphed.stats.replays - replays == 3  # served from fresh float64 graphs, not eagerly
    if mode == "piecewise":  # the prompt's rows came from fresh float64 pieces too
        assert graphed.prefill_stats.replays > prefills
