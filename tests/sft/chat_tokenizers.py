"""Real fast tokenizers with ChatML-style chat templates, built in memory (no downloads).

Character-level BPE plus the special tokens of ChatML; `merges` adds BPE merges, e.g. one that
glues text across a turn boundary."""

from __future__ import annotations

import string

CHATML = (
    "{%- if tools -%}{{ '<|im_start|>system\\nTools: ' + (tools | tojson) + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- for m in messages -%}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
"""ChatML without {% generation %} markers (the prefix-render path)."""

CHATML_GENERATION = (
    "{%- if tools -%}{{ '<|im_start|>system\\nTools: ' + (tools | tojson) + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ m['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
    "{%- else -%}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
"""The same rendering with {% generation %} markers around what the assistant writes."""

NO_TOOLS = (
    "{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
"""ChatML that never renders tools."""

REWRITES_HISTORY = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' and not loop.last -%}{{ '<|im_start|>assistant\\n[earlier]<|im_end|>\\n' }}"
    "{%- else -%}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
"""Earlier assistant turns are replaced (as templates that drop old reasoning do)."""

BARE = ("{%- for m in messages -%}{%- if m['role'] == 'assistant' -%}{{ m['content'] + eos_token }}"
        "{%- else -%}{{ m['content'] }}{%- endif -%}{%- endfor -%}")
"""The bundled tiny model's template: turns glued together, no separators."""

SPECIAL = ["<pad>", "<|im_start|>", "<|im_end|>"]


def chat_tokenizer(template: str, merges: tuple[tuple[str, str], ...] = ()):
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL)}
    for c in string.printable:
        vocab.setdefault(c, len(vocab))
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(merges)))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<pad>")
    out.chat_template = template
    return out
