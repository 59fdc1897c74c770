"""A tiny random-weight Llama with a tiny word-level tokenizer, built locally (no downloads)."""

from __future__ import annotations

from pathlib import Path

WORDS = [f"w{i}" for i in range(250)]


def build_tiny_llama(path: Path, seed: int = 0) -> Path:
    """Write a 2-layer Llama (head dim 32: vLLM's CPU attention minimum) and its tokenizer to ``path``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {tok: i for i, tok in enumerate(specials + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            # Larger than the default init so that greedy tokens differ from step to step (a graph
            # replaying stale values shows up as different tokens).
            p.normal_(0.0, 0.2) if p.dim() > 1 else p.fill_(1.0)
    model.save_pretrained(path, safe_serialization=True)
    fast.save_pretrained(path)
    return path
