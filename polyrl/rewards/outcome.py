"""One scoring result, whatever produced it (function, endpoint, reward model), and the one
reading of a scorer's answer shared by all of them."""

from __future__ import annotations

import math
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

    @property
    def failed(self) -> bool:
        return self.error is not None or self.timed_out


class BadScoreError(ValueError):
    """A scorer answered something that is not a score."""


def read_score(out: Any, who: str = "reward function") -> tuple[float, float, dict[str, float]]:
    """(score, acc, extras) from a float or a {"score", "acc"?, ...} dict; raises BadScoreError
    naming `who` for anything else (a missing key, a string, NaN)."""
    extras: dict[str, float] = {}
    if isinstance(out, dict):
        if "score" not in out:
            raise BadScoreError(f"{who} returned a dict without 'score': {sorted(out)}")
        score = _number(out["score"], who)
        acc = _number(out["acc"], who) if "acc" in out else float(score > 0)
        extras = {
            k: float(v) for k, v in out.items()
            if k not in ("score", "acc") and isinstance(v, (int, float, bool))
        }
    elif isinstance(out, (int, float)):  # bool included: a pass/fail verifier
        score = float(out)
        acc = float(score > 0)
    else:
        raise BadScoreError(f"{who} returned {type(out).__name__}; expected float or dict")
    if not math.isfinite(score):
        raise BadScoreError(f"{who} returned a non-finite score {score}")
    return score, acc, extras


def _number(value: Any, who: str) -> float:
    if not isinstance(value, (int, float)):
        raise BadScoreError(f"{who} returned score {value!r}; expected a number")
    return float(value)
