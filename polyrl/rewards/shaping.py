"""Shaping terms to add to a verifier with reward.combine (docs/rewards.md).

They take the reward-function arguments, so they are named like any user function:
    reward.combine.gsm8k: [{kind: function},
                           {kind: function, function: "polyrl.rewards.shaping:length_penalty",
                            kwargs: {target_chars: 400, max_chars: 800}, weight: 0.5}]
"""

from __future__ import annotations


def length_penalty(solution_str: str, ground_truth, extra_info, target_chars: int = 512,
                   max_chars: int = 1024) -> dict[str, float]:
    """0 up to `target_chars` characters, falling linearly to -1 at `max_chars` and beyond.
    Characters, not tokens, so the term means the same under any tokenizer (for a token budget
    see algorithm.overlong, docs/algorithms.md). acc is 0: a penalty says nothing of
    correctness, and the combined accuracy is the first term's anyway."""
    if not 0 <= target_chars < max_chars:
        raise ValueError(f"length_penalty needs 0 <= target_chars < max_chars, got "
                         f"target_chars={target_chars}, max_chars={max_chars}")
    over = max(0, len(solution_str) - target_chars)
    return {"score": -min(1.0, over / (max_chars - target_chars)), "acc": 0.0}
