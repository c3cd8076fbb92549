"""An MLFLOW_TRACKING_URI the installed MLflow cannot open is one line at start (issue 41, poor 9):
polyrl[mlflow] installs mlflow-skinny, which has no SQLAlchemy, so a sqlite:/// store used to
warn once inside the run and log nothing while the run exited 0."""

from __future__ import annotations

import importlib.util

import pytest

from polyrl.trainer.sinks import SinkUnavailable, check_available
from polyrl.trainer.sinks_mlflow import file_store_refused

pytest.importorskip("mlflow")
NO_SQLALCHEMY = importlib.util.find_spec("sqlalchemy") is None


@pytest.mark.skipif(not NO_SQLALCHEMY, reason="SQLAlchemy installed: MLflow opens database stores")
@pytest.mark.parametrize("uri", ["sqlite:///mlflow.db", "postgresql+psycopg2://u@db/mlflow"])
def test_a_database_uri_without_sqlalchemy_is_one_line_before_the_run(monkeypatch, uri):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    with pytest.raises(SinkUnavailable) as info:
        check_available(["mlflow"])
    message = str(info.value)
    assert "\n" not in message and "MLFLOW_TRACKING_URI" in message and "SQLAlchemy" in message
    assert "http://HOST:5000" in message and "sqlite" not in message.split(":", 1)[1].replace(uri, "")


def test_a_scheme_no_tracking_store_serves_is_one_line(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "ftp://host/mlruns")
    with pytest.raises(SinkUnavailable) as info:
        check_available(["mlflow"])
    assert "MLFLOW_TRACKING_URI=ftp://host/mlruns" in str(info.value) and "(ftp)" in str(info.value)


@pytest.mark.parametrize("uri", ["http://127.0.0.1:5000", "https://mlflow.example", "databricks"])
def test_a_tracking_server_passes_the_check(monkeypatch, uri):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    check_available(["mlflow"])  # reachability is the sink's business, not the pre-flight's


def test_the_file_store_hint_recommends_only_what_mlflow_skinny_opens(monkeypatch):
    """The hint once named sqlite:///mlflow.db; with mlflow-skinny that store cannot open."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    hint = file_store_refused()
    if hint is None:
        pytest.skip("this MLflow opens file stores without MLFLOW_ALLOW_FILE_STORE")
    assert "sqlite" not in hint and "http://HOST:5000" in hint


def test_the_recommended_file_store_logs_with_the_installed_mlflow(tmp_path, monkeypatch):
    """What the hint recommends really works with the installed client: a run logged to the file
    store reads back."""
    from mlflow import MlflowClient

    from polyrl.trainer.sinks_mlflow import MlflowSink

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    check_available(["mlflow"])
    sink = MlflowSink("e", "r", {"actor": {"lr": 1e-5}}, tmp_path)
    sink.log(1, {"reward/mean": 0.5})
    sink.close()
    run = MlflowClient(tracking_uri=sink.uri).get_run(sink.run_id)
    assert run.data.metrics == {"reward/mean": 0.5} and run.data.params["actor.lr"] == "1e-05"
