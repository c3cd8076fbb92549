"""Routing per data source and weighted sums (reward.combine): a verifier plus a length penalty,
an endpoint plus a function, a failing term, and the config errors that name keys."""

from __future__ import annotations

import pytest

from polyrl.config import ConfigError, load_config
from polyrl.rewards import RewardConfig, RewardManager, RewardRequest
from polyrl.rewards.shaping import length_penalty

THIS = __name__


def exact(solution_str, ground_truth, extra_info):
    return {"score": float(solution_str == ground_truth), "acc": 0.25}


def req(text, truth="7", source="gsm8k", mode="ok"):
    return RewardRequest(source, text, truth, True, {"mode": mode})


@pytest.fixture
def make():
    made = []

    def build(*overrides):
        m = RewardManager(load_config(RewardConfig, overrides=list(overrides)))
        made.append(m)
        return m

    yield build
    for m in made:
        m.close()


def test_length_penalty():
    assert length_penalty("x" * 10, None, None, target_chars=10, max_chars=20)["score"] == 0.0
    assert length_penalty("x" * 15, None, None, target_chars=10, max_chars=20)["score"] == -0.5
    assert length_penalty("x" * 99, None, None, target_chars=10, max_chars=20)["score"] == -1.0
    with pytest.raises(ValueError, match="target_chars < max_chars"):
        length_penalty("x", None, None, target_chars=5, max_chars=5)


def test_verifier_plus_length_penalty(make):
    penalty = "{kind: function, function: 'polyrl.rewards.shaping:length_penalty', weight: 0.5, " \
              "kwargs: {target_chars: 6, max_chars: 10}}"
    m = make(f"combine={{gsm8k: [{{kind: function}}, {penalty}]}}")
    out = m.score([req("#### 7"), req("#### 7 !"), req("#### 8 and more")])
    # built-in gsm8k verifier (1, 1, 0) + 0.5 x penalty (0, -0.5 at 8 chars, -1 past 10)
    assert out.scores == [1.0, 1.0 - 0.25, 0.0 - 0.5]
    assert out.accs == [1.0, 1.0, 0.0]  # the first term's accuracy
    assert out.metrics["reward/term/function"] == pytest.approx(2 / 3)
    assert out.metrics["reward/term/length_penalty"] == pytest.approx((0 - 0.5 - 1) / 3)
    assert make().score([req("#### 7 !")]).scores == [1.0]  # without combine: verifier only


def test_endpoint_plus_function_for_every_source(make, server):
    m = make(f"http.url={server.url}", "http.sources=[]",
             f"custom_function={THIS}:exact", "custom_function_sources=[]",
             f"combine={{'*': [{{kind: http, weight: 2}}, {{kind: function, function: '{THIS}:exact', weight: -1}}]}}")
    out = m.score([req("7", source="a"), req("8", source="b", truth="8"), req("x", source="a")])
    assert out.scores == [2.0 - 1.0, 2.0 - 1.0, 0.0]
    assert out.accs == [1.0, 1.0, 0.0]  # the endpoint's
    assert out.extras[0] == {"tests_passed": 3.0}


def test_a_failing_term_scores_zero_and_the_others_count(make, server):
    m = make(f"http.url={server.url}", "http.retries=0",
             f"combine={{gsm8k: [{{kind: function}}, {{kind: http, weight: 0.5}}]}}")
    out = m.score([req("#### 7", mode="500"), req("#### 7")])
    assert out.scores == [1.0, 1.0]  # "#### 7" != "7" at the endpoint: its term gives 0
    assert out.failed == [True, False]
    assert out.metrics["reward/errors"] == 1
    assert m.error_summary()["calls"] == 4  # every term is a call


def test_routing_by_sources(make, server):
    m = make(f"http.url={server.url}", "http.sources=[code]", f"custom_function={THIS}:exact",
             "custom_function_sources=[mine]")
    assert [t.kind for t in m.terms_for("code")] == ["http"]
    assert m.terms_for("mine")[0].fn.fn is exact
    assert m.terms_for("gsm8k")[0].fn.fn.__name__ == "gsm8k_score"  # built-in
    out = m.score([req("7", source="code"), req("7", source="mine"), req("#### 7")])
    assert out.scores == [1.0, 1.0, 1.0] and out.accs == [1.0, 0.25, 1.0]


@pytest.mark.parametrize("overrides, message", [
    (["http.url=http://x", "model.path=m"],
     "reward.http and reward.model both score every data source; list which data sources each "
     "scores (reward.http.sources, reward.model.sources) or sum them with reward.combine"),
    (["http.url=http://x", "http.sources=[a]", "custom_function=m:f", "custom_function_sources=[a]"],
     "data_source 'a' is listed by both reward.custom_function and reward.http"),
    (["combine={a: [{kind: model}]}"], "combine.a[0] is kind=model but reward.model is not set; "
                                       "set reward.model.path="),
    (["combine={a: [{kind: http, function: 'm:f'}]}"], "function / kwargs apply to kind=function only"),
    (["combine={a: []}"], "combine.a is empty"),
    (["combine={a: [{kind: verifier}]}"], "'verifier' is not one of function, model, http"),
])
def test_config_errors_name_the_keys(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(RewardConfig, overrides=overrides)
    assert message in str(err.value)


def test_bad_term_function_fails_at_start_naming_it():
    cfg = load_config(RewardConfig, overrides=[f"combine={{a: [{{kind: function, function: '{THIS}:nope'}}]}}"])
    with pytest.raises(ValueError, match=r"reward.combine term function '.*:nope': '.*' has no function 'nope'"):
        RewardManager(cfg)


def test_combine_term_for_a_source_nobody_scores_is_unknown(make):
    m = make("combine={my/data: [{kind: function}]}")
    with pytest.raises(ValueError, match="no reward function for data_source 'my/data'"):
        m.check_sources(["my/data"])
