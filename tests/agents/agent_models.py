"""Tokenizers and checkpoints for the agent tests, built in temp dirs (no downloads).

Two real tokenizers, trained here on a small corpus: a byte-level BPE (GPT-2 / Qwen style) and a
SentencePiece-style BPE (Metaspace "▁" pre-tokenizer and decoder), both with a ChatML template
that renders tools and tool turns the way Qwen2.5's does (system tool list, tool results as
<tool_response> blocks inside a user turn).

Two kinds of checkpoint, both run by the real native engine:
- `build_random_model`: a random 1-layer Qwen2 (random text: exactness under arbitrary ids);
- `build_scripted_model`: a 1-layer Qwen2 whose weights are set by hand so that greedy decoding
  is a fixed script: after the assistant header it writes `call_text` then <|im_end|>, unless a
  <tool_response> is anywhere in its context, in which case it writes `answer_text` then
  <|im_end|>. It is a bigram table in the LM head plus one attention head that detects the
  <tool_response> token (its query and key live in the slowest RoPE pair, so position barely
  matters) and raises a "flag" hidden dimension. Each script piece is one added token.
"""

from __future__ import annotations

import math
import string
from pathlib import Path

import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{ '\\n</tools>\\nCall a tool as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{%- endif %}"
    "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)

CORPUS = [
    string.printable,
    "the answer is 5. what is 2+3? compute 1234*567 with the calculator tool.",
    '{"name": "add", "arguments": {"a": 2, "b": 3}} tool_response user assistant system',
    "hello world, tools are functions; results come back as text.",
] * 4


def _wrap(tok, pieces) -> "PreTrainedTokenizerFast":  # noqa: F821
    from transformers import PreTrainedTokenizerFast

    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=["<|im_start|>"])
    out.add_tokens(TAGS + list(pieces))
    out.chat_template = TEMPLATE
    return out


def byte_level_tokenizer(pieces=()):
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(CORPUS, vocab_size=320, min_frequency=2, special_tokens=SPECIALS, show_progress=False)
    return _wrap(tok._tokenizer, pieces)


def metaspace_tokenizer(pieces=()):
    """SentencePiece-style: spaces become "▁" and a decode drops the text's leading space."""
    from tokenizers import SentencePieceBPETokenizer, decoders, pre_tokenizers

    tok = SentencePieceBPETokenizer(unk_token="<unk>")
    tok.train_from_iterator(CORPUS, vocab_size=320, min_frequency=2, special_tokens=["<unk>"] + SPECIALS,
                            show_progress=False)
    # "first" (Llama / Mistral without legacy): only the text's very start gets a "▁"; a piece
    # that follows a special token does not, which is what makes a naive delta encode wrong
    tok._tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok._tokenizer.decoder = decoders.Metaspace(prepend_scheme="first")
    return _wrap(tok._tokenizer, pieces)


def _config(tokenizer, hidden: int, layers: int, **kw):
    from transformers import Qwen2Config

    return Qwen2Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                       intermediate_size=kw.pop("intermediate", 2 * hidden), vocab_size=len(tokenizer),
                       max_position_embeddings=1024, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id, **kw)


def build_random_model(path: Path, tokenizer, seed: int = 0) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(_config(tokenizer, 64, 1, tie_word_embeddings=True)).save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return str(path)


def build_scripted_model(path: Path, tokenizer, header_token: int, call_text: str, answer_text: str) -> str:
    """Greedy script: header -> call_text -> EOS, or, once a <tool_response> is in context,
    header -> answer_text -> EOS. `header_token` is the last token of the assistant header."""
    from transformers import AutoModelForCausalLM

    V = len(tokenizer)
    H = -(-(V + 1) // 8) * 8  # one hidden dim per token, one flag dim; 4 heads of an even size
    hd, flag = H // 4, H - 1
    model = AutoModelForCausalLM.from_config(_config(tokenizer, H, 1, intermediate=8, tie_word_embeddings=False,
                                                     rope_theta=1e6))
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (call_text, answer_text, "<tool_response>")}
    eos = tokenizer.eos_token_id
    sd = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    for k in sd:
        if "norm" in k:
            sd[k].fill_(1.0)
    sd["model.embed_tokens.weight"][torch.arange(V), torch.arange(V)] = 1.0
    # attention head 0 fires on <tool_response>: score ~30 there, 0 elsewhere; value 1 -> flag dim
    d = hd // 2 - 1  # the slowest-rotating RoPE pair (d, d + hd/2)
    norm_gain = math.sqrt(H)  # RMSNorm of a one-hot embedding
    sd["model.layers.0.self_attn.q_proj.bias"][d] = 1.0
    sd["model.layers.0.self_attn.k_proj.weight"][d, ids["<tool_response>"]] = 30.0 * math.sqrt(hd) / norm_gain
    sd["model.layers.0.self_attn.v_proj.weight"][0, ids["<tool_response>"]] = 1.0 / norm_gain
    sd["model.layers.0.self_attn.o_proj.weight"][flag, 0] = 1.0
    M, head = 40.0, sd["lm_head.weight"]
    head[ids[call_text], header_token] = M
    head[ids[answer_text], header_token] = M / 2
    head[ids[answer_text], flag] = 0.75 * M  # flag set: answer (1.25 M) beats the call (0)
    head[ids[call_text], flag] = -M
    head[eos, ids[call_text]] = M
    head[eos, ids[answer_text]] = M
    model.load_state_dict(sd)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return str(path)
