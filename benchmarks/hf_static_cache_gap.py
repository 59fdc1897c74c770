"""How far a transformers model's logits over devgraph's static KV cache are from eager's over its dynamic cache.

devgraph serves ``generate()`` over one static cache (full-length ``StaticLayer``s of ``max_cache_len``
slots); its graphed logits are bitwise those of eager over that same cache (the HF architecture tests).
Eager ``model.generate()`` uses transformers' ``DynamicCache`` by default, and attention over the two
layouts sums in another order: over a dynamic cache SDPA gets exactly the ``n`` cached keys and no mask,
over a static cache all ``max_cache_len`` slots and an additive mask. This script measures that gap per
architecture, in bfloat16 and float32, on tiny models built in code with random weights (nothing
downloaded):

* teacher-forced: a prompt (``--prompt`` tokens, ``--batch`` rows) and ``--steps`` decode steps, fed the
  same tokens (the dynamic run's greedy ones) over both caches; per position the logits' largest absolute
  difference, the largest logit (for scale), the relative L2 difference (what ``wrap``'s static-cache
  check bounds: 5e-2 in 16-bit types, 1e-3 in float32) and whether the greedy token differs;
* ``generate``: greedy ``--steps`` new tokens, ``devgraph.wrap(model).generate`` against eager
  ``model.generate`` (dynamic cache): tokens identical, the first new token that differs; and graphed
  against eager over the same static layout, bitwise equal or not.

    python benchmarks/hf_static_cache_gap.py                 # every architecture, tiny and small shapes
    python benchmarks/hf_static_cache_gap.py --quick --archs llama minicpm3

Writes ``<out>/hf_static_cache_gap_<backend>.json`` after every architecture (``_quick`` under ``--quick``),
with the commit measured (``checkout``). Exits 1 when a run fails or graphed differs from eager over the
same static cache (a refusal at wrap is reported, not a failure).
"""

from __future__ import annotations

import argparse
import inspect
import traceback
from pathlib import Path
from typing import Any

import torch
from _common import DEFAULT_OUT, PartialReport, logger, start
from _decode_workloads import Skip, hf_causal_lm

import devgraph

CPU_NOTE = "cpu backend: the graphed side is the reference simulator (correctness); no timing here"

#: Shapes: the tests' tiny one, and a larger one (more heads, layers, a bigger vocabulary).
SHAPES = {
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=256),
    "small": dict(hidden=256, layers=4, heads=8, kv_heads=4, intermediate=512, vocab=2048),
}

_MOE = dict(num_experts=4, num_experts_per_tok=2)


def _latent(shape: dict[str, int]) -> dict[str, Any]:
    """Multi-head latent attention fields (MiniCPM3, DeepseekV3), sized by the shape's head dim."""
    head = shape["hidden"] // shape["heads"]
    return dict(
        num_key_value_heads=shape["heads"],
        q_lora_rank=shape["hidden"] // 2,
        kv_lora_rank=shape["hidden"] // 4,
        qk_rope_head_dim=head // 2,
        qk_nope_head_dim=head // 2,
        v_head_dim=head,
        head_dim=head // 2,  # the rotary part's
    )


#: name -> (config class, model class, config fields besides the shape's, from the shape).
ARCHITECTURES: dict[str, tuple[str, str, Any]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", lambda s: {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", lambda s: {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", lambda s: {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", lambda s: {}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", lambda s: {}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", lambda s: {"pad_token_id": 0}),
    "gemma3_text": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        lambda s: {
            "sliding_window": 4,
            "layer_types": ["sliding_attention", "full_attention"] * (s["layers"] // 2),
        },
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        lambda s: dict(_MOE, moe_intermediate_size=s["intermediate"] // 4),
    ),
    "minicpm3": ("MiniCPM3Config", "MiniCPM3ForCausalLM", _latent),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        lambda s: dict(
            _latent(s),
            n_routed_experts=8,
            n_group=2,
            topk_group=1,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            n_shared_experts=1,
            moe_intermediate_size=s["intermediate"] // 4,
        ),
    ),
}


def build(arch: str, shape: dict[str, int], dtype: torch.dtype, device: Any, seed: int) -> Any:
    """The architecture with random weights (seeded), ``sdpa`` attention, in eval mode without grad."""
    config_name, model_name, extra = ARCHITECTURES[arch]
    return hf_causal_lm(
        arch, shape, dtype, device, seed, architecture=(config_name, model_name, extra(shape)), bos_token_id=1
    )


def static_cache(model: Any, max_cache_len: int) -> Any:
    """A cache laid out as devgraph's: a full-length ``StaticLayer`` per layer (sliding ones included)."""
    from transformers.cache_utils import Cache, StaticLayer

    layers = model.config.get_text_config(decoder=True).num_hidden_layers
    return Cache(layers=[StaticLayer(max_cache_len=max_cache_len) for _ in range(layers)])


def teacher_forced(model: Any, ids: torch.Tensor, steps: int, max_cache_len: int) -> dict[str, Any]:
    """The prompt and ``steps`` decode steps over both caches, fed the dynamic run's greedy tokens."""
    # the cache's name: ``past_key_values`` (transformers 5.0-5.23), ``cache`` (5.24+)
    kwarg = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    static = static_cache(model, max_cache_len)
    with torch.no_grad():
        dynamic = model(input_ids=ids, use_cache=True)
        over_static = model(input_ids=ids, use_cache=True, **{kwarg: static})
        pairs = [("prefill", over_static.logits, dynamic.logits)]
        for step in range(steps):
            token = dynamic.logits[:, -1:].argmax(-1)
            cache = getattr(dynamic, "cache", None) or dynamic.past_key_values
            dynamic = model(input_ids=token, use_cache=True, **{kwarg: cache})
            over_static = model(input_ids=token, use_cache=True, **{kwarg: static})
            pairs.append((f"decode step {step + 1}", over_static.logits, dynamic.logits))
    worst: dict[str, Any] = {"max_abs_diff": 0.0, "at": None}
    relative, flips, scale, first, decode_abs = 0.0, 0, 0.0, None, 0.0
    for label, got, want in pairs:
        got, want = got.float(), want.float()
        diff = (got - want).abs()
        value = float(diff.max())
        scale = max(scale, float(want.abs().max()))
        rel = (got - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-6)
        relative = max(relative, float(rel.max()))
        flips += int((got.argmax(-1) != want.argmax(-1)).sum())
        if label != "prefill":
            decode_abs = max(decode_abs, value)
        if value > 0 and first is None:
            first = label
        if value > worst["max_abs_diff"]:
            worst = {"max_abs_diff": value, "at": label}
    return {
        **worst,
        "max_abs_diff_decode": decode_abs,
        "max_abs_logit": scale,
        "max_relative_l2": relative,
        "greedy_flips": flips,
        "positions": sum(p[1].shape[0] * p[1].shape[1] for p in pairs),
        "first_difference": first,
    }


def generated(
    dev: devgraph.Device, model: Any, ids: torch.Tensor, steps: int, max_cache_len: int
) -> dict[str, Any]:
    """Greedy ``generate``: graphed against eager over the dynamic cache and over devgraph's layout."""
    call = dict(
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=steps,
        return_dict_in_generate=True,
        output_logits=True,
    )
    try:
        graphed = devgraph.wrap(model, dev, batch_sizes=[ids.shape[0]], max_cache_len=max_cache_len)
    except devgraph.DevgraphError as exc:
        return {"refused": f"at wrap: {exc}"}
    out = graphed.generate(ids, **call)
    dynamic = model.generate(ids, **call)
    same_layout = model.generate(ids, **call, past_key_values=static_cache(model, max_cache_len))
    differ = (out.sequences != dynamic.sequences).any(dim=0).nonzero()
    prompt = ids.shape[1]
    return {
        "tokens_identical_to_dynamic": bool(torch.equal(out.sequences, dynamic.sequences)),
        "first_differing_new_token": int(differ[0]) - prompt + 1 if len(differ) else None,
        "bitwise_equal_to_eager_over_the_same_static_layout": bool(
            torch.equal(out.sequences, same_layout.sequences)
        )
        and all(torch.equal(g, e) for g, e in zip(out.logits, same_layout.logits)),
        "replays": graphed.stats.replays,
        "fallbacks": dict(graphed.stats.fallbacks),
    }


def measure(
    dev: devgraph.Device, arch: str, shape_name: str, dtype: torch.dtype, args: argparse.Namespace
) -> dict[str, Any]:
    shape = SHAPES[shape_name]
    try:
        model = build(arch, shape, dtype, dev.torch_device, args.seed)
    except Skip as exc:
        return {"skipped": str(exc)}
    gen = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(3, shape["vocab"], (args.batch, args.prompt), generator=gen).to(dev.torch_device)
    max_cache_len = args.prompt + args.steps + 8
    row = {"teacher_forced": teacher_forced(model, ids, args.steps, max_cache_len)}
    row["generate"] = generated(dev, model, ids, args.steps, max_cache_len)
    return row


def render(report: dict[str, Any]) -> str:
    lines = [
        f"{'arch':<13}{'shape':<7}{'dtype':<10}{'max|d logit|':>13}{'max|logit|':>11}{'rel L2':>9}"
        f"{'flips':>7}{'tokens=dyn':>11}{'=static':>9}"
    ]
    for arch, shapes in report["archs"].items():
        for shape, dtypes in shapes.items():
            for dtype, row in dtypes.items():
                if "skipped" in row or "error" in row:
                    lines.append(f"{arch:<13}{shape:<7}{dtype:<10}{row.get('skipped') or row.get('error')}")
                    continue
                t, g = row["teacher_forced"], row["generate"]
                tokens = "refused" if "refused" in g else str(g["tokens_identical_to_dynamic"])
                bitwise = (
                    "" if "refused" in g else str(g["bitwise_equal_to_eager_over_the_same_static_layout"])
                )
                lines.append(
                    f"{arch:<13}{shape:<7}{dtype:<10}{t['max_abs_diff']:>13.3g}{t['max_abs_logit']:>11.3g}"
                    f"{t['max_relative_l2']:>9.2g}{t['greedy_flips']:>7}{tokens:>11}{bitwise:>9}"
                )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="devgraph backend (default: best available)")
    parser.add_argument("--archs", nargs="+", choices=sorted(ARCHITECTURES), default=list(ARCHITECTURES))
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument(
        "--dtypes", nargs="+", choices=["bfloat16", "float32"], default=["bfloat16", "float32"]
    )
    parser.add_argument("--prompt", type=int, default=8, help="prompt tokens")
    parser.add_argument("--batch", type=int, default=2, help="rows")
    parser.add_argument("--steps", type=int, default=None, help="decode steps (24; --quick: 4)")
    parser.add_argument("--quick", action="store_true", help="the tiny shape, few steps (a smoke run)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    args.steps = args.steps or (4 if args.quick else 24)
    if args.quick:
        args.shapes = ["tiny"]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dev, header = start(args.device, "hf_static_cache_gap")
    import transformers

    report: dict[str, Any] = {
        **header,
        "transformers": transformers.__version__,
        "config": {
            "archs": args.archs,
            "shapes": {name: SHAPES[name] for name in args.shapes},
            "dtypes": args.dtypes,
            "prompt": args.prompt,
            "batch": args.batch,
            "steps": args.steps,
            "max_cache_len": args.prompt + args.steps + 8,
            "seed": args.seed,
        },
        "archs": {},
    }
    partial = PartialReport(
        args.out / (f"hf_static_cache_gap_{dev.name}" + ("_quick" if args.quick else "") + ".json")
    )
    failed = False
    for arch in args.archs:
        logger.info("== %s", arch)
        rows: dict[str, Any] = {}
        for shape in args.shapes:
            rows[shape] = {}
            for dtype in args.dtypes:
                try:
                    row = measure(dev, arch, shape, getattr(torch, dtype), args)
                except Exception as exc:  # reported, and the run goes on
                    row = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
                    failed = True
                g = row.get("generate", {})
                if g.get("bitwise_equal_to_eager_over_the_same_static_layout") is False:
                    failed = True
                rows[shape][dtype] = row
        report["archs"][arch] = rows
        partial.row_done(report)
    path = partial.finish(report)
    print(render(report))
    print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
