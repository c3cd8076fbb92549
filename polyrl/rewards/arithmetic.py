"""Exact-match reward for the synthetic arithmetic task (data_source "arithmetic").

The response must be exactly the answer (whitespace ignored) *and* the model must have stopped on
its own with the end-of-sequence token. Without the EOS condition a policy learns to emit the
answer and ramble until max_tokens (or to pad), and a truncated "12" of "123" would score; so
`finished_with_eos` is a required keyword: a caller cannot forget it.
"""

from __future__ import annotations

from typing import Any


def arithmetic_score(
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    finished_with_eos: bool,
) -> float:
    """1.0 when the EOS-terminated response equals the answer, else 0.0.

    `solution_str` is the decoded response without special tokens.
    """
    if not finished_with_eos:
        return 0.0
    answer = "".join(str(ground_truth).split())
    return 1.0 if "".join(solution_str.split()) == answer and answer else 0.0
