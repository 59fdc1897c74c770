"""Builds tiny bf16 checkpoints (config, tokenizer, random weights) that SGLang loads like real ones.

Nothing is downloaded: the configs come from ``transformers`` config classes, the weights are the
model's own random initialisation from a fixed seed (``initializer_range`` 0.02, saved as
safetensors), and the tokenizer is a word-level ``tokenizers`` model over a fixed vocabulary, saved
as a ``PreTrainedTokenizerFast``. Real-scale random weights in bf16, not SGLang's dummy loader
(every weight within 1e-3 of zero): logits then have real gaps, and a step that rounds differently
from another flips near-tied greedy tokens within a few hundred tokens, as with real models.

``ARCHS`` names the architectures the engine test runs: ``llama``, ``qwen3`` (dense with QK-norm),
``phi3`` (fused QKV and gate-up projections) and ``qwen3_moe`` (a mixture of experts with QK-norm).
``gemma2`` (sliding windows and logit soft-capping) is built for the refusal test only.
"""

from __future__ import annotations

from pathlib import Path

WORDS = (
    "the a an of to and in is it that was for on are as with his they at be this from have or by one "
    "had not but what all were when we there can your which their said if do will each about how up out "
    "them then she many some so these would other into has more her two like him see time could no make "
    "than first been its who now people my made over did down only way find use may water long little "
    "very after words called just where most know get through back much before go good new write our "
    "used me man too any day same right look think also around another came come work three word must "
    "because does part even place well such here take why things help put years different away again "
    "off went old number great tell men say small every found still between name should home big give "
    "air line set own under read last never us left end along while might next sound below saw something"
).split()

#: What every tiny model shares: 2 layers, width 64, 4 query heads over 2 KV heads of 16, bf16.
_COMMON = dict(
    vocab_size=256,  # > len(vocab): the extra ids are never produced by the tokenizer
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    torch_dtype="bfloat16",
)

ARCHS = ("llama", "qwen3", "phi3", "qwen3_moe")


def _config(arch: str):
    import transformers as tf

    if arch == "llama":
        return tf.LlamaConfig(head_dim=16, architectures=["LlamaForCausalLM"], **_COMMON)
    if arch == "qwen3":
        return tf.Qwen3Config(head_dim=16, architectures=["Qwen3ForCausalLM"], **_COMMON)
    if arch == "phi3":
        return tf.Phi3Config(architectures=["Phi3ForCausalLM"], pad_token_id=2, **_COMMON)
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            decoder_sparse_step=1,
            norm_topk_prob=True,
            architectures=["Qwen3MoeForCausalLM"],
            **_COMMON,
        )
    if arch == "gemma2":
        return tf.Gemma2Config(
            head_dim=16,
            hidden_act="gelu_pytorch_tanh",  # SGLang's Gemma 2 reads it; transformers 5 names it hidden_activation
            hidden_activation="gelu_pytorch_tanh",
            sliding_window=32,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            architectures=["Gemma2ForCausalLM"],
            **_COMMON,
        )
    raise ValueError(f"unknown tiny architecture {arch!r}; known: {(*ARCHS, 'gemma2')}")


def build(directory: str | Path, arch: str = "llama") -> Path:
    """Writes the config, random weights (seed 0) and tokenizer of a tiny ``arch`` model into ``directory``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {tok: i for i, tok in enumerate(specials + list(dict.fromkeys(WORDS)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )
    fast.save_pretrained(path)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(arch), dtype=torch.bfloat16)
    model.save_pretrained(path)
    return path
