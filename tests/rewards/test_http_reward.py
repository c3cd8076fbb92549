"""reward.http against a real HTTP server on 127.0.0.1: scores, extra metrics, retries, a server
that hangs (blocked on an event released at teardown), answers 500, answers garbage, refuses."""

from __future__ import annotations

import socket

import numpy as np
import pytest

from polyrl.config import ConfigError, load_config
from polyrl.rewards import RewardConfig, RewardManager, RewardRequest


@pytest.fixture
def manager_factory():
    made = []

    def make(**http):
        m = RewardManager(RewardConfig(http=http))
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()


def req(text, truth="7", mode="ok", source="code"):
    return RewardRequest(source, text, truth, True, {"mode": mode})


def test_scores_extras_and_body(server, manager_factory):
    m = manager_factory(url=server.url)
    truth = np.array([1, 2])  # Parquet rows hold numpy values: they travel as JSON lists
    out = m.score([req("7"), req("8"), RewardRequest("code", "[1, 2]", truth, False, None)])
    assert out.scores == [1.0, 0.0, 1.0]
    assert out.accs == [1.0, 0.0, 1.0]
    assert out.extras[0] == {"tests_passed": 3.0}  # numbers only; "note" is text
    assert out.metrics["reward/extra/tests_passed"] == 2.0
    assert out.metrics["reward/errors"] == 0 and out.metrics["reward/timeouts"] == 0
    assert {"data_source": "code", "solution_str": "[1, 2]", "ground_truth": [1, 2],
            "extra_info": None} in server.bodies
    assert all(set(b) == {"data_source", "solution_str", "ground_truth", "extra_info"} for b in server.bodies)


def test_hanging_server_times_out_without_holding_up_the_rest(server, manager_factory):
    m = manager_factory(url=server.url, timeout_s=0.3, retries=0)
    out = m.score([req("7", mode="hang"), req("7"), req("7", mode="hang"), req("8")])
    assert out.scores == [0.0, 1.0, 0.0, 0.0]
    assert out.failed == [True, False, True, False]
    assert out.metrics["reward/timeouts"] == 2 and out.metrics["reward/errors"] == 0
    assert m.score([req("7")]).scores == [1.0]  # the client is still serving
    assert m.error_summary()["timeouts"] == 2


def test_500_is_retried_then_counted(server, manager_factory):
    m = manager_factory(url=server.url, retries=2, backoff_s=0.01)
    out = m.score([req("7", mode="500"), req("7", mode="flaky"), req("7")])
    assert out.scores == [0.0, 1.0, 1.0]
    assert out.failed == [True, False, False]
    assert out.metrics["reward/errors"] == 1
    assert server.hits["500:7"] == 3  # one try + two retries
    assert server.hits["flaky:7"] == 2  # recovered on the first retry
    assert out.metrics["reward/http_retries"] == 3
    assert "HTTP 500" in m.error_summary()["first_error"]


def test_garbage_and_client_errors_are_not_retried(server, manager_factory):
    m = manager_factory(url=server.url, retries=3, backoff_s=0.01)
    out = m.score([req("a", mode="garbage"), req("b", mode="no-score"), req("c", mode="400")])
    assert out.scores == [0.0, 0.0, 0.0] and out.failed == [True] * 3
    assert out.metrics["reward/errors"] == 3 and out.metrics["reward/http_retries"] == 0
    assert server.hits == {"garbage:a": 1, "no-score:b": 1, "400:c": 1}
    assert "non-JSON" in m.error_summary()["first_error"]


def test_refused_connection_is_an_error(manager_factory):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    m = manager_factory(url=f"http://127.0.0.1:{port}/score", retries=1, backoff_s=0.01)
    out = m.score([req("7"), req("7")])
    assert out.scores == [0.0, 0.0] and out.metrics["reward/errors"] == 2
    assert out.metrics["reward/http_retries"] == 2
    assert "ConnectError" in m.error_summary()["first_error"]


def test_concurrency_is_capped(server, manager_factory):
    server.pair_up, server.expected_arrivals = 2, 7
    m = manager_factory(url=server.url, max_concurrency=2)
    out = m.score([req("7", mode="pair")] * 7)
    assert out.scores == [1.0] * 7
    assert server.max_in_flight == 2


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"reward.http.url=http://HOST:PORT/PATH"):
        load_config(RewardConfig, overrides=["http.url=localhost:8000"])
    with pytest.raises(ConfigError, match=r"http.url: required"):
        load_config(RewardConfig, overrides=["http.timeout_s=3"])
    with pytest.raises(ConfigError, match=r"http.max_concurrency"):
        load_config(RewardConfig, overrides=["http.url=http://x", "http.max_concurrency=0"])
