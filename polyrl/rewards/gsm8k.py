"""GSM8K reward: the number after "#### " must equal the ground truth.

Same extraction as verl's gsm8k scorer (so scores are comparable): only the last 300 characters
are searched (a model that writes a long answer is still judged on its final line), commas and
"$" are removed. "strict" needs the "#### n" format the prompt asks for; "flexible" falls back to
the last number in the response. Numbers are compared numerically ("72.0" equals "72").
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any, Literal

CLIP_CHARS = 300
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")


def extract_answer(solution_str: str, method: Literal["strict", "flexible"] = "strict") -> str | None:
    """The final answer as a string without commas or "$", or None when there is none."""
    tail = solution_str[-CLIP_CHARS:]
    found = _STRICT.findall(tail)
    if not found and method == "flexible":
        found = [n for n in _NUMBER.findall(tail) if n.strip(".,")]
    if not found:
        return None
    return found[-1].replace(",", "").replace("$", "").rstrip(".")


def _same_number(a: str, b: str) -> bool:
    try:
        return Decimal(a) == Decimal(b)
    except InvalidOperation:
        return a == b


def gsm8k_score(
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    method: Literal["strict", "flexible"] = "strict",
) -> float:
    answer = extract_answer(solution_str, method)
    if answer is None:
        return 0.0
    truth = str(ground_truth).replace(",", "").replace("$", "").strip()
    return 1.0 if _same_number(answer, truth) else 0.0
