"""Encoding a conversation costs work linear in its size when it is over data.max_length (drop,
error, and left truncation alike): measured as characters the chat template renders plus
characters the tokenizer reads, through a real tokenizer that counts them. Before, every row was
encoded in full first (a render per assistant turn: quadratic in turns) and left truncation
re-encoded once per dropped turn (cubic)."""

from __future__ import annotations

from typing import Any

import pytest

from chat_tokenizers import CHATML, chat_tokenizer
from polyrl.data import DataFileError
from polyrl.sft import ChatEncoder
from polyrl.sft.data import first_fitting, fit

TURNS = 2000


class CountingTokenizer:
    """A real tokenizer that tallies the characters it renders and tokenises."""

    def __init__(self, tokenizer: Any):
        self._tokenizer, self.chars = tokenizer, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def apply_chat_template(self, *args, **kwargs):
        out = self._tokenizer.apply_chat_template(*args, **kwargs)
        self.chars += len(out) if isinstance(out, str) else len(out["input_ids"])
        return out

    def __call__(self, text: str, **kwargs):
        self.chars += len(text)
        return self._tokenizer(text, **kwargs)


@pytest.fixture(scope="module")
def tok():
    return chat_tokenizer(CHATML)


def conversation(turns: int) -> list[dict]:
    return [{"role": "system", "content": "be brief"}] + [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}: " + "x" * 40}
        for i in range(turns)]


@pytest.mark.parametrize("truncation", ["drop", "left", "error"])
def test_an_over_long_row_costs_work_linear_in_its_size(tok, truncation):
    messages = conversation(TURNS)
    size = len(tok.apply_chat_template(messages, tokenize=False))
    counting = CountingTokenizer(tok)
    encoder = ChatEncoder(counting)
    counting.chars = 0
    if truncation == "error":
        with pytest.raises(DataFileError, match=r"row 7: the conversation has \d+ tokens > data.max_length=512"):
            fit(encoder, messages, None, 512, truncation, "row 7")
    else:
        encoded, shortened = fit(encoder, messages, None, 512, truncation, "row 7")
        assert (encoded is not None, shortened) == ((True, True) if truncation == "left" else (False, False))
    # one render and one tokenisation of the whole row, plus work bounded by max_length; the
    # quadratic encoding read about TURNS / 2 times the row
    assert counting.chars <= 3 * size, (counting.chars, size)


def test_left_truncation_keeps_the_longest_suffix_that_fits_as_before(tok):
    messages = conversation(200)
    encoder = ChatEncoder(tok)
    encoded, shortened = fit(encoder, messages, None, 300, "left", "row")
    assert shortened and len(encoded.input_ids) <= 300
    # the reference: drop the oldest exchange one at a time until it fits (what fit did before)
    head, rest = messages[:1], messages[1:]
    while encoder.count_tokens(head + rest) > 300:
        rest = rest[2:]
    assert encoded == encoder.encode(head + rest)


@pytest.mark.parametrize("n, answer", [(1, 0), (1, None), (9, 0), (9, 4), (9, 8), (9, None), (100, 37)])
def test_first_fitting_finds_the_boundary_probing_log_many(n, answer):
    probes = []

    def fits(k: int) -> bool:
        probes.append(k)
        return answer is not None and k >= answer

    assert first_fitting(n, fits) == answer
    assert len(probes) <= 2 * max(1, n).bit_length() + 1
