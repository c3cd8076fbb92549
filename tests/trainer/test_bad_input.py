"""What a user sees for bad input: one clear message naming the cause, exit code 2, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest


def train(*args):
    return subprocess.run([sys.executable, "-m", "polyrl", "train", "trainer.progress_bar=false", *args],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ))


def assert_clean_error(out, *needles):
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    for needle in needles:
        assert needle in out.stderr, out.stderr


def test_missing_data_file(tiny_model, tmp_path):
    out = train(f"model.path={tiny_model}", f"data.train_files=[{tmp_path}/nope.parquet]")
    assert_clean_error(out, "nope.parquet")


def test_missing_columns_are_named(tiny_model, tmp_path):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"question": ["1+1="]}), path)
    out = train(f"model.path={tiny_model}", f"data.train_files=[{path}]", "data.val_files=[]")
    assert_clean_error(out, "prompt", "bad.parquet")


def test_corrupt_file(tiny_model, tmp_path):
    path = tmp_path / "corrupt.parquet"
    path.write_bytes(b"not parquet at all")
    out = train(f"model.path={tiny_model}", f"data.train_files=[{path}]")
    assert_clean_error(out, "corrupt.parquet")


def test_missing_model_path(tmp_path):
    out = train(f"model.path={tmp_path}/no-model")
    assert_clean_error(out, "model.path", "no-model")


@pytest.mark.parametrize("override,needle", [
    ("rollout.n=1", "GRPO needs rollout.n >= 2"),
    ("algorithm.use_kl_loss=true", None),
    ("rollout.backend=vlm", "rollout.backend: 'vlm' is not one of native, vllm, sglang, trtllm"),
    ("actor.mini_batch_size=3", "actor.mini_batch_size=3 must divide data.train_batch_size=16"),
])
def test_contradictory_config(override, needle):
    if needle is None:  # both KL modes on at once
        out = train(override, "algorithm.use_kl_in_reward=true")
        assert_clean_error(out, "penalises KL twice")
    else:
        assert_clean_error(train(override), needle)


def test_engine_not_installed_names_the_extra(tiny_model):
    out = train(f"model.path={tiny_model}", "rollout.backend=vllm")
    assert_clean_error(out, 'pip install "polyrl[vllm]"')


def test_print_config_and_help_config():
    out = subprocess.run([sys.executable, "-m", "polyrl", "train", "--print-config", "rollout.n=3"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "n: 3" in out.stdout
    out = subprocess.run([sys.executable, "-m", "polyrl", "train", "--help-config"],
                         capture_output=True, text=True, timeout=60)
    assert "rollout.backend" in out.stdout and "Samples per prompt" in out.stdout
