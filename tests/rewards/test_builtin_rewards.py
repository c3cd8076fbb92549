"""Built-in scorers: arithmetic (with the EOS rule), GSM8K extraction, MATH boxed equivalence."""

import pytest

from polyrl.rewards.arithmetic import arithmetic_score
from polyrl.rewards.gsm8k import extract_answer, gsm8k_score
from polyrl.rewards.math_boxed import last_boxed, math_score


@pytest.mark.parametrize(
    "response, eos, expected",
    [
        ("85", True, 1.0),
        (" 8 5 \n", True, 1.0),  # whitespace is ignored
        ("85", False, 0.0),  # hit max_tokens / padding: no reward even if the text is right
        ("86", True, 0.0),
        ("85 because", True, 0.0),
        ("", True, 0.0),
    ],
)
def test_arithmetic(response, eos, expected):
    assert arithmetic_score(response, "85", None, finished_with_eos=eos) == expected


def test_arithmetic_requires_the_eos_flag():
    with pytest.raises(TypeError, match="finished_with_eos"):
        arithmetic_score("85", "85", None)


@pytest.mark.parametrize(
    "response, method, expected",
    [
        ("She has 3 + 4 = 7 apples.\n#### 7", "strict", 1.0),
        ("#### 1,000", "strict", 1.0),  # commas removed
        ("so #### 7.0", "strict", 1.0),  # numeric comparison
        ("#### 8", "strict", 0.0),
        ("The answer is 7", "strict", 0.0),  # strict needs "#### "
        ("The answer is 7.", "flexible", 1.0),  # flexible falls back to the last number
        ("I got 7 then 9", "flexible", 0.0),
        ("#### 7 but maybe 9", "flexible", 1.0),  # "####" wins over the last number
        ("no numbers here", "flexible", 0.0),
    ],
)
def test_gsm8k(response, method, expected):
    assert gsm8k_score(response, "7" if "1,000" not in response else "1000", None, method=method) == expected


def test_gsm8k_extraction_looks_at_the_tail_only():
    assert extract_answer("#### 5" + "x" * 400) is None
    assert extract_answer("#### -3") == "-3"


@pytest.mark.parametrize(
    "text, content",
    [
        (r"so \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
        (r"\boxed{1} then \boxed{2}", "2"),
        (r"\fbox{x^{2}}", "x^{2}"),
        (r"$\boxed 5$", "5"),
        (r"\boxed{\frac{1}{2}", None),  # cut off inside the box
        ("no box", None),
    ],
)
def test_last_boxed(text, content):
    assert last_boxed(text) == content


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        (r"The answer is $\boxed{0.5}$", r"\frac{1}{2}", 1.0),
        (r"$\boxed{\frac12}$", "0.5", 1.0),
        (r"\boxed{\dfrac{\sqrt{2}}{2}}", r"\frac{\sqrt2}{2}", 1.0),
        (r"\boxed{1+x}", "x+1", 1.0),
        (r"\boxed{3}", r"\boxed{3}", 1.0),  # ground truth stored with its box
        (r"\boxed{4}", "3", 0.0),
        ("the answer is 3", "3", 0.0),  # no box, no score
        (r"\boxed{}", "3", 0.0),
    ],
)
def test_math(response, truth, expected):
    assert math_score(response, truth, None) == expected


def test_math_in_worker_thread_does_not_need_signals():
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(math_score, r"\boxed{\frac{2}{4}}", "0.5", None).result() == 1.0
