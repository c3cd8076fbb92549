"""One scoring result, whatever produced it (function, endpoint, reward model), and the one
reading of a scorer's answer shared by all of them."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Outcome:
    score: float = 0.0
    acc: float = 0.0
    extras: dict[str, float] = field(default_factory=dict)
    """Other numeric keys of the answer (reported as reward/extra/<key> metrics)."""
    error: BaseException | None = None
    """Why the call failed (it scores 0 and counts in reward/errors)."""
    timed_out: bool = False
    """The call ran past its timeout (it scores 0 and counts in reward/timeouts)."""
    no_score: bool = False
    """A batched (TRL-style) function answered None for this sample: it scores 0, is not a
    failure, and counts in reward/no_score."""

    @property
    def failed(self) -> bool:
        return self.error is not None or self.timed_out


class BadScoreError(ValueError):
    """A scorer answered something that is not a score."""


MAX_ABS_SCORE = 1e6
"""Largest |score| accepted. Far above any verifier's scale, and far below where sums overflow:
a batch holding a 1e308 score had a mean of inf, NaN advantages, skipped updates and then an
exit blaming the learning rate. A score beyond it is refused like a raising call (0, counted)."""


def read_score(out: Any, who: str = "reward function") -> tuple[float, float, dict[str, float]]:
    """(score, acc, extras) from a number or a {"score", "acc"?, ...} dict; raises BadScoreError
    naming `who` for anything else (a missing key, a string, NaN or inf, |score| > MAX_ABS_SCORE).

    A number is a Python int / float / bool, a NumPy scalar or a 0-d array or tensor (common in
    verl reward functions), converted to float."""
    extras: dict[str, float] = {}
    if isinstance(out, dict):
        if "score" not in out:
            raise BadScoreError(f"{who} returned a dict without 'score': {sorted(out)}")
        score = _number(out["score"], who, "score")
        acc = _number(out["acc"], who, "acc") if "acc" in out else float(score > 0)
        for key, value in out.items():
            if key not in ("score", "acc") and (number := _scalar(value)) is not None:
                extras[key] = number
    elif _scalar(out) is not None:
        score = _number(out, who, "score")
        acc = float(score > 0)
    else:
        raise BadScoreError(f"{who} returned {type(out).__name__}; expected a number or a dict "
                            "with 'score'")
    if abs(score) > MAX_ABS_SCORE:
        raise BadScoreError(f"{who} returned score {score:g}, beyond the accepted magnitude "
                            f"{MAX_ABS_SCORE:g} (polyrl/rewards/outcome.py MAX_ABS_SCORE); scale it down")
    return score, acc, extras


def _scalar(value: Any) -> float | None:
    """`value` as a float if it is one number (see `read_score`), else None."""
    if isinstance(value, numbers.Real):  # int, float, bool, NumPy integer and floating scalars
        return float(value)
    if getattr(value, "shape", None) == () and callable(getattr(value, "item", None)):
        item = value.item()  # a 0-d NumPy array or torch tensor
        return float(item) if isinstance(item, numbers.Real) else None
    return None


def _number(value: Any, who: str, key: str) -> float:
    number = _scalar(value)
    if number is None:
        raise BadScoreError(f"{who} returned {key} {value!r} ({type(value).__name__}); expected a number")
    if not math.isfinite(number):
        raise BadScoreError(f"{who} returned a non-finite {key} {number}")
    return number
