"""devgraph.wrap on the reference paged decoder: every bucket, padding, fallback, stale metadata."""

from __future__ import annotations

import warnings

import pytest
import torch

import devgraph
from devgraph.testing.models import DecoderConfig, KVBlockManager, greedy_decode, make_decoder

SIZES = [1, 2, 4]


def _config(dev) -> DecoderConfig:
    """bfloat16 on npu: Ascend's fused attention (and the simulator) refuses float32."""
    return DecoderConfig(dtype=torch.bfloat16) if dev.name == "npu" else DecoderConfig()


def _pair(dev, **options):
    eager = make_decoder(_config(dev), seed=1, device=dev.torch_device)
    model = make_decoder(_config(dev), seed=1, device=dev.torch_device)
    options.setdefault("batch_sizes", SIZES)
    # frontend='raw': the decoder's host lengths (host_args) are served without Dynamo only
    return eager, _raw(model, device=dev, **options)


def _raw(model, **options):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*captures the forward as it runs, untraced")
        return devgraph.wrap(model, frontend="raw", **options)


def _step_both(dev, eager, graphed, batch, steps=3):
    """Run ``steps`` decode steps of ``batch`` sequences through both; return the max logit difference."""
    managers = [KVBlockManager(eager.config, device=dev.torch_device) for _ in range(2)]
    tokens = [(5 * i + 1) % eager.config.vocab_size for i in range(batch)]
    worst = 0.0
    for _ in range(steps):
        a = eager(**managers[0].decode_batch(list(range(batch)), tokens))
        b = graphed(**managers[1].decode_batch(list(range(batch)), tokens))
        assert b.shape == a.shape
        worst = max(worst, (a - b).abs().max().item())
        tokens = a.argmax(-1).tolist()
    return worst


@pytest.mark.parametrize("batch", [1, 2, 3, 4])
def test_every_bucket_and_padded_size_equals_eager(any_device, batch):
    eager, graphed = _pair(any_device)
    assert _step_both(any_device, eager, graphed, batch) < 1e-4
    assert graphed.stats.eager_calls == 0 and graphed.stats.replays == 3


def test_batch_above_largest_bucket_falls_back_and_equals_eager(any_device):
    eager, graphed = _pair(any_device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _step_both(any_device, eager, graphed, 6, steps=2) < 1e-4
    assert graphed.stats.fallbacks == {"batch_too_large": 2}
    assert any("batch_too_large" in str(w.message) for w in caught)


def test_greedy_generation_through_the_runner_equals_eager(any_device):
    eager, graphed = _pair(any_device)
    prompts = [[3, 1, 4], [1, 5, 9, 2, 6], [5]]  # shrinking batches exercise several buckets
    assert greedy_decode(graphed.module, prompts, 6, forward=graphed) == greedy_decode(eager, prompts, 6)
    assert graphed.stats.replays > 0 and graphed.stats.eager_calls == 0


@pytest.mark.parametrize("update", [False, True])
def test_decoder_graph_needs_task_update_for_host_lengths(any_device, update):
    """Lengths reach attention as a host list frozen at capture: stale without task update."""
    dev = any_device
    if dev.name == "cuda" and not update:
        pytest.skip("CUDA's paged attention reads the lengths from the device tensor (DEVICE_METADATA_OPS)")
    eager, model = (
        make_decoder(_config(dev), seed=1, device=dev.torch_device),
        make_decoder(_config(dev), seed=1, device=dev.torch_device),
    )
    managers = [KVBlockManager(eager.config, device=dev.torch_device) for _ in range(2)]
    static = model.dummy_inputs(2)
    graph = dev.graph()
    model(**static)  # warm-up
    with torch.no_grad(), graph.capture(auto_update_ops=dev.updatable_ops):
        out = model(**static)
    tokens, worst = [3, 7], 0.0
    for _ in range(3):
        ref = eager(**managers[0].decode_batch([0, 1], tokens))
        batch = managers[1].decode_batch([0, 1], tokens)
        for name, value in batch.items():
            if isinstance(value, torch.Tensor):
                static[name].copy_(value)
        graph.replay(host_args={"seq_lens_host": batch["seq_lens_host"]} if update else None)
        worst = max(worst, (out - ref).abs().max().item())
        tokens = ref.argmax(-1).tolist()
    if update:
        assert worst < 1e-4
    else:
        assert worst > 1e-2


def test_int32_slot_mapping_like_npu(any_device):
    eager, graphed = _pair(any_device)
    m1 = KVBlockManager(eager.config, device=any_device.torch_device, slot_dtype=torch.int32)
    m2 = KVBlockManager(eager.config, device=any_device.torch_device, slot_dtype=torch.int32)
    a = eager(**m1.decode_batch([0, 1, 2], [1, 2, 3]))
    b = graphed(**m2.decode_batch([0, 1, 2], [1, 2, 3]))
    torch.testing.assert_close(a, b)


def test_graphs_share_one_pool_on_the_reference_backend():
    _eager, graphed = _pair(devgraph.device("cpu"), batch_sizes=[1, 2, 4, 8])
    graphed.capture(**graphed.module.dummy_inputs(1))
    pools = {id(graphed.runner.graph(s).pool()) for s in (1, 2, 4, 8)}
    assert len(pools) == 1
    alone = make_decoder(seed=1)
    largest = _raw(alone, device="cpu", batch_sizes=[8])
    largest.capture(**alone.dummy_inputs(1))
    assert graphed.stats.pool_bytes <= 1.25 * largest.stats.pool_bytes
