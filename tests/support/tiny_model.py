"""A two-layer Llama with a word-level tokenizer, written to a folder: a real transformers +
peft model for trainer tests that need no download and run in seconds (the fast tier)."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 64


def write_tiny_llama(out: Path, seed: int = 0) -> Path:
    from tokenizers import Tokenizer, models
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    cfg = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                               max_position_embeddings=128, tie_word_embeddings=True)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    vocab = {"<pad>": 0, "<unk>": 1} | {f"w{i}": i for i in range(2, VOCAB)}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
                            pad_token="<pad>", unk_token="<unk>").save_pretrained(out)
    return out
