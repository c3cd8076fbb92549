"""The MLflow sink against a real local file store, read back through MlflowClient; a tracking
server that is down; the package missing."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest

from polyrl.trainer import sinks as sinks_mod
from polyrl.trainer.sinks import SinkUnavailable, build_sinks, close_all, log_all
from polyrl.trainer.sinks_mlflow import flatten, upload_run_files

mlflow = pytest.importorskip("mlflow", reason="mlflow not installed (pip install 'polyrl[mlflow]')")


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A file store in tmp_path named by MLFLOW_TRACKING_URI, as a user would set it."""
    uri = (tmp_path / "store").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


def only_run(uri, experiment):
    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    (run,) = client.search_runs([exp.experiment_id])
    return client, run


def test_params_metrics_and_run_files_read_back(tmp_path, store, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    out = tmp_path / "run"
    config = {"actor": {"lr": 1e-5, "clip": [0.2, 0.28]}, "logging": {"experiment_name": "exp-a"},
              "reward": {"custom_function": None}}
    sinks = build_sinks(["jsonl", "mlflow"], out, "my-run", config)
    log_all(sinks, 1, {"reward/score_mean": 0.25, "note": "text is skipped"})
    log_all(sinks, 2, {"reward/score_mean": 0.5, "reward/acc/openai/gsm8k": 1.0, "odd*key": 3})
    close_all(sinks)
    (out / "summary.json").write_text('{"steps": 2}')
    (out / "curves.png").write_bytes(b"\x89PNG fake bytes are fine for a file store")
    assert upload_run_files(out) == ["summary.json", "curves.png"]

    client, run = only_run(store, "exp-a")  # the experiment named by logging.experiment_name
    assert run.info.run_name == "my-run" and run.info.status == "FINISHED"
    assert run.data.params == {"actor.lr": "1e-05", "actor.clip": "[0.2, 0.28]",
                               "logging.experiment_name": "exp-a", "reward.custom_function": "null"}
    history = client.get_metric_history(run.info.run_id, "reward/score_mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.25), (2, 0.5)]
    assert run.data.metrics["reward/acc/openai/gsm8k"] == 1.0 and run.data.metrics["odd_key"] == 3.0
    assert "note" not in run.data.metrics
    assert sorted(a.path for a in client.list_artifacts(run.info.run_id)) == ["curves.png", "summary.json"]


def test_resume_continues_the_same_run(tmp_path, store, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    close_all(build_sinks(["mlflow"], tmp_path, "r", {}))
    sinks = build_sinks(["mlflow"], tmp_path, "r", {}, resume_step=1)
    log_all(sinks, 2, {"x": 1.0})
    close_all(sinks)
    client, run = only_run(store, "polyrl")  # one run, not two
    assert run.data.metrics == {"x": 1.0}


def test_default_store_is_in_the_output_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    sinks = build_sinks(["mlflow"], tmp_path, "r", {}, experiment_name="e")
    log_all(sinks, 1, {"x": 2.0})
    close_all(sinks)
    _, run = only_run((tmp_path / "mlruns").as_uri(), "e")
    assert run.data.metrics == {"x": 2.0}


@pytest.mark.parametrize("uri", [None, "file:///tmp/somewhere"])
def test_a_file_store_mlflow_refuses_is_one_line_before_the_run(tmp_path, monkeypatch, uri):
    if not hasattr(__import__("mlflow.environment_variables").environment_variables,
                   "MLFLOW_ALLOW_FILE_STORE"):
        pytest.skip("this MLflow opens file stores without MLFLOW_ALLOW_FILE_STORE")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    if uri is None:
        monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    else:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    with pytest.raises(SinkUnavailable) as info:
        sinks_mod.check_available(["jsonl", "mlflow"])
    message = str(info.value)
    assert "export MLFLOW_ALLOW_FILE_STORE=true" in message and "\n" not in message
    assert (uri or "OUTPUT_DIR/mlruns") in message
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")  # a server: no question
    sinks_mod.check_available(["jsonl", "mlflow"])


def no_proxies(monkeypatch):
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)


def test_server_down_warns_once_and_training_goes_on(tmp_path, monkeypatch, caplog):
    no_proxies(monkeypatch)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    with caplog.at_level(logging.WARNING, logger="polyrl.trainer.sinks_mlflow"):
        sinks = build_sinks(["jsonl", "mlflow"], tmp_path, "r", {"a": 1})
        for step in range(1, 4):
            log_all(sinks, step, {"x": float(step)})
        close_all(sinks)
        assert upload_run_files(tmp_path) == []
    warnings = [r for r in caplog.records if "no longer sent" in r.getMessage()]
    assert len(warnings) == 1 and f"127.0.0.1:{port}" in warnings[0].getMessage()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3  # the record is whole


def test_missing_package_names_the_pip_command(tmp_path, monkeypatch):
    real = sinks_mod.importlib.util.find_spec
    monkeypatch.setattr(sinks_mod.importlib.util, "find_spec",
                        lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(SinkUnavailable) as info:
        sinks_mod.check_available(["jsonl", "mlflow"])
    assert str(info.value) == ('logging.sinks includes mlflow but the mlflow package is not installed: '
                               'pip install "polyrl[mlflow]" (or drop mlflow from logging.sinks)')
    with pytest.raises(SinkUnavailable):
        build_sinks(["mlflow"], tmp_path, "r", {})


def test_logging_config_accepts_mlflow_and_an_experiment_name():
    from polyrl.job import LoggingConfig

    cfg = LoggingConfig(sinks=["mlflow"], experiment_name="team-exp")
    assert cfg.sinks == ["jsonl", "mlflow"] and cfg.experiment_name == "team-exp"


def test_flatten_nested_config():
    assert flatten({"a": {"b": 1, "c": {"d": "x"}}, "e": [1, 2], "f": {}}) == \
        {"a.b": "1", "a.c.d": "x", "e": "[1, 2]", "f": "{}"}


@pytest.mark.slow
def test_a_training_run_logs_to_mlflow(ray_session, tmp_path, store, monkeypatch):
    """A 2-step `polyrl.train` with logging.sinks=[mlflow]: the resolved config as params, the
    step metrics, and the run's summary.json and curves.png as artifacts."""
    import json

    import polyrl

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    out = tmp_path / "run"
    summary = polyrl.train({"trainer.total_steps": 2, "trainer.val_every": 0,
                            "trainer.val_before_train": False, "data.val_files": [],
                            "trainer.output_dir": str(out), "trainer.progress_bar": False,
                            "logging.sinks": ["mlflow"], "logging.experiment_name": "polyrl-test"})
    client, run = only_run(store, "polyrl-test")
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    assert run.data.params["trainer.total_steps"] == "2"
    assert run.data.params["logging.sinks"] == '["jsonl", "mlflow"]'
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    history = client.get_metric_history(run.info.run_id, "reward/score_mean")
    assert [(m.step, m.value) for m in history] == [(r["step"], r["reward/score_mean"]) for r in logged]
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"summary.json", "curves.png",
                                                                        "config.yaml"}
    artifact = mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="summary.json",
                                                   tracking_uri=store, dst_path=str(tmp_path / "dl"))
    assert json.loads(Path(artifact).read_text()) == summary


def test_polyrl_train_without_mlflow_installed_is_one_line_before_ray(tmp_path, monkeypatch, capsys, caplog):
    """`polyrl train logging.sinks=[mlflow]` with the package missing: exit 2, the pip command,
    no traceback, and Ray never started."""
    import ray

    from polyrl.cli.main import main

    ray_before = ray.is_initialized()  # another test's session: then only "not started" is unseen
    real = sinks_mod.importlib.util.find_spec
    monkeypatch.setattr(sinks_mod.importlib.util, "find_spec",
                        lambda name, *a: None if name == "mlflow" else real(name, *a))
    code = main(["train", "trainer.progress_bar=false", f"trainer.output_dir={tmp_path / 'out'}",
                 "logging.sinks=[mlflow]"])
    err = capsys.readouterr().err + caplog.text
    assert code == 2 and 'pip install "polyrl[mlflow]"' in err and "Traceback" not in err
    assert ray.is_initialized() == ray_before


def test_a_server_behind_a_proxy_is_left_to_mlflow(monkeypatch):
    from polyrl.trainer.sinks_mlflow import _server_answers

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    no_proxies(monkeypatch)
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    assert "cannot connect" in _server_answers(f"http://127.0.0.1:{port}")
    monkeypatch.setenv("http_proxy", "http://proxy.invalid:3128")
    assert _server_answers(f"http://mlflow.internal:{port}") is None
