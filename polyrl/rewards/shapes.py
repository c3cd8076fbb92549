"""Exact-answer reward for the synthetic shapes task (data_source "shapes", polyrl/data/shapes.py).

The answer is one word (a count or a colour): the response must be it, case and surrounding
whitespace ignored, and the model must have stopped on its own with EOS, for the reason
polyrl/rewards/arithmetic.py gives (a run-on or a truncated answer never scores).
"""

from __future__ import annotations

from typing import Any


def shapes_score(solution_str: str, ground_truth: Any, extra_info: dict | None = None, *,
                 finished_with_eos: bool) -> float:
    """1.0 when the EOS-terminated response is the answer, else 0.0."""
    if not finished_with_eos:
        return 0.0
    answer = str(ground_truth).strip().lower()
    return 1.0 if answer and solution_str.strip().lower() == answer else 0.0
