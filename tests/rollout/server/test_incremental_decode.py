"""Incremental detokenization for streamed text and per-token log-prob pieces: the same text as a
full decode (multi-byte characters, SentencePiece-style leading spaces, stop strings), while
decoding a bounded number of tokens per step instead of the whole sample every step."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from polyrl.rollout.base import TokenOutput
from polyrl.rollout.server.openai_format import IncrementalDecoder, TokenText
from polyrl.rollout.server.openai_stream import SampleText
from polyrl.training.model_loading import load_tokenizer

TEXT = "héllo wörld → 日本語, ok. " * 12
BOUND = 16
"""Token ids decoded per generated token, at most (the window: new tokens + a few of context)."""


class Counting:
    """A tokenizer proxy that counts the token ids it is asked to decode."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids, **kw):
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, **kw)


@pytest.fixture(scope="module")
def byte_level():
    return load_tokenizer("builtin:tiny-arith")  # byte-level BPE: é is two tokens


def word_tokenizer(decoder, words=("hello", "world", "again", ".", "do", "n't", "n", "'", "t", "go"),
                   **kwargs) -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, "<sep>": 1, **{f"\u2581{w}": i + 2 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoder
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                   additional_special_tokens=["<sep>"], **kwargs)


@pytest.fixture(scope="module")
def metaspace():
    """A SentencePiece-style tokenizer: a decode drops the leading space of its first word."""
    return word_tokenizer(decoders.Metaspace())


def same_as_full_decode_at_every_step(tokenizer, ids):
    decoder = IncrementalDecoder(tokenizer)
    for i, token in enumerate(ids, 1):
        assert decoder.add([token]) == tokenizer.decode(ids[:i], skip_special_tokens=True), i


def test_decoder_equals_a_full_decode_at_every_step(byte_level):
    ids = byte_level.encode(TEXT, add_special_tokens=False)
    counting = Counting(byte_level)
    decoder = IncrementalDecoder(counting)
    for i, token in enumerate(ids, 1):
        assert decoder.add([token]) == byte_level.decode(ids[:i], skip_special_tokens=True)
    # a full decode per step reads ~n^2/2 ids; the window reads about ten per step
    assert counting.decoded <= BOUND * len(ids) < len(ids) ** 2 / 8


def test_decoder_keeps_sentencepiece_leading_spaces(metaspace):
    ids = metaspace.encode("hello world again . hello", add_special_tokens=False)
    assert metaspace.decode(ids[1:2]) == "world"  # alone: no leading space
    decoder = IncrementalDecoder(metaspace)
    texts = [decoder.add([t]) for t in ids]
    assert texts[-1] == metaspace.decode(ids) == "hello world again . hello"
    assert texts[1] == "hello world"


def test_skipped_special_tokens_mid_stream_keep_the_spaces(metaspace):
    """A skipped special token decodes to nothing: the context reaches back past it."""
    sep = metaspace.convert_tokens_to_ids("<sep>")
    hello, world, again = metaspace.encode("hello world again", add_special_tokens=False)
    ids = [hello, sep, world, sep, sep, again, world]
    assert metaspace.decode(ids, skip_special_tokens=True) == "hello world again world"
    same_as_full_decode_at_every_step(metaspace, ids)


def test_cleanup_rewrites_across_the_window_fall_back_to_a_full_decode():
    """clean_up_tokenization_spaces rewrites " ." and " n't" spanning several tokens."""
    tok = word_tokenizer(decoders.Metaspace(), clean_up_tokenization_spaces=True)
    ids = tok.encode("do n't go . do n ' t go . hello again .", add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == "don't go. don't go. hello again."
    same_as_full_decode_at_every_step(tok, ids)


def test_streamed_text_equals_the_final_text_in_linear_decode_work(byte_level):
    ids = byte_level.encode(TEXT + "STOP and more", add_special_tokens=False)
    counting = Counting(byte_level)
    sample = SampleText(TokenText(counting), stops=["STOP"])
    pieces = [sample.add([t]) for t in ids]
    final_text = byte_level.decode(ids, skip_special_tokens=True).split("STOP")[0]
    out = TokenOutput(token_ids=ids, logprobs=[0.0] * len(ids), stop_reason="stop", weight_version=0, text=final_text)
    streamed = "".join(pieces) + sample.finish(out)
    assert streamed == final_text
    assert "\ufffd" not in "".join(pieces) and "STOP" not in streamed
    assert counting.decoded <= BOUND * len(ids)


def test_logprob_pieces_join_to_the_text_in_linear_decode_work(byte_level):
    ids = byte_level.encode(TEXT, add_special_tokens=False)
    counting = Counting(byte_level)
    out = TokenOutput(token_ids=ids, logprobs=[0.0] * len(ids), stop_reason="length", weight_version=0)
    pieces = TokenText(counting).pieces(out)
    assert len(pieces) == len(ids) and "".join(pieces) == TEXT
    assert pieces[1] == "" and pieces[2] == "é"  # é's first byte waits for its second
    assert counting.decoded <= (BOUND + 1) * len(ids)  # + the one full decode of the final text
