"""Tiny random Llama / Qwen2 / Qwen3 checkpoints and a char-level tokenizer, built once per session.

Everything is written with `save_pretrained` into a temp dir, so the tests never download.
"""

from __future__ import annotations

import string

import torch

EOS = 1
VOCAB = 128


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": EOS}
    for c in string.printable:
        if c not in "\t\n\r\x0b\x0c":
            vocab[c] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # no merges: one token per character
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")


def _config(arch: str):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=256, eos_token_id=EOS,
        initializer_range=0.1,
    )
    if arch == "llama":
        return LlamaConfig(**common, tie_word_embeddings=True, rope_theta=5000.0)
    if arch == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=False)
    return Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)


def build_model_dir(arch: str, path, seed: int = 0) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(arch)).eval()
    with torch.no_grad():  # non-trivial norms and biases so every weight path is exercised
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(path))
    _tokenizer().save_pretrained(str(path))
    return str(path)


