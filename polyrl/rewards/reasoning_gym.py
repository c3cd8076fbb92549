"""Reward of reasoning-gym rows (data_source "reasoning_gym", polyrl/data/reasoning_gym.py): the
task's own scorer, `score_answer(answer, entry)`, on the entry the row was generated from.

The answer is the text inside the response's last `<answer>...</answer>` (the form reasoning-gym's
`system=default` prompt asks for) or, without those tags, the whole response stripped (a model
prompted to answer bare, such as the bundled tiny-arith). A task's scorer may give partial credit
(0 < score < 1); the accuracy counts only a full score.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Callable

PIP_INSTALL = "pip install 'polyrl[reasoning-gym]'"


def reasoning_gym_score(solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> dict:
    entry = (extra_info or {}).get("entry")
    if not isinstance(entry, dict):
        raise ValueError("a reasoning_gym row needs extra_info.entry (the generated entry); rows "
                         "come from data files named reasoning_gym:TASK?size=N&seed=S")
    task = (entry.get("metadata") or {}).get("source_dataset") or extra_info["task"]
    score = float(_scorer(task)(_answer(solution_str), entry))
    return {"score": score, "acc": float(score >= 1.0)}


def _answer(solution_str: str) -> str:
    from reasoning_gym.utils import extract_answer

    tagged = extract_answer(solution_str)
    return tagged if tagged is not None else solution_str.strip()


@lru_cache(maxsize=None)
def _scorer(task: str) -> Callable[[str, dict], float]:
    try:
        import reasoning_gym
    except ImportError:
        raise ImportError(f"scoring reasoning_gym rows needs reasoning-gym: {PIP_INSTALL}") from None
    return reasoning_gym.get_score_answer_fn(task)
