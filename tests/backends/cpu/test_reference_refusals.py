"""What a graph cannot hold is refused at capture, on the CPU reference and the torch_npu simulator.

* A random-number generator re-seeded inside the capture (CUDA raises on these while capturing):
  eager restarts the stream at every call, a replay would continue it. Ordinary random ops drawing
  from a generator seeded outside replay like eager.
* Quantized and nested tensors, which the recorder cannot rebuild from storage, dtype and strides.
* A capture begun inside ``torch.autocast`` with its weight cache on: the graph would read casts that
  autocast frees when its region exits.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import devgraph
from devgraph import CaptureError
from devgraph_sim.npu import simulated_torch_npu

GRAD_MODES = [torch.no_grad, torch.inference_mode, torch.enable_grad]


@pytest.fixture(params=["cpu", "npu"])
def device(request):
    if request.param == "cpu":
        yield devgraph.device("cpu")
        return
    with simulated_torch_npu(hang_timeout=0.2):
        yield devgraph.device("npu")


def _capture(device, fn, *args, mode=torch.no_grad):
    graph = device.graph()
    with mode():
        with graph.capture():
            out = fn(*args)
    return graph, out


# -- random-number generators --------------------------------------------------------------------

G = torch.Generator()


def _manual_seed(x):
    torch.manual_seed(0)
    return x + torch.randn(4)


_STATE = torch.Generator().manual_seed(7).get_state()


def _set_rng_state(x):
    torch.set_rng_state(_STATE)
    return x + torch.rand(4)


def _generator_made_inside(x):
    g = torch.Generator().manual_seed(0)
    return x + torch.randn(4, generator=g)


def _generator_made_inside_unseeded(x):
    return torch.nn.functional.dropout(x, 0.5, training=True) * torch.rand(4, generator=torch.Generator())


def _generator_reseeded(x):
    G.manual_seed(5)
    return x + torch.randn(4, generator=G)


def _generator_state_set_between_draws(x):
    y = torch.randn(4, generator=G)
    G.set_state(_STATE)
    return x + y + torch.randn(4, generator=G)


def _generator_reseeded_between_draws(x):
    y = torch.randn(4, generator=G)
    G.manual_seed(5)
    return x + y + torch.randn(4, generator=G)


def _seeded_after_the_last_draw(x):
    y = x + torch.randn(4)
    torch.manual_seed(0)
    return y


def _dropout_then_reseed(x):
    y = torch.nn.functional.dropout(x, 0.5, training=True)
    torch.manual_seed(3)
    return y + torch.bernoulli(torch.full((4,), 0.5))


RESEEDS = {
    "torch.manual_seed": _manual_seed,
    "torch.set_rng_state": _set_rng_state,
    "Generator made and seeded inside": _generator_made_inside,
    "Generator made inside": _generator_made_inside_unseeded,
    "Generator.manual_seed before its draw": _generator_reseeded,
    "Generator.set_state between draws": _generator_state_set_between_draws,
    "Generator.manual_seed between draws": _generator_reseeded_between_draws,
    "manual_seed after the last draw": _seeded_after_the_last_draw,
    "manual_seed between dropout and bernoulli": _dropout_then_reseed,
}


@pytest.mark.parametrize("mode", GRAD_MODES, ids=["no_grad", "inference_mode", "grad"])
@pytest.mark.parametrize("case", list(RESEEDS))
def test_reseeding_a_generator_inside_capture_is_refused(device, case, mode):
    fn = RESEEDS[case]
    G.manual_seed(1)
    x = torch.randn(4)
    with mode():
        fn(x)  # a warm-up, as the runner does: eager works, and draws from G once
    with pytest.raises(CaptureError) as info:
        _capture(device, fn, x, mode=mode)
    err = info.value
    assert "seed" in err.remedy and "outside the block" in err.remedy
    assert err.op
    if device.name == "cpu" and fn is not _seeded_after_the_last_draw:
        assert err.source and "test_reference_refusals.py" in err.source


def _draws(x, gen):
    a = torch.nn.functional.dropout(x, 0.5, training=True)
    b = torch.randn(4) + torch.rand(4, generator=gen)
    c = torch.empty(4).normal_(generator=gen) + torch.randint(0, 10, (4,))
    return a + b + c + torch.bernoulli(torch.full((4,), 0.5), generator=gen)


@pytest.mark.parametrize("mode", GRAD_MODES, ids=["no_grad", "inference_mode", "grad"])
def test_random_ops_seeded_outside_replay_like_eager(device, mode):
    """A replay draws the next numbers of each generator's stream, as an eager call at that point
    would (a CUDA graph reads the generator's seed and offset at replay)."""
    x, gen = torch.randn(4), torch.Generator().manual_seed(3)
    with mode():
        _draws(x, gen)  # warm-up: gen is drawn from before capture
    graph, out = _capture(device, _draws, x, gen, mode=mode)
    outputs = []
    for seed in (11, 12, 11):
        torch.manual_seed(seed)
        gen.manual_seed(seed + 100)
        x.copy_(torch.arange(4.0) + seed)
        graph.replay()
        device.synchronize()
        replayed = out.clone()
        torch.manual_seed(seed)
        gen.manual_seed(seed + 100)
        with mode():
            expected = _draws(x, gen)
        torch.testing.assert_close(replayed, expected)
        outputs.append(replayed)
    assert not torch.equal(outputs[0], outputs[1])  # the replay draws anew: not frozen at capture
    torch.testing.assert_close(outputs[0], outputs[2])


def test_consecutive_replays_continue_the_stream_as_eager_calls_do(device):
    x = torch.zeros(4)

    def fn(x):
        return x + torch.randn(4)

    graph, out = _capture(device, fn, x)
    torch.manual_seed(5)
    replays = []
    for _ in range(2):
        graph.replay()
        device.synchronize()
        replays.append(out.clone())
    torch.manual_seed(5)
    torch.testing.assert_close(replays, [fn(x), fn(x)])


def _noise(x, gen):
    return x + torch.randn(4, generator=gen)


def test_a_generator_passed_in_is_held_by_the_graph():
    x, gen = torch.zeros(4), torch.Generator().manual_seed(2)
    torch.rand(1, generator=gen)  # drawn once before capture
    graph, out = _capture(devgraph.device("cpu"), _noise, x, gen)
    state = gen.get_state()
    del gen  # the graph keeps drawing from it, as a CUDA graph keeps a registered generator's state
    graph.replay()
    again = torch.Generator()
    again.set_state(state)
    torch.testing.assert_close(out, _noise(x, again))


def test_reseeding_inside_a_task_reissue_is_refused():
    graph = devgraph.device("cpu").graph()
    x = torch.zeros(4)
    with torch.no_grad(), graph.capture():
        with graph.task_group("noise") as group:
            x + torch.randn(4)
    with pytest.raises(CaptureError, match="re-seeded"):
        with torch.no_grad(), graph.task_update(group):
            torch.manual_seed(0)
            x + torch.randn(4)


def test_cuda_maps_torch_rng_capture_assertion_to_capture_error():
    """CUDA raises on re-seeding while capturing (torch's assertNotCapturing); devgraph names it."""
    from devgraph.backends.cuda._device import CudaDevice, CudaGraph

    graph = CudaGraph(CudaDevice(0))  # constructing makes no CUDA call; translating makes none
    try:
        raise RuntimeError(
            "Cannot call CUDAGeneratorImpl::set_current_seed during CUDA graph capture. If you need this "
            "call to be captured, please file an issue. Current cudaStreamCaptureStatus: "
            "cudaStreamCaptureStatusActive"
        )
    except RuntimeError as exc:
        err = graph._translate_capture_error(exc)
    assert isinstance(err, CaptureError)
    assert "set_current_seed" in err.message and "manual_seed" in err.op
    assert "seed before capture" in err.remedy
    assert err.source and "test_reference_refusals.py" in err.source


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_reseeding_inside_a_cuda_capture_is_a_capture_error():
    device = devgraph.device("cuda")
    x = torch.zeros(4, device="cuda")
    with pytest.raises(CaptureError, match=r"set_current_seed|set_state"):
        _capture(device, lambda x: (torch.cuda.manual_seed(0), x + torch.randn(4, device="cuda"))[1], x)


# -- quantized and nested tensors ----------------------------------------------------------------


def _quantized(x):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated in torch
        return torch.quantize_per_tensor(x, 0.1, 0, torch.quint8)


def _nested(*ts):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the strided nested layout is a prototype
        return torch.nested.nested_tensor(list(ts))


@pytest.mark.parametrize("mode", GRAD_MODES, ids=["no_grad", "inference_mode", "grad"])
@pytest.mark.parametrize(
    ("case", "kind"),
    [
        ("external quantized read", "quantized"),
        ("quantize inside", "quantized"),
        ("external nested read", "nested"),
        ("nested made inside", "nested"),
    ],
)
def test_quantized_and_nested_tensors_are_refused_at_capture(device, case, kind, mode):
    x = torch.randn(4)
    q = _quantized(torch.randn(4))
    nt = _nested(torch.randn(2), torch.randn(3))
    fns = {
        "external quantized read": lambda x: x + q.dequantize(),
        "quantize inside": lambda x: _quantized(x).dequantize() + 1,
        "external nested read": lambda x: x + nt.to_padded_tensor(0.0).sum(),
        "nested made inside": lambda x: _nested(x, x[:2]).to_padded_tensor(0.0)[0] + 1,
    }
    with pytest.raises(CaptureError, match=kind) as info:
        _capture(device, fns[case], x, mode=mode)
    assert "before capture" in info.value.remedy and info.value.op


# -- autocast's weight cache ---------------------------------------------------------------------


def test_capture_inside_autocast_with_its_cache_is_refused(device):
    lin, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lin(x)  # warm-up: caches the bf16 weight until the region exits
        with pytest.raises(CaptureError, match="autocast") as info:
            _capture(device, lin, x)
    assert "cache_enabled=False" in info.value.remedy
    assert info.value.source and "test_reference_refusals.py" in info.value.source


def test_capture_inside_autocast_without_its_cache_replays_like_eager(device):
    lin, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        lin(x)
        graph, out = _capture(device, lin, x)
        x.copy_(torch.randn(2, 4))
        with torch.no_grad():
            lin.weight.mul_(2)  # an in-place weight change is read by the replay
        graph.replay()
        device.synchronize()
        with torch.no_grad():
            torch.testing.assert_close(out, lin(x))


def test_autocast_entered_inside_the_captured_code_replays_like_eager(device):
    lin, x = torch.nn.Linear(4, 4), torch.randn(2, 4)

    def fn(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return lin(x).float()

    graph, out = _capture(device, fn, x)
    x.copy_(torch.randn(2, 4))
    graph.replay()
    device.synchronize()
    with torch.no_grad():
        torch.testing.assert_close(out, fn(x))


def _dropout(x):
    return torch.nn.functional.dropout(x * 2, 0.5, training=True)


def test_random_work_recorded_whole_is_not_mistaken_for_a_reseed():
    """Work recorded as one opaque call (inductor's CPU kernels) draws outside op-by-op recording;
    the draws it makes are replayed with it, so they are no re-seed."""
    graph, x = devgraph.device("cpu").graph(), torch.randn(8)
    with torch.no_grad(), graph.capture():
        out = graph.call_opaque(_dropout, x) + torch.rand(8)
    torch.manual_seed(3)
    graph.replay()
    replayed = out.clone()
    torch.manual_seed(3)
    torch.testing.assert_close(replayed, _dropout(x) + torch.rand(8))
