"""Tiny random transformers causal LMs built from configs in code (no downloads), for the HF tests.

``ARCHITECTURES`` maps a name to ``(config class, model class, config overrides)``; each builds in
well under a second. Among them: mixture-of-experts models (``qwen2_moe``, ``mixtral``,
``qwen3_moe``, ``deepseek_v3`` with latent attention and grouped routing) and sliding-window attention
(``mistral_sliding``, ``gemma2``, ``gemma3_text``, ``qwen2`` with mixed layer types). ``REFUSED`` holds
architectures the adapter refuses at wrap time by their config (ALiBi); ``HOST_READING_DECODE`` those the
wrap-time dry run of the decode step refuses, ``CHECK_FAILS`` those the wrap-time static-cache check
cannot run (no KV cache, a forward that fails over a static cache), ``CACHE_LENGTH_DEPENDENT`` those it
finds computing other logits; ``CAPTURE_REFUSED`` those refused only at the first capture.
"""

from __future__ import annotations

from typing import Any

import torch

VOCAB = 128
#: The vocabulary and special tokens of every model here but GPT-1's and CPM-Ant's.
_IDS = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2)
#: 2 layers of width 64, 4 query heads over 2 KV heads (in the names most configs use).
DIMS = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)
_COMMON = dict(DIMS, **_IDS)
_HEAD = dict(_COMMON, head_dim=16)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
#: Multi-head latent attention's ranks and head sizes (DeepSeek-V3, MiniCPM3, LongCat-Flash).
_MLA = dict(q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)

ARCHITECTURES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", _HEAD),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _HEAD),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", _HEAD),
    "mistral": ("MistralConfig", "MistralForCausalLM", _HEAD),
    "mistral_sliding": ("MistralConfig", "MistralForCausalLM", dict(_HEAD, sliding_window=4)),
    "qwen2_mixed_sliding": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(
            _HEAD,
            use_sliding_window=True,
            sliding_window=4,
            max_window_layers=1,
            layer_types=["full_attention", "sliding_attention"],
        ),
    ),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", _HEAD),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(_HEAD, sliding_window=4)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(_COMMON, pad_token_id=0)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", _COMMON),
    "granite": ("GraniteConfig", "GraniteForCausalLM", _COMMON),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", _COMMON),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", _COMMON),
    "phi": ("PhiConfig", "PhiForCausalLM", _COMMON),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", _COMMON),
    # two attention calls per layer, their outputs joined by cat after the second (issue 48)
    "diffllama": ("DiffLlamaConfig", "DiffLlamaForCausalLM", _HEAD),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(_HEAD, num_local_experts=4, num_experts_per_tok=2),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(_HEAD, **_MOE, shared_expert_intermediate_size=32),
    ),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(_HEAD, **_MOE)),
    "deepseek_v3": (  # multi-head latent attention, grouped top-k routing, a dense first layer
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            _COMMON,
            **_MLA,
            num_key_value_heads=4,
            n_routed_experts=8,
            n_group=2,
            topk_group=1,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            n_shared_experts=1,
            moe_intermediate_size=32,
        ),
    ),
    "gemma3_text": (  # sliding and full layers, each with its own rotary embedding
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(_HEAD, sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
    ),
    "opt": (
        "OPTConfig",
        "OPTForCausalLM",
        dict(
            _IDS,
            hidden_size=64,
            ffn_dim=128,
            word_embed_proj_dim=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            pad_token_id=0,
        ),
    ),
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(_IDS, n_embd=64, n_layer=2, n_head=4),
    ),
    # multi-head latent attention, embeddings scaled by scale_emb (12): logits about ten times larger
    # than the others', so bf16's static-cache gap to eager's dynamic cache is larger in absolute terms
    # (docs/huggingface.md, Equality)
    "minicpm3": (
        "MiniCPM3Config",
        "MiniCPM3ForCausalLM",
        dict(_COMMON, **_MLA, num_key_value_heads=4),
    ),
    # chunked attention, mixture of experts; its get_compiled_call returns the plain forward in
    # transformers 5.23-5.24, so the adapter shadows that method on the instance during generate
    "llama4_text": (
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        dict(_HEAD, intermediate_size_mlp=128, num_local_experts=2, num_experts_per_tok=1),
    ),
}

#: Architectures ``devgraph.wrap`` refuses (with the reason's key words), built the same way.
REFUSED: dict[str, tuple[str, str, dict[str, Any]]] = {
    "bloom": (
        "BloomConfig",
        "BloomForCausalLM",
        dict(_IDS, hidden_size=64, n_layer=2, n_head=4),
    ),
    "mpt": (  # ALiBi through config.attn_config.alibi (and use_cache=False in its config)
        "MptConfig",
        "MptForCausalLM",
        dict(_IDS, d_model=64, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=64),
    ),
}

_FALCON = dict(_IDS, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)

#: Architectures whose decode step transformers 5.23 writes with a line a graph cannot capture, found
#: only by a recording (Falcon indexes with a Python list, a host tensor made inside the capture and
#: freed when it ends): accepted at wrap, refused at the first capture.
CAPTURE_REFUSED: dict[str, tuple[str, str, dict[str, Any]]] = {
    "falcon_new_decoder": (
        "FalconConfig",
        "FalconForCausalLM",
        dict(_FALCON, num_kv_heads=2, new_decoder_architecture=True),
    ),
    "falcon_multi_query": (
        "FalconConfig",
        "FalconForCausalLM",
        dict(_FALCON, new_decoder_architecture=False, multi_query=True),
    ),
}

#: Architectures whose decode step reads device values on the host (transformers 5.23): a capture
#: refuses it in every mode, and the wrap-time dry run of the decode step finds it. The
#: mixture-of-experts ones route on the host: JetMoE ``expert_size.tolist()``, DBRX and LongCat-Flash
#: loop over the experts ``nonzero()`` finds (on the CPU refused a line earlier, in ``one_hot(top_k_index,
#: num_classes=...)``, whose CPU kernel checks the indices on the host); XGLM branches on a device value.
HOST_READING_DECODE: dict[str, tuple[str, str, dict[str, Any]]] = {
    "xglm": (
        "XGLMConfig",
        "XGLMForCausalLM",
        dict(
            _IDS,
            d_model=64,
            ffn_dim=128,
            num_layers=2,
            attention_heads=4,
            max_position_embeddings=64,
            pad_token_id=0,
        ),
    ),
    "jetmoe": (
        "JetMoeConfig",
        "JetMoeForCausalLM",
        dict(
            _IDS,
            hidden_size=64,
            num_hidden_layers=2,
            num_key_value_heads=2,
            kv_channels=16,
            intermediate_size=128,
            num_local_experts=4,
            num_experts_per_tok=2,
        ),
    ),
    "dbrx": (  # clip_qkv: transformers 5.23's DbrxAttention clamps with it, None fails
        "DbrxConfig",
        "DbrxForCausalLM",
        dict(
            _IDS,
            d_model=64,
            n_heads=4,
            n_layers=2,
            max_seq_len=64,
            attn_config=dict(kv_n_heads=2, clip_qkv=8.0),
            ffn_config=dict(ffn_hidden_size=128, moe_num_experts=4, moe_top_k=2),
        ),
    ),
    "longcat_flash": (  # one layer holds two attention layers (num_hidden_layers = 2 * num_layers)
        "LongcatFlashConfig",
        "LongcatFlashForCausalLM",
        dict(
            _IDS,
            **_MLA,
            hidden_size=64,
            num_layers=1,
            num_attention_heads=4,
            num_key_value_heads=4,
            ffn_hidden_size=128,
            expert_ffn_hidden_size=32,
            n_routed_experts=4,
            zero_expert_num=2,
            moe_topk=2,
            head_dim=8,
        ),
    ),
}

#: Architectures the wrap-time static-cache check cannot run as it runs others: GPT-1 keeps no KV cache
#: (its forward returns none), CPM-Ant's forward fails over a static cache (as does its eager
#: ``generate(cache_implementation="static")``). Both are refused at wrap by name; eager
#: ``model.generate()`` runs them.
CHECK_FAILS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "openai_gpt": (
        "OpenAIGPTConfig",
        "OpenAIGPTLMHeadModel",
        dict(n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=VOCAB),
    ),
    "cpmant": (  # prompt_types >= 3: its forward prepends prompt tokens of the third type
        "CpmAntConfig",
        "CpmAntForCausalLM",
        dict(
            hidden_size=64,
            dim_head=16,
            dim_ff=128,
            num_attention_heads=4,
            num_hidden_layers=2,
            vocab_size=VOCAB,
            prompt_length=4,
            prompt_types=4,
            segment_types=4,
            position_bias_num_buckets=32,
            position_bias_max_distance=64,
        ),
    ),
}


#: Fixes of a config after it is built, where a release's modeling code reads a field its config class
#: does not set (transformers 5.23's DbrxAttention reads ``attn_config.rope_theta``).
def _dbrx_rope_theta(config: Any) -> None:
    if not hasattr(config.attn_config, "rope_theta"):
        config.attn_config.rope_theta = 10000.0


_AFTER_CONFIG = {"dbrx": _dbrx_rope_theta}


def tiny_model(name: str, dtype: torch.dtype = torch.float32, **overrides: Any) -> torch.nn.Module:
    """The architecture ``name``, seeded, in eval mode."""
    import pytest
    import transformers

    every = {**ARCHITECTURES, **REFUSED, **CAPTURE_REFUSED, **HOST_READING_DECODE, **CHECK_FAILS}
    config_name, model_name, base = {**every, **CACHE_LENGTH_DEPENDENT}[name]
    if not hasattr(transformers, model_name):  # a release without it: skip by capability
        pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
    config = getattr(transformers, config_name)(**{**base, **overrides})
    if name in _AFTER_CONFIG:
        _AFTER_CONFIG[name](config)
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config).to(dtype).eval()


def prompts(batch: int, seed: int, length: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts (ids 3.. so no special token) and an all-ones mask."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=gen)
    return ids, torch.ones_like(ids)


def full_length_static_cache(model: torch.nn.Module, max_cache_len: int) -> Any:
    """An eager ``generate`` cache laid out as devgraph's: a full-length ``StaticLayer`` per layer,
    sliding-window layers included (transformers' own static cache gives those a window-length one)."""
    from transformers.cache_utils import Cache, StaticLayer

    layers = model.config.get_text_config(decoder=True).num_hidden_layers
    return Cache(layers=[StaticLayer(max_cache_len=max_cache_len) for _ in range(layers)])


#: Architectures whose attention depends on the static cache's length (GPT-Neo's local window is sliced
#: by the number of cached keys): refused at wrap by the static-cache check when the window is
#: shorter than ``max_cache_len``.
CACHE_LENGTH_DEPENDENT: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gpt_neo": (
        "GPTNeoConfig",
        "GPTNeoForCausalLM",
        dict(
            _IDS,
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=4,
            attention_types=[[["global", "local"], 1]],
            window_size=4,
            max_position_embeddings=512,
        ),
    ),
}
