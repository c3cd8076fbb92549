"""The assistant mask comes from the model's own chat template: the masked token ids of each turn
are exactly the template's rendering of that turn, for templates with and without
{% generation %} markers, and templates that cannot give an exact mask are refused."""

from __future__ import annotations

import pytest

from chat_tokenizers import BARE, CHATML, CHATML_GENERATION, NO_TOOLS, REWRITES_HISTORY, chat_tokenizer
from polyrl.sft import ChatEncoder, TemplateError
from polyrl.training.model_loading import load_tokenizer

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "6, since 3+3=6."},
]


def runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    """The maximal runs of masked token ids, in order."""
    out, current = [], []
    for i, m in zip(ids, mask):
        if m:
            current.append(i)
        elif current:
            out.append(current)
            current = []
    return out + ([current] if current else [])


def expected_turns(tok, messages, turn_text) -> list[list[int]]:
    return [tok(turn_text(m), add_special_tokens=False)["input_ids"]
            for m in messages if m["role"] == "assistant"]


def test_prefix_renders_mask_exactly_each_assistant_turn():
    tok = chat_tokenizer(CHATML)
    enc = ChatEncoder(tok).encode(CONVERSATION)
    # the ids are the tokenisation of the full rendering: what the model sees at inference
    assert enc.input_ids == tok(tok.apply_chat_template(CONVERSATION, tokenize=False),
                                add_special_tokens=False)["input_ids"]
    want = expected_turns(tok, CONVERSATION, lambda m: m["content"] + "<|im_end|>\n")
    assert runs(enc.input_ids, enc.loss_mask) == want
    # the generation prompt and every user/system token stay out of the loss
    assert sum(enc.loss_mask) == sum(map(len, want))


def test_generation_tags_and_prefix_renders_agree():
    tok = chat_tokenizer(CHATML_GENERATION)
    tagged = ChatEncoder(tok)
    assert tagged.use_generation_tags
    by_tags = tagged.encode(CONVERSATION)
    by_prefixes = ChatEncoder(tok, use_generation_tags=False).encode(CONVERSATION)
    assert by_tags.input_ids == by_prefixes.input_ids
    assert by_tags.loss_mask == by_prefixes.loss_mask
    assert runs(by_tags.input_ids, by_tags.loss_mask) == expected_turns(
        tok, CONVERSATION, lambda m: m["content"] + "<|im_end|>\n")


def test_template_without_generation_tags_needs_the_fallback():
    tok = chat_tokenizer(CHATML)
    # transformers' own mask is all zeros for such a template: using it would train on nothing
    out = tok.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True)
    assert not any(out["assistant_masks"])
    encoder = ChatEncoder(tok)
    assert not encoder.use_generation_tags
    assert any(encoder.encode(CONVERSATION).loss_mask)


def test_bundled_tiny_model_template_masks_answer_and_eos():
    tok = load_tokenizer("builtin:tiny-arith")
    messages = [{"role": "user", "content": "37+48="}, {"role": "assistant", "content": "85"},
                {"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]
    enc = ChatEncoder(tok).encode(messages)
    assert runs(enc.input_ids, enc.loss_mask) == expected_turns(
        tok, messages, lambda m: m["content"] + tok.eos_token)
    assert tok.decode([i for i, m in zip(enc.input_ids, enc.loss_mask) if m]) == "85<eos>3<eos>"


def test_a_token_across_a_turn_boundary_is_refused():
    tok = chat_tokenizer(BARE, merges=(("=", "8"),))  # "=8" glues the question to the answer
    tok.eos_token = "<|im_end|>"
    messages = [{"role": "user", "content": "37+48="}, {"role": "assistant", "content": "85"}]
    with pytest.raises(TemplateError, match="merges '=8' across the boundary"):
        ChatEncoder(tok).encode(messages)


def test_a_template_that_rewrites_history_is_refused():
    with pytest.raises(TemplateError, match="message 2: rendering later turns changes"):
        ChatEncoder(chat_tokenizer(REWRITES_HISTORY)).encode(CONVERSATION)


def test_tools_render_or_are_refused():
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    tok = chat_tokenizer(CHATML)
    enc = ChatEncoder(tok).encode(CONVERSATION, tools)
    assert "Tools: " in tok.decode(enc.input_ids)
    assert runs(enc.input_ids, enc.loss_mask) == expected_turns(
        tok, CONVERSATION, lambda m: m["content"] + "<|im_end|>\n")
    with pytest.raises(TemplateError, match="does not render them"):
        ChatEncoder(chat_tokenizer(NO_TOOLS)).encode(CONVERSATION, tools)


def test_a_tokenizer_without_template_is_a_clear_error():
    tok = chat_tokenizer(CHATML)
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        ChatEncoder(tok)
