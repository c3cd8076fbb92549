"""`polyrl sft` end to end on the bundled tiny model and chat file: held-out loss more than
halves, the checkpoint answers the task when loaded by transformers, resume is exact, metrics and
curves are written, and the checkpoint is a `model.path` for `polyrl train`."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from polyrl.cli.main import main
from polyrl.config import load_config
from polyrl.sft.config import SFTConfig
from polyrl.sft.trainer import SFTTrainer


def config(out, *overrides) -> SFTConfig:
    return load_config(SFTConfig, overrides=[
        "data.max_samples=256", "data.train_batch_size=32", "trainer.total_steps=16",
        "trainer.val_every=8", "trainer.progress_bar=false", f"trainer.output_dir={out}", *overrides])


def greedy_accuracy(model_dir: str, rows: int = 64) -> float:
    """Exact-match accuracy of greedy answers on held-out problems, via plain transformers."""
    import pyarrow.parquet as pq
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from polyrl.builtin import resolve

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    val = pq.read_table(resolve("builtin:arithmetic_chat_val")).to_pylist()[-rows:]
    enc = tok.apply_chat_template([[r["messages"][0]] for r in val], add_generation_prompt=True,
                                  tokenize=True, return_dict=True, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    answers = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return sum(a == r["messages"][1]["content"] for a, r in zip(answers, val)) / len(val)


@pytest.mark.slow  # ~40 s on 2 busy cores: 16 steps, 3 validations, 2 x greedy generation
def test_sft_halves_held_out_loss_and_the_model_answers(tmp_path):
    summary = SFTTrainer(config(tmp_path)).fit()
    assert summary == json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_val_loss"] < summary["initial_val_loss"] / 2, summary
    assert summary["final_val_token_acc"] > summary["initial_val_token_acc"]
    assert (summary["steps"], summary["train/conversations"], summary["val/conversations"]) == (16, 256, 256)
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(17))
    assert {"val/loss", "val/token_acc", "data/train/conversations"} <= set(records[0])
    assert {"train/loss", "actor/lr", "actor/grad_norm", "val/loss"} <= set(records[8])
    assert (tmp_path / "curves.png").is_file()
    policy = summary["policy_dir"]
    # held-out problems (the last 64 rows were never trained on: max_samples took the first 256)
    before, after = greedy_accuracy("polyrl/assets/tiny-arith"), greedy_accuracy(policy)
    assert after >= 0.8 and after > before + 0.2, (before, after)


def test_resume_continues_exactly(tmp_path):
    full = tmp_path / "full"
    args = ("trainer.total_steps=4", "trainer.save_every=2", "data.val_files=[]", "data.max_samples=128")
    SFTTrainer(config(full, *args)).fit()
    # a run that stopped after its step-2 checkpoint: the same directory without what came later
    cut = tmp_path / "cut"
    (cut / "checkpoints").mkdir(parents=True)
    shutil.copytree(full / "checkpoints" / "step_000002", cut / "checkpoints" / "step_000002")
    shutil.copyfile(full / "metrics.jsonl", cut / "metrics.jsonl")
    resumed = SFTTrainer(config(cut, *args))
    resumed.fit()
    from safetensors.torch import load_file

    a = load_file(str(full / "checkpoints/step_000004/policy/model.safetensors"))
    b = load_file(str(cut / "checkpoints/step_000004/policy/model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    steps = [json.loads(x)["step"] for x in (cut / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3, 4]
    losses = lambda d: [json.loads(x).get("train/loss") for x in (d / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    assert losses(cut) == losses(full)


def test_resume_refuses_another_model(tmp_path, tiny_model):
    SFTTrainer(config(tmp_path, "trainer.total_steps=1", "trainer.val_every=0")).fit()
    from polyrl.trainer.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="model.path: checkpoint has 'builtin:tiny-arith'"):
        SFTTrainer(config(tmp_path, "trainer.total_steps=2", f"model.path={tiny_model}")).fit()


@pytest.mark.slow
def test_checkpoint_is_a_model_path_for_polyrl_train(ray_session, tmp_path):
    summary = SFTTrainer(config(tmp_path / "sft", "trainer.total_steps=2", "trainer.val_every=0")).fit()
    out = tmp_path / "rl"
    code = main(["train", f"model.path={summary['policy_dir']}", "trainer.total_steps=1",
                 "data.train_batch_size=4", "rollout.n=2", "data.max_samples=16",
                 "trainer.progress_bar=false", "logging.plot_at_end=false", f"--output-dir={out}"])
    assert code == 0
    rl = json.loads((out / "summary.json").read_text())
    assert rl["steps"] == 1 and rl["final_accuracy"] is not None


@pytest.mark.slow  # two spawned processes import torch and transformers
def test_two_processes_train_like_one(tmp_path):
    from polyrl.sft.launch import run_sft

    args = ("trainer.total_steps=2", "trainer.val_every=1", "data.max_samples=64")
    one = run_sft(config(tmp_path / "one", *args))
    two = run_sft(config(tmp_path / "two", *args, "actor.world_size=2"))
    assert two["final_val_loss"] == pytest.approx(one["final_val_loss"], rel=1e-3)
    read = lambda d: [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    for a, b in zip(read(tmp_path / "one"), read(tmp_path / "two"), strict=True):
        for key in ("train/loss", "train/loss_tokens", "actor/grad_norm", "val/loss", "val/token_acc"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-6), (a["step"], key)
