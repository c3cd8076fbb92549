"""RewardManager: routing by data_source, user functions, errors, timeouts."""

import logging
import sys
import textwrap

import pytest

from polyrl.config import ConfigError, load_config
from polyrl.rewards import (
    RewardConfig,
    RewardManager,
    RewardRequest,
    UnknownDataSourceError,
    ended_with_eos,
)

# functions referenced by module path "<this module>:..." (pytest puts this test directory
# on sys.path, so the module imports under its own __name__)
THIS = __name__


def contains_truth(solution_str, ground_truth, extra_info):
    return {"score": 1.0 if str(ground_truth) in solution_str else 0.0, "acc": 0.5, "len": len(solution_str)}


def verl_style(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    return float(solution_str == ground_truth) + bonus + (data_source == "mine")


def boom(solution_str, ground_truth, extra_info):
    if solution_str == "boom":
        raise RuntimeError("verifier exploded")
    return 1.0


SLOW_RELEASE = __import__("threading").Event()
"""Set at the end of the time-out test: its "slow" calls block on it until then."""


def sleepy(solution_str, ground_truth, extra_info):
    if solution_str == "slow":
        SLOW_RELEASE.wait()
    return 1.0


RELEASE = __import__("threading").Event()
"""Set at the end of the stuck-scorer test: its calls block on it, as a hung verifier would."""


def hangs(solution_str, ground_truth, extra_info):
    RELEASE.wait()
    return 1.0


def always_raises(solution_str, ground_truth, extra_info):
    raise KeyError("answer")


def req(text, truth="7", source="openai/gsm8k", eos=True):
    return RewardRequest(source, text, truth, eos)


@pytest.fixture
def manager_factory():
    made = []

    def make(**cfg):
        m = RewardManager(RewardConfig(**cfg))
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()


def test_builtins_route_by_data_source(manager_factory):
    m = manager_factory()
    out = m.score([
        req("#### 7"),
        req("#### 8", source="gsm8k"),
        req("85", "85", "arithmetic", eos=True),
        req("85", "85", "arithmetic", eos=False),
        req(r"\boxed{0.5}", r"\frac12", "lighteval/MATH"),
    ])
    assert out.scores == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert out.accs == out.scores
    assert out.metrics["reward/errors"] == 0 and out.metrics["reward/score_mean"] == 0.6
    assert out.metrics["reward/acc/arithmetic"] == 0.5


def test_gsm8k_method_from_config(manager_factory):
    assert manager_factory().score([req("answer: 7")]).scores == [0.0]
    assert manager_factory(gsm8k_method="flexible").score([req("answer: 7")]).scores == [1.0]


def test_unknown_data_source_lists_sources_and_fix(manager_factory):
    m = manager_factory()
    with pytest.raises(UnknownDataSourceError, match=r"registered data sources: arithmetic.*reward.custom_function="):
        m.score([req("x", source="my/dataset")])
    with pytest.raises(UnknownDataSourceError):
        m.check_sources(["gsm8k", "my/dataset"])


def test_custom_function_from_module_path_takes_precedence(manager_factory):
    m = manager_factory(custom_function=f"{THIS}:contains_truth")
    out = m.score([req("it is 7"), req("it is 8"), req("7", source="anything/else")])
    assert out.scores == [1.0, 0.0, 1.0]
    assert out.accs == [0.5, 0.5, 0.5]  # the function's own acc
    assert out.extras[0] == {"len": 7.0}


def test_custom_function_for_listed_sources_only(manager_factory):
    m = manager_factory(custom_function=f"{THIS}:contains_truth", custom_function_sources=["mine"])
    out = m.score([req("it is 7", source="mine"), req("it is 7")])  # second one: built-in gsm8k
    assert out.scores == [1.0, 0.0]


def test_custom_function_from_file_with_verl_signature(tmp_path, manager_factory):
    path = tmp_path / "my_reward.py"
    path.write_text(textwrap.dedent("""
        def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
            return float(solution_str.strip() == ground_truth) + bonus
    """))
    m = manager_factory(custom_function=f"{path}:compute_score", custom_function_kwargs={"bonus": 0.5})
    assert m.score([req("7"), req("9")]).scores == [1.5, 0.5]


def test_custom_function_load_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        RewardManager(RewardConfig(custom_function=f"{tmp_path}/nope.py:fn"))
    with pytest.raises(ValueError, match="has no function 'nope'.*contains_truth"):
        RewardManager(RewardConfig(custom_function=f"{THIS}:nope"))
    with pytest.raises(ValueError, match="cannot import module"):
        RewardManager(RewardConfig(custom_function="no_such_module_xyz:fn"))
    with pytest.raises(ConfigError, match="reward.custom_function=my_pkg"):
        load_config(RewardConfig, overrides=["custom_function=just_a_name"])
    with pytest.raises(ConfigError, match="custom_function_sources is set"):
        load_config(RewardConfig, overrides=["custom_function_sources=[a]"])


def test_raising_function_scores_zero_counted_and_logged_once(manager_factory, caplog):
    m = manager_factory(custom_function=f"{THIS}:boom")
    with caplog.at_level(logging.ERROR, logger="polyrl.rewards.manager"):
        out = m.score([req("ok"), req("boom"), req("boom")])
    assert out.scores == [1.0, 0.0, 0.0]
    assert out.failed == [False, True, True]
    assert out.metrics["reward/errors"] == 2.0
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(tracebacks) == 1 and "verifier exploded" in str(tracebacks[0].exc_info[1])


def test_bad_return_value_counts_as_error(manager_factory):
    m = manager_factory(custom_function="builtins:str")  # returns a str, not a score
    out = m.score([req("x")])
    assert out.scores == [0.0] and out.metrics["reward/errors"] == 1.0


def returns_per_text(solution_str, ground_truth, extra_info):
    """What verl-style reward functions return, chosen by the response text."""
    import numpy as np
    import torch

    return {"np32": np.float32(0.5), "np64": np.float64(0.25), "npint": np.int64(2),
            "tensor": torch.tensor(0.75), "array": np.array(1.5),
            "dict": {"score": torch.tensor(1.0), "acc": np.float32(0.0), "len": np.int32(3)},
            "huge": {"score": 1e308}, "big": -2e6, "nan_acc": {"score": 1.0, "acc": float("nan")},
            "inf": float("inf"), "vector": torch.tensor([1.0, 2.0])}[solution_str]


def test_numpy_and_0d_tensor_scores_are_numbers(manager_factory):
    m = manager_factory(custom_function=f"{THIS}:returns_per_text")
    out = m.score([req(t) for t in ("np32", "np64", "npint", "tensor", "array", "dict")])
    assert out.scores == [0.5, 0.25, 2.0, 0.75, 1.5, 1.0]
    assert out.accs == [1.0, 1.0, 1.0, 1.0, 1.0, 0.0]
    assert out.extras[5] == {"len": 3.0}
    assert out.metrics["reward/errors"] == 0.0 and not any(out.failed)


def test_absurd_or_non_finite_scores_are_refused_like_a_raising_call(manager_factory, caplog):
    import math

    from polyrl.rewards.outcome import MAX_ABS_SCORE

    m = manager_factory(custom_function=f"{THIS}:returns_per_text")
    texts = ("huge", "big", "nan_acc", "inf", "vector", "np32")
    with caplog.at_level(logging.ERROR, logger="polyrl.rewards.manager"):
        out = m.score([req(t) for t in texts])
    assert out.scores == [0.0, 0.0, 0.0, 0.0, 0.0, 0.5] and out.accs[:5] == [0.0] * 5
    assert out.failed == [True] * 5 + [False]
    assert out.metrics["reward/errors"] == 5.0
    assert all(math.isfinite(v) for v in (out.metrics["reward/score_mean"], out.metrics["reward/acc_mean"]))
    summary = m.error_summary()
    assert summary["errors"] == 5 and f"beyond the accepted magnitude {MAX_ABS_SCORE:g}" in summary["first_error"]
    (logged,) = [r for r in caplog.records if r.exc_info]  # the first failure, once per source
    assert "1e+308" in str(logged.exc_info[1])
    for text, needle in [("nan_acc", "non-finite acc nan"), ("inf", "non-finite score inf"),
                         ("vector", "expected a number or a dict"), ("big", "-2e+06")]:
        m2 = manager_factory(custom_function=f"{THIS}:returns_per_text")
        m2.score([req(text)])
        assert needle in m2.error_summary()["first_error"], text


def test_sleeping_function_times_out(manager_factory):
    m = manager_factory(custom_function=f"{THIS}:sleepy", timeout_s=0.2, num_workers=2)
    try:
        # the "slow" calls never return while the test runs: scoring that waited for them would
        # hang (the suite's timeout), so returning at all shows it did not wait
        out = m.score([req("slow"), req("fast"), req("fast"), req("slow"), req("fast")])
        assert out.scores == [0.0, 1.0, 1.0, 0.0, 1.0]
        assert out.metrics["reward/timeouts"] == 2.0 and out.metrics["reward/errors"] == 0.0
        # the pool replaced its stuck workers: the next batch is served, none timed out
        again = m.score([req("fast")] * 4)
        assert again.scores == [1.0] * 4 and again.metrics["reward/timeouts"] == 0.0
    finally:
        SLOW_RELEASE.set()


def test_ended_with_eos():
    assert ended_with_eos([5, 2], [2])
    assert not ended_with_eos([5, 3], [2, 0])
    assert not ended_with_eos([], [2])


def test_a_function_failing_on_every_call_warns_once_and_is_summarised(manager_factory, caplog):
    m = manager_factory(custom_function=f"{THIS}:always_raises")
    with caplog.at_level(logging.WARNING, logger="polyrl.rewards.manager"):
        for _ in range(3):
            m.score([req("x")] * 4)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "100% of reward calls so far failed (4 errors, 0 timeouts of 4)" in warnings[0]
    assert "KeyError: 'answer'" in warnings[0] and "reward.warn_error_rate=0.5" in warnings[0]
    summary = m.error_summary()
    assert summary["calls"] == 12 and summary["errors"] == 12 and summary["error_rate"] == 1.0
    assert summary["over_warn_rate"] and summary["first_error"].startswith("data_source 'openai/gsm8k': KeyError")


def test_occasional_failures_stay_quiet(manager_factory, caplog):
    m = manager_factory(custom_function=f"{THIS}:boom")
    with caplog.at_level(logging.WARNING, logger="polyrl.rewards.manager"):
        m.score([req("ok")] * 9 + [req("boom")])
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    assert m.error_summary()["error_rate"] == 0.1 and not m.error_summary()["over_warn_rate"]


def test_null_ground_truth_is_counted(manager_factory):
    m = manager_factory()
    out = m.score([req("7"), req("7", truth=None)])
    assert out.metrics["reward/null_ground_truth"] == 1.0
    assert m.error_summary()["null_ground_truth"] == 1


def test_stuck_scorer_threads_are_bounded(manager_factory, caplog):
    """A verifier that never returns: without a bound, one new thread per call."""
    m = manager_factory(custom_function=f"{THIS}:hangs", timeout_s=0.05, num_workers=2)
    try:
        with caplog.at_level(logging.ERROR, logger="polyrl.rewards.executor"):
            for _ in range(6):
                out = m.score([req("x")] * 4)
                assert out.scores == [0.0] * 4 and out.failed == [True] * 4
        pool = m._pool
        assert pool.threads <= pool.num_workers + pool.max_stuck == 2 + 8
        assert m.error_summary()["timeouts"] == 24
        assert "no more threads are started" in caplog.text
    finally:
        RELEASE.set()  # the stuck calls return; their threads exit
    for worker in list(m._pool._stuck):
        worker.join(timeout=30)
    assert m.score([req("x")] * 2).scores == [1.0, 1.0]  # the pool grew back
