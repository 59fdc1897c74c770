"""Builds a tiny Llama checkpoint directory (config + tokenizer, no weights) for SGLang's dummy loader.

Nothing is downloaded: the config comes from ``transformers.LlamaConfig`` and the tokenizer is a
word-level ``tokenizers`` model over a fixed vocabulary, saved as a ``PreTrainedTokenizerFast``.
SGLang loads it with ``load_format="dummy"`` (random weights from a fixed seed), so two engines
built from the same directory hold the same weights.
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


def build(directory: str | Path) -> Path:
    """Writes config.json and the tokenizer files into ``directory`` and returns it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

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
    config = LlamaConfig(
        vocab_size=256,  # > len(vocab): the extra ids are never produced by the tokenizer
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
        architectures=["LlamaForCausalLM"],
    )
    config.save_pretrained(path)
    return path
