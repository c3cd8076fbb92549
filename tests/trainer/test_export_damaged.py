"""`polyrl export` of a damaged or half-written checkpoint: one line naming the file or the last
complete checkpoint, exit 2, no traceback (it used to be a safetensors traceback, exit 1, or
advice to copy tokenizer files into a checkpoint the run never finished)."""

from __future__ import annotations

import shutil

import pytest
import torch
import yaml

from polyrl.trainer.checkpoint import CheckpointWriter, step_dir


def run_checkpoint(out, step, tiny_model, complete=True):
    """A checkpoint as CheckpointWriter lays it out: the tiny model as policy/ (Hugging Face
    format, tokenizer included), then driver.pt and the rename (left out: `complete=False`)."""
    writer = CheckpointWriter(out, keep_last=10)
    tmp = writer.begin(step)
    shutil.copytree(tiny_model, tmp / "policy")
    if not complete:
        (tmp / "policy" / "tokenizer_config.json").unlink()  # as when the run stopped mid-write
        return tmp
    return writer.commit(tmp, step, {"step": step}, {"model": {"path": str(tiny_model)}})


def export(*args):
    from polyrl.cli.main import main

    return main(["export", *map(str, args)])


def error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize("damage", ["truncated", "bad header"])
def test_damaged_safetensors_names_the_file_and_the_last_good_checkpoint(tiny_model, tmp_path, capsys,
                                                                          damage):
    out = tmp_path / "run"
    good = run_checkpoint(out, 1, tiny_model)
    bad = run_checkpoint(out, 2, tiny_model)
    weights = bad / "policy" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\xff" * 16 + data[16:])
    assert export(bad, "--output", tmp_path / "model") == 2
    err = error_line(capsys)
    assert "is damaged (model.safetensors:" in err and f"export the last complete one: {good}" in err
    assert not (tmp_path / "model").exists()
    assert export(bad / "policy", "--output", tmp_path / "model") == 2  # its policy/ directly
    assert "is damaged" in error_line(capsys)


def test_half_written_checkpoint_is_named_incomplete(tiny_model, tmp_path, capsys):
    out = tmp_path / "run"
    good = run_checkpoint(out, 1, tiny_model)
    half = run_checkpoint(out, 2, tiny_model, complete=False)
    assert half.name == ".tmp-step_000002"
    for target in (half, half / "policy"):
        assert export(target, "--output", tmp_path / "model") == 2
        err = error_line(capsys)
        assert "is an incomplete checkpoint" in err and f"export the last complete one: {good}" in err
        assert "copy the tokenizer" not in err
    shutil.rmtree(good)
    assert export(half, "--output", tmp_path / "model") == 2
    assert f"{out} holds no complete checkpoint to export" in error_line(capsys)


def test_a_complete_checkpoint_still_exports(tiny_model, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    ckpt = run_checkpoint(tmp_path / "run", 1, tiny_model)
    assert export(ckpt, "--output", tmp_path / "model") == 0
    AutoModelForCausalLM.from_pretrained(str(tmp_path / "model"))
    assert yaml.safe_load((ckpt / "config.yaml").read_text())["model"]["path"] == str(tiny_model)
    assert torch.load(ckpt / "driver.pt", weights_only=False) == {"step": 1}
    assert ckpt == step_dir(tmp_path / "run", 1)
