"""Random-init Qwen2 checkpoints with a char-level tokenizer, for benchmarks (written to a temp dir).

The tokenizer covers the model's whole vocabulary, so whatever a random model samples decodes:
ids 0/1 are `<pad>`/`<eos>`, then one token per printable ASCII character (prompts such as
``37+48=`` are one token per character), then filler tokens ``<t123>`` up to `vocab_size` (never
produced by tokenising text, but decodable). The chat template renders message contents as is, so
both polyrl and TRL tokenise the same prompt to the same ids. (transformers 5 loads it back as a
`Qwen2Tokenizer` with the same vocabulary; printable ASCII maps to the same ids either way.)

Shapes (~4M and ~30M parameters, embeddings tied as in small Qwen2 models) are
`benchmarks/rollout.py`'s `MODELS`.
"""

from __future__ import annotations

import string
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rollout import MODELS  # noqa: E402,F401  (the same two shapes as the rollout benchmark)

PAD_ID, EOS_ID = 0, 1
CHAT_TEMPLATE = ("{%- for m in messages -%}{%- if m['role'] == 'assistant' -%}{{ m['content'] + eos_token }}"
                 "{%- else -%}{{ m['content'] }}{%- endif -%}{%- endfor -%}")


def char_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD_ID, "<eos>": EOS_ID}
    for c in string.printable:
        if c not in "\t\n\r\x0b\x0c":
            vocab[c] = len(vocab)
    while len(vocab) < vocab_size:
        vocab[f"<t{len(vocab)}>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.Fuse()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>",
                                  padding_side="left")
    out.chat_template = CHAT_TEMPLATE
    return out


def build_model(path: str | Path, shape: dict, seed: int = 0, max_positions: int = 256) -> int:
    """Write a random Qwen2ForCausalLM + tokenizer to `path` (a `shape` with a model_type, such as
    rollout.py's qwen3_moe cells, that model instead); returns the parameter count."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    shape = dict(shape)
    config = AutoConfig.for_model(shape.pop("model_type", "qwen2"), **shape, tie_word_embeddings=True,
                                  max_position_embeddings=max_positions, eos_token_id=EOS_ID,
                                  pad_token_id=PAD_ID, bos_token_id=None)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(str(path))
    char_tokenizer(shape["vocab_size"]).save_pretrained(str(path))
    return model.num_parameters()
