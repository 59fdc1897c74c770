"""The decode workloads of ``decode_step.py`` and ``call_overhead.py``: each model built, its inputs
per batch, and its devgraph wrapper captured (twice: the largest bucket alone for the pool bytes, then
every bucket; ``args.pool_check = False`` skips the first); and the step captured by hand.

* ``llama``: a transformers ``LlamaForCausalLM`` (random bf16) stepped by the Hugging Face adapter's
  own decode step over its shared static KV cache;
* ``paged``: ``devgraph.testing.models.PagedDecoder`` (random bf16) with a paged KV cache of
  ``BLOCK_SIZE``-token blocks, batches built by ``KVBlockManager``.

``hf_causal_lm`` builds the transformers models (of ``HF_ARCHITECTURES``, random weights, from a
shape; ``hf_generate.py`` uses it too); ``capture_by_hand`` captures a workload's step without
devgraph's runner (``torch.cuda.graph`` on CUDA), the baseline a devgraph call is compared with.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import math
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
from _common import cuda_graph_capture, logger

import devgraph

BLOCK_SIZE = 16
#: The decoders' size on a GPU (``decode_step.py``'s default) and in smoke runs (``--quick``).
FULL_SHAPE = dict(hidden=1024, layers=8, heads=16, kv_heads=8, intermediate=2816, vocab=32000)
QUICK_SHAPE = dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=256)

#: transformers causal LMs ``hf_causal_lm`` builds in code: name -> (config class, model class,
#: config fields besides the shape's). Six architectures whose configs take the same shape fields.
HF_ARCHITECTURES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    # Phi-3's default pad id (32000) is past a small vocabulary
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {}),
}


class Skip(Exception):
    """This model cannot be benchmarked here (the message says why)."""


@dataclasses.dataclass
class Workload:
    """One model's decode step, its inputs per batch, and its devgraph wrapper (captured)."""

    name: str
    shape: dict[str, Any]
    step: Callable[..., torch.Tensor]  # the eager step module: what every method runs
    inputs: dict[int, dict[str, Any]]  # batch -> step kwargs
    prepare: Callable[[int], None]  # put batch b's cache state back (outside the timed window)
    devgraph_call: Callable[[int], torch.Tensor]  # the honest devgraph call for batch b
    runner: Any  # the all-buckets GraphRunner (None when its capture failed)
    devgraph: dict[str, Any]  # capture seconds and pool bytes


# -- capturing ---------------------------------------------------------------------------------------


def attempt(what: str, fn: Callable[[], Any]) -> tuple[Any, str | None]:
    """``(fn(), None)``, or ``(None, reason)`` with the traceback logged when ``fn`` raises."""
    try:
        return fn(), None
    except Exception as exc:
        logger.warning("%s failed:\n%s", what, traceback.format_exc())
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return None, f"{type(exc).__name__}: {first}"[:500]


def release_memory(dev: devgraph.Device) -> None:
    gc.collect()
    if dev.name == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def pool_segment_bytes(dev: devgraph.Device, pool_ids: set[tuple[int, ...]]) -> int | None:
    """Bytes of the caching allocator's segments owned by the given graph pools (CUDA only)."""
    if dev.name != "cuda" or not pool_ids:
        return None
    index = torch.device(dev.torch_device).index or 0
    return sum(
        int(seg.get("total_size", 0))
        for seg in torch.cuda.memory_snapshot()
        if seg.get("device", index) == index and tuple(seg.get("segment_pool_id", ())) in pool_ids
    )


def runner_pool(dev: devgraph.Device, runner: Any) -> dict[str, Any]:
    """Capture seconds and pool bytes of a captured runner, two ways.

    ``stats_pool_bytes`` is devgraph's own number (allocator ``reserved`` growth over the capture,
    warm-up activations included); ``segment_pool_bytes`` sums the segments of the graphs' private
    pool from ``torch.cuda.memory_snapshot()`` (the pool alone; CUDA only).
    """
    pools: set[tuple[int, ...]] = set()
    for size in runner.sizes:
        torch_graph = getattr(runner.graph(size), "torch_graph", None)
        if torch_graph is not None:
            pools.add(tuple(torch_graph.pool()))
    return {
        "sizes": list(runner.sizes),
        "capture_seconds": runner.stats.capture_seconds,
        "stats_pool_bytes": runner.stats.pool_bytes,
        "segment_pool_bytes": pool_segment_bytes(dev, pools),
    }


def capture_devgraph(
    dev: devgraph.Device, largest_alone: Callable[[], Any] | None, all_buckets: Callable[[], Any]
) -> tuple[Any, dict[str, Any]]:
    """Capture the largest bucket alone (pool bytes, then dropped; None: skipped), then every bucket (kept)."""
    info: dict[str, Any] = {}
    if largest_alone is not None:
        alone, err = attempt("devgraph capture of the largest bucket alone", largest_alone)
        if err:
            info["largest_alone_error"] = err
        else:
            info["largest_alone"] = runner_pool(dev, alone.runner)
            alone.runner.reset()
            del alone
        release_memory(dev)
    start = time.perf_counter()
    graphed, err = attempt("devgraph capture of all buckets", all_buckets)
    if err:
        info["all_buckets_error"] = err
        return None, info
    info["all_buckets"] = runner_pool(dev, graphed.runner)
    info["all_buckets"]["wall_seconds"] = time.perf_counter() - start  # incl. the adapter's caches
    for key in ("stats_pool_bytes", "segment_pool_bytes"):
        both = info["all_buckets"][key], info.get("largest_alone", {}).get(key)
        info[f"ratio_{key}"] = both[0] / both[1] if both[0] is not None and both[1] else None
    return graphed, info


def _largest_alone(args: argparse.Namespace, capture: Callable[[], Any]) -> Callable[[], Any] | None:
    return capture if getattr(args, "pool_check", True) else None


# -- transformers models -----------------------------------------------------------------------------


def hf_causal_lm(
    arch: str,
    shape: dict[str, int],
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int = 0,
    max_positions: int = 2048,
    architecture: tuple[str, str, dict[str, Any]] | None = None,
    **fields: Any,
) -> Any:
    """A transformers causal LM of ``HF_ARCHITECTURES[arch]`` with random weights (seeded), built in
    code (nothing downloaded), ``sdpa`` attention, cast to ``dtype``, in eval mode without grad.

    ``shape``: ``hidden``, ``layers``, ``heads``, ``kv_heads``, ``intermediate``, ``vocab``. No
    end-of-sequence token: greedy generation runs ``max_new_tokens`` steps on every row.
    ``architecture``: ``(config class, model class, config fields)`` instead of ``HF_ARCHITECTURES``'s;
    ``fields``: more config fields.

    Raises:
        Skip: transformers is not importable, or this release lacks the architecture.
    """
    try:
        import transformers
    except ImportError as exc:
        raise Skip(f"transformers is not importable ({exc}); pip install 'transformers>=5'") from None
    config_name, model_name, extra = architecture or HF_ARCHITECTURES[arch]
    if not hasattr(transformers, model_name):
        raise Skip(f"transformers {transformers.__version__} has no {model_name}")
    base = dict(
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        head_dim=shape["hidden"] // shape["heads"],
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        eos_token_id=None,
        attn_implementation="sdpa",
    )
    # the architecture's fields win over the shape's (a latent-attention model's own head sizes)
    config = getattr(transformers, config_name)(**{**base, **extra, **fields})
    torch.manual_seed(seed)
    with torch.device(device):
        model = getattr(transformers, model_name)(config)
    return model.to(dtype).eval().requires_grad_(False)


# -- the two models ----------------------------------------------------------------------------------


def build_llama(dev: devgraph.Device, args: argparse.Namespace) -> Workload:
    """LlamaForCausalLM (random bf16) and the HF adapter's decode step over its shared static cache."""
    try:
        import transformers

        from devgraph.adapters.hf import wrap_hf
    except ImportError as exc:
        raise Skip(f"transformers is not importable ({exc}); pip install 'transformers>=5'") from None
    s, tdev, cache_len, largest = args.shape, dev.torch_device, args.cache_len, max(args.batches)
    model = hf_causal_lm("llama", s, torch.bfloat16, tdev, args.seed, max(2048, cache_len))

    # wrap_hf's checks run here: a model the adapter refuses is an error of the whole model. The step is
    # captured untraced (frontend="raw"): this compares one bucket's replay with a hand-written graph of
    # the same step, which reaches into the step's GraphRunner (Dynamo's guards are host time before it)
    graphed = wrap_hf(model, dev, max_batch_size=largest, max_cache_len=cache_len, frontend="raw")
    runner, info = capture_devgraph(
        dev,
        _largest_alone(
            args,
            lambda: wrap_hf(
                model, dev, batch_sizes=[largest], max_cache_len=cache_len, frontend="raw"
            ).capture(),
        ),
        graphed.capture,  # allocates the shared static cache, then captures every bucket
    )
    step = graphed._step  # the module the runner captured: eager, hand-written graph and compile run it
    if not graphed.runner.captured:
        raise RuntimeError(f"the decode steps were not captured: {info.get('all_buckets_error')}")

    torch.manual_seed(args.seed + 1)
    inputs = {}
    for b in args.batches:
        mask = torch.zeros(b, cache_len, dtype=torch.bool, device=tdev)
        mask[:, : args.context + 1] = True  # the context and the slot this step writes
        inputs[b] = {
            "input_ids": torch.randint(3, s["vocab"], (b, 1), device=tdev),
            "position_ids": torch.full((b, 1), args.context, dtype=torch.long, device=tdev),
            "mask0": mask[:, None, None, :],  # the 4-D sdpa mask transformers builds for a static cache
        }
    for layer in graphed.cache.base.layers:  # the "prefilled" context: random keys and values
        layer.keys.normal_()
        layer.values.normal_()

    def prepare(b: int) -> None:
        for layer in graphed.cache.base.layers:  # one write position shared by every bucket's rows
            layer.cumulative_length.fill_(args.context)  # the step advances it on the device

    shape = {**s, "params": sum(p.numel() for p in model.parameters()), "dtype": "bfloat16"}
    shape.update(attn_implementation="sdpa", max_cache_len=cache_len, transformers=transformers.__version__)
    return Workload(
        name="llama",
        shape=shape,
        step=step,
        inputs=inputs,
        prepare=prepare,
        devgraph_call=lambda b: graphed.runner(**inputs[b]),
        runner=graphed.runner if runner is not None else None,
        devgraph=info,
    )


def build_paged(dev: devgraph.Device, args: argparse.Namespace) -> Workload:
    """PagedDecoder (random bf16) with a paged cache big enough for the largest batch."""
    from devgraph.testing.models import DecoderConfig, KVBlockManager, make_decoder

    s, tdev, largest = args.shape, dev.torch_device, max(args.batches)
    blocks_per_seq = math.ceil(args.cache_len / BLOCK_SIZE)
    config = DecoderConfig(
        vocab_size=s["vocab"],
        hidden_size=s["hidden"],
        intermediate_size=s["intermediate"],
        num_layers=s["layers"],
        num_heads=s["heads"],
        num_kv_heads=s["kv_heads"],
        block_size=BLOCK_SIZE,
        num_blocks=largest * blocks_per_seq + 1,  # + the scratch block of padded rows
        max_blocks_per_seq=blocks_per_seq,
        dtype=torch.bfloat16,
    )
    model = make_decoder(config, seed=args.seed, device=tdev)

    gen = torch.Generator().manual_seed(args.seed + 1)
    inputs = {}
    for b in args.batches:
        # Host-side bookkeeping only: the context's tokens are never run, their K/V are random.
        manager = KVBlockManager(config, device="cpu")
        rows = list(range(b))
        for _ in range(args.context):
            manager.decode_batch(rows, [0] * b)
        tokens = torch.randint(0, s["vocab"], (b,), generator=gen).tolist()
        step_kwargs = manager.decode_batch(rows, tokens)  # positions = context, seq_lens = context + 1
        inputs[b] = {k: v.to(tdev) if isinstance(v, torch.Tensor) else v for k, v in step_kwargs.items()}

    example = inputs[min(args.batches)]
    graphed, info = capture_devgraph(
        dev,
        # frontend='raw': the decoder's host lengths (host_args) are served without Dynamo only
        _largest_alone(
            args, lambda: devgraph.wrap(model, dev, frontend="raw", batch_sizes=[largest]).capture(**example)
        ),
        lambda: devgraph.wrap(model, dev, frontend="raw", max_batch_size=largest).capture(**example),
    )
    torch.manual_seed(args.seed + 2)
    with torch.no_grad():
        for layer in model.layers:  # after capture: its warm-ups wrote the scratch block
            layer.k_cache.normal_()
            layer.v_cache.normal_()

    shape = {**s, "params": sum(p.numel() for p in model.parameters()), "dtype": "bfloat16"}
    shape.update(block_size=BLOCK_SIZE, num_blocks=config.num_blocks, max_blocks_per_seq=blocks_per_seq)
    return Workload(
        name="paged",
        shape=shape,
        step=model,
        inputs=inputs,
        prepare=lambda b: None,  # the step rewrites the same slot with the same K/V
        devgraph_call=lambda b: graphed(**inputs[b]),
        runner=graphed.runner if graphed is not None else None,
        devgraph=info,
    )


BUILDERS = {"llama": build_llama, "paged": build_paged}


# -- the step captured by hand -----------------------------------------------------------------------


@dataclasses.dataclass
class HandGraph:
    """A workload's step captured by hand, without devgraph's runner: ``replay()`` alone, or ``step()``:
    the call's tensors copied into the graph's static inputs, then the replay (what an engine's own
    graph runner does, and what a devgraph call does for you)."""

    replay: Callable[[], Any]
    output: Any  # what the capture returned: each replay overwrites it
    copies: list[tuple[torch.Tensor, torch.Tensor]]  # (static input, the call's tensor)
    capture_s: float
    pool: Any  # the torch graph pool on CUDA (for its segments' bytes), else None
    reset: Callable[[], None]

    def step(self) -> None:
        for static, value in self.copies:
            static.copy_(value)
        self.replay()


def capture_by_hand(dev: devgraph.Device, wl: Workload, b: int, *, own_inputs: bool) -> HandGraph:
    """Capture ``wl.step`` at batch ``b`` by hand: with ``torch.cuda.graph`` on CUDA (three warm-ups
    first, as torch's docs do), elsewhere a devgraph ``Graph`` captured directly (two warm-ups; no
    runner, no buckets) whose updatable ops (the paged attention) are tasks replayed with the
    batch's host arguments, as the runner's graphs are (the CPU reference re-issues them at every
    replay, a cost devgraph's graph pays too; on CUDA the kernel reads device lengths and nothing is
    re-issued). ``own_inputs``: on clones of the batch's tensors, which ``step()`` copies the batch
    into; else on the batch's tensors themselves (``step()`` copies nothing)."""
    kwargs = wl.inputs[b]
    prepare = functools.partial(wl.prepare, b)
    static = {k: v.clone() if own_inputs and isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    copies = [(static[k], v) for k, v in kwargs.items() if own_inputs and isinstance(v, torch.Tensor)]
    call = functools.partial(wl.step, **static)
    if dev.name == "cuda":
        graph, out, capture_s = cuda_graph_capture(call, before=prepare)
        return HandGraph(graph.replay, out, copies, capture_s, graph.pool(), graph.reset)
    # What the runner's graph of bucket b replays with: {op argument: the batch's host values}.
    host = wl.runner.inputs.padded_host_args(kwargs, b) if wl.runner is not None else {}
    for _ in range(2):
        prepare()
        call()
    prepare()
    ours = dev.graph()
    start = time.perf_counter()
    with ours.capture(auto_update_ops=tuple(getattr(dev, "updatable_ops", ())) if host else ()):
        out = call()
    capture_s = time.perf_counter() - start
    replay = functools.partial(ours.replay, host) if host else ours.replay
    return HandGraph(replay, out, copies, capture_s, None, ours.reset)
