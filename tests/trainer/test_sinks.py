"""Metric sinks: JSONL (append, resume), TensorBoard read back from its event file, W&B offline."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from polyrl.config import ConfigError, load_config
from polyrl.trainer import sinks as sinks_mod
from polyrl.job import LoggingConfig
from polyrl.trainer.sinks import (
    JsonlSink,
    MetricsSink,
    SinkUnavailable,
    WandbSink,
    build_sinks,
    close_all,
    log_all,
)


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_appends_flushes_and_keeps_earlier_lines_on_reopen(tmp_path):
    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(path)
    sink.log(0, {"val/acc": 0.25})
    sink.log(1, {"reward/score_mean": torch.tensor(0.5), "n": 3})
    assert [r["step"] for r in lines(path)] == [0, 1]  # flushed before close
    sink.close()
    assert lines(path)[1] == {"step": 1, "reward/score_mean": 0.5, "n": 3}

    sink = JsonlSink(path)  # resume without truncation: appends
    sink.log(2, {"x": 1.0})
    sink.close()
    assert [r["step"] for r in lines(path)] == [0, 1, 2]


def test_jsonl_resume_drops_redone_steps_and_partial_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "a": 1}\n{"step": 1, "a": 2}\n{"step": 2, "a": 3}\n{"step": 3, "a"')
    sink = JsonlSink(path, keep_through=1)
    sink.log(2, {"a": 9})
    sink.close()
    assert lines(path) == [{"step": 0, "a": 1}, {"step": 1, "a": 2}, {"step": 2, "a": 9}]


def test_jsonl_never_glues_a_record_to_a_cut_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "a": 1}\n{"step": 1, "a"')
    sink = JsonlSink(path)
    sink.log(1, {"a": 2})
    sink.close()
    assert path.read_text().splitlines()[-1] == '{"step": 1, "a": 2}'


def test_logging_config_always_has_jsonl_first_and_validates_choices():
    assert LoggingConfig().sinks == ["jsonl"]
    chosen = LoggingConfig(sinks=["tensorboard", "wandb", "tensorboard"]).sinks
    assert chosen == ["jsonl", "tensorboard", "wandb"]
    assert LoggingConfig(sinks=[]).sinks == ["jsonl"]
    with pytest.raises(ConfigError, match="sinks"):
        load_config(LoggingConfig, overrides=["sinks=[neptune]"])
    with pytest.raises(ConfigError, match="samples_every"):
        load_config(LoggingConfig, overrides=["samples_every=-1"])
    assert LoggingConfig().resolved_run_name(Path("/x/my-run")) == "my-run"
    assert LoggingConfig(run_name="exp1").resolved_run_name(Path("/x/my-run")) == "exp1"


def test_missing_optional_package_names_the_extra(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(sinks_mod.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("tensorboard", "wandb") else real(name, *a))
    for name in ("tensorboard", "wandb"):
        with pytest.raises(SinkUnavailable) as info:
            build_sinks(["jsonl", name], tmp_path, "run", {})
        message = str(info.value)
        assert f'pip install "polyrl[{name}]"' in message and "\n" not in message
    assert [type(s).__name__ for s in build_sinks(["jsonl"], tmp_path, "run", {})] == ["JsonlSink"]


def test_tensorboard_scalars_read_back(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard not installed (pip install 'polyrl[tensorboard]')")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sinks = build_sinks(["tensorboard"], tmp_path, "run", {})
    assert [type(s).__name__ for s in sinks] == ["JsonlSink", "TensorBoardSink"]
    assert all(isinstance(s, MetricsSink) for s in sinks)
    for step in range(3):
        log_all(sinks, step, {"reward/score_mean": 0.1 * step, "response/length_mean": 10.0 + step,
                              "note": "not a number"})
    close_all(sinks)

    def scalars(tag):
        acc = EventAccumulator(str(tmp_path / "tensorboard"))
        acc.Reload()
        assert set(acc.Tags()["scalars"]) == {"reward/score_mean", "response/length_mean"}
        return [(e.step, round(e.value, 5)) for e in acc.Scalars(tag)]

    assert scalars("reward/score_mean") == [(0, 0.0), (1, 0.1), (2, 0.2)]
    assert len(lines(tmp_path / "metrics.jsonl")) == 3

    # resumed from the checkpoint of step 1: the interrupted run's step 2 is hidden and redone
    sinks = build_sinks(["tensorboard"], tmp_path, "run", {}, resume_step=1)
    log_all(sinks, 2, {"reward/score_mean": 0.5, "response/length_mean": 1.0})
    close_all(sinks)
    assert scalars("reward/score_mean") == [(0, 0.0), (1, 0.1), (2, 0.5)]
    assert [r["step"] for r in lines(tmp_path / "metrics.jsonl")] == [0, 1, 2]

    # a fresh run in the same directory: nothing of the old runs shows
    sinks = build_sinks(["tensorboard"], tmp_path, "run", {})
    log_all(sinks, 0, {"reward/score_mean": 0.9, "response/length_mean": 1.0})
    close_all(sinks)
    assert scalars("reward/score_mean") == [(0, 0.9)]
    assert lines(tmp_path / "metrics.jsonl") == [
        {"step": 0, "reward/score_mean": 0.9, "response/length_mean": 1.0}]


def test_wandb_offline_run_without_network(tmp_path):
    pytest.importorskip("wandb", reason="wandb not installed (pip install 'polyrl[wandb]')")
    sinks = build_sinks(["wandb"], tmp_path, "offline-test", {"actor": {"lr": 1e-5}}, wandb_mode="offline")
    wandb_sink = sinks[-1]
    for step in range(3):
        log_all(sinks, step, {"reward/score_mean": 0.1 * step})
    close_all(sinks)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    run_id = (tmp_path / "wandb" / "run_id").read_text().strip()
    assert (runs[0] / f"run-{run_id}.wandb").stat().st_size > 0
    assert wandb_sink.run.id == run_id

    # resuming continues the same W&B run id; a fresh start gets a new one
    resumed = WandbSink("polyrl", "offline-test", {}, tmp_path, "offline", resume=True)
    resumed.log(3, {"x": 1.0})
    resumed.close()
    assert resumed.run.id == run_id
