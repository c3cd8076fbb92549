"""Tiny random checkpoints and verl-schema data for tests, written to temp dirs (no downloads)."""

from __future__ import annotations

import string
from pathlib import Path

import torch

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def char_tokenizer():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1}
    for c in string.printable:
        if c not in "\t\n\r\x0b\x0c":
            vocab[c] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.Fuse()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")
    out.chat_template = CHAT_TEMPLATE
    return out


def build_tiny_model(path: Path, seed: int = 0, hidden: int = 64, layers: int = 2) -> str:
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    config = Qwen2Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=2 * hidden, vocab_size=128,
                         max_position_embeddings=128, eos_token_id=1, pad_token_id=0,
                         tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(path))
    char_tokenizer().save_pretrained(str(path))
    return str(path)


def write_arithmetic(path: Path, n_train: int = 64, n_val: int = 16) -> dict[str, Path]:
    from polyrl.data.synthetic import write_arithmetic_dataset

    return write_arithmetic_dataset(path, n_train=n_train, n_val=n_val, seed=0)
