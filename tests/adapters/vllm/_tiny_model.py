"""A tiny random-weight Llama with a tiny word-level tokenizer, built locally (no downloads)."""

from __future__ import annotations

from pathlib import Path

WORDS = [f"w{i}" for i in range(250)]


#: What the Bloom model shares with the others (its layer and head counts go by other names).
_SHARED = dict(
    vocab_size=len(WORDS) + 3, hidden_size=128, bos_token_id=1, eos_token_id=2, torch_dtype="float32"
)
_COMMON = dict(
    _SHARED,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


def _save(model_cls, config, path: Path, seed: int, embed_scale: float | None = None) -> Path:
    """Builds ``model_cls(config)`` from ``seed``, draws its weights, and saves it and the tokenizer."""
    import torch

    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():
        for p in model.parameters():
            # Larger than the default init so that greedy tokens differ from step to step (a graph
            # replaying stale values shows up as different tokens).
            p.normal_(0.0, 0.2) if p.dim() > 1 else p.fill_(1.0)
        if embed_scale is not None:
            model.model.embed_tokens.weight.mul_(embed_scale)
    model.save_pretrained(path, safe_serialization=True)
    _tokenizer().save_pretrained(path)
    return path


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {tok: i for i, tok in enumerate(specials + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def build_tiny_llama(path: Path, seed: int = 0) -> Path:
    """Write a 2-layer Llama (head dim 32: vLLM's CPU attention minimum) and its tokenizer to ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return _save(LlamaForCausalLM, LlamaConfig(**_COMMON), path, seed)


def build_tiny_mixtral(path: Path, seed: int = 0) -> Path:
    """A 2-layer Mixtral (4 experts, 2 per token): vLLM's fused MoE layer."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(**_COMMON, num_local_experts=4, num_experts_per_tok=2)
    return _save(MixtralForCausalLM, config, path, seed)


def build_tiny_sliding_mistral(path: Path, seed: int = 0) -> Path:
    """A 2-layer Mistral with a sliding window of 8 tokens (shorter than most prompts + outputs)."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(**_COMMON, sliding_window=8)
    return _save(MistralForCausalLM, config, path, seed)


def build_tiny_gemma2(path: Path, seed: int = 0) -> Path:
    """A 2-layer Gemma2: a sliding layer (window 6) then a global one, attention logits soft-capped.

    The window is shorter than every sequence the engine tests grow past a few steps, and the cap
    (10) is well below the scores this random model produces (tens), so both change the tokens.
    The embeddings are scaled down (Gemma2 ties them to the output and scales them up by
    ``sqrt(hidden)``; at full size the output repeats the current token whatever attention does).
    """
    from transformers import Gemma2Config, Gemma2ForCausalLM

    common = dict(_COMMON, tie_word_embeddings=True)  # vLLM's Gemma2 always ties them
    config = Gemma2Config(
        **common,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention"],
        attn_logit_softcapping=10.0,
        final_logit_softcapping=30.0,
        query_pre_attn_scalar=32,
    )
    return _save(Gemma2ForCausalLM, config, path, seed, embed_scale=EMBED_SCALE)


EMBED_SCALE = 0.1


def build_tiny_bloom(path: Path, seed: int = 0) -> Path:
    """A 2-layer Bloom: ALiBi position biases (no rotary), head dim 32, tied embeddings."""
    from transformers import BloomConfig, BloomForCausalLM

    config = BloomConfig(**_SHARED, n_layer=2, n_head=4)
    return _save(BloomForCausalLM, config, path, seed)


#: Where a model whose type transformers maps to its own tokenizer class keeps the word-level tokenizer
#: (transformers 5 loads ``Qwen2Tokenizer`` for any ``qwen2``/``qwen2_moe`` checkpoint, which turns the
#: test prompts into no tokens): the engine is given ``tokenizer=MODEL_DIR/tokenizer``.
TOKENIZER_SUBDIR = "tokenizer"


def _save_own_tokenizer(path: Path) -> Path:
    _tokenizer().save_pretrained(path / TOKENIZER_SUBDIR)
    return path


def build_tiny_qwen2(path: Path, seed: int = 0) -> Path:
    """A 2-layer Qwen2 (biased q/k/v projections, rotary, RMSNorm, SiLU-gated MLP)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**_COMMON)
    return _save_own_tokenizer(_save(Qwen2ForCausalLM, config, path, seed))


def build_tiny_qwen2_moe(path: Path, seed: int = 0) -> Path:
    """A 2-layer Qwen2-MoE (4 experts, 2 per token, a gated shared expert): vLLM's fused MoE layer."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        **_COMMON,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=128,
        decoder_sparse_step=1,
        norm_topk_prob=False,
    )
    return _save_own_tokenizer(_save(Qwen2MoeForCausalLM, config, path, seed))


def build_tiny_llama_drafter(target: Path, path: Path) -> Path:
    """A 1-layer Llama drafter for ``target`` (a ``build_tiny_llama`` model): the target's embeddings,
    first layer, final norm and output head, so that its greedy drafts agree with the target's tokens
    some of the time (speculative decoding then both accepts and rejects drafts). Same tokenizer."""
    import json

    from safetensors.torch import load_file, save_file

    path.mkdir(parents=True, exist_ok=True)
    config = json.loads((target / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))
    weights = load_file(target / "model.safetensors")
    kept = {
        k: v
        for k, v in weights.items()
        if not k.startswith("model.layers.") or k.startswith("model.layers.0.")
    }
    save_file(kept, path / "model.safetensors", metadata={"format": "pt"})
    _tokenizer().save_pretrained(path)
    return path


def build_tiny_eagle_head(target: Path, path: Path) -> Path:
    """A 1-layer EAGLE head for ``target`` (a ``build_tiny_llama`` model), in the layout vLLM's
    ``EagleLlamaForCausalLM`` loads (``speculative_config={'method': 'eagle'}``): ``fc`` maps (token
    embedding, target hidden state) to the token embedding alone, and the decoder layer (vLLM drops its
    input norm) is the target's first layer (rescaled for the missing norm); the embeddings and output head are the target's (vLLM
    shares them). So the head drafts about as a 1-layer copy of the target would: some drafts are
    accepted, and a drafter graph replaying wrong values shows in vLLM's acceptance counters."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    path.mkdir(parents=True, exist_ok=True)
    config = json.loads((target / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))
    hidden = config["hidden_size"]
    layer = "model.layers.0."
    weights = {
        name[len("model.") :]: tensor
        for name, tensor in load_file(target / "model.safetensors").items()
        if name.startswith(layer) and "input_layernorm" not in name
    }
    weights["fc.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
    # The target's first layer normalises its input before attention (weight 1), the head's does not:
    # scale q, k, v by 1 / (the embeddings' typical RMS) and o back, so that the attention sees about
    # what the target's does and adds about what it adds to the residual.
    embed = load_file(target / "model.safetensors")["model.embed_tokens.weight"]
    scale = float(1.0 / embed.pow(2).mean(dim=-1).sqrt().mean())
    for name in ("q_proj", "k_proj", "v_proj"):
        weights[f"layers.0.self_attn.{name}.weight"] = weights[f"layers.0.self_attn.{name}.weight"] * scale
    weights["layers.0.self_attn.o_proj.weight"] = weights["layers.0.self_attn.o_proj.weight"] / scale
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    _tokenizer().save_pretrained(path)
    return path
