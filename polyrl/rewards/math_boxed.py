"""MATH reward: the last \\boxed{...} of the response, checked against the ground truth with
math-verify (HuggingFace), which parses LaTeX into sympy and compares values, so \\frac{1}{2},
0.5 and \\tfrac12 are all the same answer.

math-verify's own timeouts use SIGALRM, which only works in the main thread and would also
cancel any other alarm of the process (pytest-timeout uses one). They are always disabled here;
the RewardManager bounds every call with `reward.timeout_s` instead.
"""

from __future__ import annotations

from typing import Any

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}, or "\\boxed 5"), braces matched."""
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    rest = text[start:]
    cmd = next(c for c in _BOX_COMMANDS if rest.startswith(c))
    rest = rest[len(cmd):]
    if rest.startswith(" "):  # "\boxed 5": the content runs to the next "$" or whitespace
        return rest.strip().split("$")[0].split()[0] if rest.strip() else None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, ch in enumerate(rest):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return rest[1:i]
    return None  # unbalanced: the response was cut off inside the box


def math_score(solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    from math_verify import parse, verify  # heavy (sympy): imported on first use

    answer = last_boxed(solution_str)
    if answer is None:
        return 0.0
    truth = str(ground_truth)
    truth = last_boxed(truth) or truth  # some datasets keep the whole \boxed{...} as the label
    gold = parse(f"${truth}$", parsing_timeout=None)
    pred = parse(f"${answer}$", parsing_timeout=None)
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=None) else 0.0
