"""Checkpoint / resume: a resumed run continues exactly as the uninterrupted one."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from polyrl.config import load_config
from polyrl.trainer.checkpoint import CheckpointError, complete_checkpoints, find_resume_point
from polyrl.job import JobConfig
from polyrl.trainer.loop import Trainer

VOLATILE = ("timing/", "perf/", "train/epoch")


def job(tiny_model, arith_files, out, tmp_path, *overrides):
    reward = tmp_path / "len_reward.py"
    reward.write_text("def score(solution_str, ground_truth, extra_info=None):\n"
                      "    return len(solution_str) / 10\n")
    return load_config(JobConfig, overrides=[
        f"model.path={tiny_model}", f"data.train_files=[{arith_files['train']}]", "data.val_files=[]",
        "data.max_samples=12", "data.train_batch_size=4",  # 3 steps per epoch
        "rollout.n=4", "rollout.response_length=5", "actor.lr=0.01",
        f"reward.custom_function={reward}:score",
        "trainer.total_steps=5", "trainer.save_every=1", "trainer.keep_last=10",
        "trainer.progress_bar=false", f"trainer.output_dir={out}", *overrides])


def metrics(out):
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows}


def weights(out, step=5):
    return load_file(str(out / "checkpoints" / f"step_{step:06d}" / "policy" / "model.safetensors"))


@pytest.fixture(scope="module")
def uninterrupted(ray_session, tiny_model, arith_files, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("full")
    Trainer(job(tiny_model, arith_files, tmp / "out", tmp)).fit()
    return tmp / "out"


@pytest.mark.parametrize("resume_step", [3, 2], ids=["epoch-boundary", "mid-epoch"])
def test_resume_matches_uninterrupted(uninterrupted, tiny_model, arith_files, tmp_path, resume_step):
    out = tmp_path / "out"
    src = uninterrupted / "checkpoints" / f"step_{resume_step:06d}"
    shutil.copytree(src, out / "checkpoints" / src.name)
    # the crashed run had logged up to its checkpoint, plus a line the resume must drop
    lines = (uninterrupted / "metrics.jsonl").read_text().splitlines()[: resume_step + 1]
    (out / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    Trainer(job(tiny_model, arith_files, out, tmp_path)).fit()

    full, resumed = metrics(uninterrupted), metrics(out)
    assert sorted(resumed) == sorted(full) == [1, 2, 3, 4, 5]
    for step in range(resume_step + 1, 6):
        assert resumed[step] == pytest.approx(full[step], rel=1e-6, abs=1e-7), step
    assert full[4]["actor/grad_norm"] > 0  # not a comparison of no-op updates
    a, b = weights(uninterrupted), weights(out)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-6, atol=1e-7)


def test_checkpoints_are_pruned_loadable_and_atomic(uninterrupted, tmp_path):
    from transformers import AutoModelForCausalLM

    steps = [int(p.name.split("_")[1]) for p in complete_checkpoints(uninterrupted)]
    assert steps == [1, 2, 3, 4, 5]
    AutoModelForCausalLM.from_pretrained(str(uninterrupted / "checkpoints" / "step_000005" / "policy"))
    # a half-written checkpoint (no driver.pt, temp name) is never picked up
    out = tmp_path / "o"
    shutil.copytree(uninterrupted / "checkpoints" / "step_000002", out / "checkpoints" / "step_000002")
    half = out / "checkpoints" / ".tmp-step_000003"
    shutil.copytree(uninterrupted / "checkpoints" / "step_000003", half)
    (half / "driver.pt").unlink()
    assert find_resume_point("auto", out).name == "step_000002"
    assert find_resume_point("off", out) is None
    with pytest.raises(CheckpointError, match="not a complete polyrl checkpoint"):
        find_resume_point(str(half), out)


def test_keep_last_prunes(ray_session, tiny_model, arith_files, tmp_path):
    Trainer(job(tiny_model, arith_files, tmp_path / "out", tmp_path, "trainer.total_steps=3",
                "trainer.keep_last=2")).fit()
    assert [p.name for p in complete_checkpoints(tmp_path / "out")] == ["step_000002", "step_000003"]


def test_incompatible_resume_names_the_field(uninterrupted, tiny_model, arith_files, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(uninterrupted / "checkpoints" / "step_000002", out / "checkpoints" / "step_000002")
    with pytest.raises(CheckpointError, match="rollout.n: checkpoint has 4, this run has 2"):
        Trainer(job(tiny_model, arith_files, out, tmp_path, "rollout.n=2")).fit()


def test_harmless_change_is_allowed(uninterrupted, tiny_model, arith_files, tmp_path, caplog):
    out = tmp_path / "out"
    shutil.copytree(uninterrupted / "checkpoints" / "step_000004", out / "checkpoints" / "step_000004")
    with caplog.at_level("INFO"):
        summary = Trainer(job(tiny_model, arith_files, out, tmp_path, "trainer.log_every=2")).fit()
    assert summary["steps"] == 5
    assert any("trainer.log_every" in r.getMessage() for r in caplog.records)


def test_unwritable_output_dir_fails_before_training(tiny_model, arith_files, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(CheckpointError, match="is not writable"):
        Trainer(job(tiny_model, arith_files, blocker / "out", tmp_path)).fit()


# --- damaged checkpoints and the free-space check (no training needed) -----------------------

def fake_checkpoint(out, step):
    """A checkpoint directory with real torch.save and safetensors files, as the writer lays it."""
    from safetensors.torch import save_file

    from polyrl.trainer.checkpoint import step_dir

    d = step_dir(out, step)
    (d / "policy").mkdir(parents=True)
    save_file({"w": torch.arange(1000, dtype=torch.float32)}, str(d / "policy" / "model.safetensors"))
    torch.save({"torch_rng": torch.get_rng_state(), "version": step}, d / "rank0.pt")
    torch.save({"step": step, "blob": torch.arange(4000)}, d / "driver.pt")
    return d


def truncate(path, keep=0.5):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def flip_a_byte_of(path, needle: bytes):
    data = bytearray(path.read_bytes())
    at = data.index(needle)  # inside a stored tensor's bytes, not the archive's directory
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["truncated driver.pt", "flipped byte in rank0.pt",
                                    "truncated safetensors"])
def test_damaged_latest_checkpoint_falls_back_with_a_warning(tmp_path, damage, caplog):
    fake_checkpoint(tmp_path, 1)
    latest = fake_checkpoint(tmp_path, 2)
    if damage == "truncated driver.pt":
        truncate(latest / "driver.pt")
    elif damage == "flipped byte in rank0.pt":
        flip_a_byte_of(latest / "rank0.pt", torch.get_rng_state().numpy().tobytes()[100:116])
    else:
        truncate(latest / "policy" / "model.safetensors", keep=0.9)
    assert find_resume_point("auto", tmp_path) == latest.parent / "step_000001"
    assert f"checkpoint {latest} is damaged" in caplog.text
    with pytest.raises(CheckpointError, match=r"step_000002 is damaged .*trainer.resume=auto"):
        find_resume_point(str(latest), tmp_path)


def test_intact_checkpoints_are_taken_as_they_are(tmp_path, caplog):
    fake_checkpoint(tmp_path, 1)
    latest = fake_checkpoint(tmp_path, 2)
    assert find_resume_point("auto", tmp_path) == latest and "damaged" not in caplog.text
    assert find_resume_point(str(latest), tmp_path) == latest


def test_free_space_check_counts_checkpoints_that_rotation_will_delete(tmp_path):
    import shutil as sh

    from polyrl.trainer.checkpoint import check_writable, checkpoint_root

    old = checkpoint_root(tmp_path) / "step_000001"
    old.mkdir(parents=True)
    gib = 1 << 30
    with (old / "rank0.pt").open("wb") as f:  # sparse: 8 GiB by size, no blocks on the disk
        f.truncate(8 * gib)
    free = sh.disk_usage(tmp_path).free
    # the 8 GiB checkpoint on disk is rotated away as new ones arrive: of free + 6 GiB, only
    # free - 2 GiB must still be free (refused before: it compared free + 6 GiB with free)
    check_writable(tmp_path, need_bytes=free + 6 * gib, keep_last=1000)
    with pytest.raises(CheckpointError, match="MiB more"):  # free + 2 GiB more does not fit
        check_writable(tmp_path, need_bytes=free + 10 * gib, keep_last=1000)
    # however much is on disk, the checkpoint written before the oldest is pruned must fit:
    # keep_last=1 -> one is (2 x free + 6 GiB) / 2 = free + 3 GiB
    with pytest.raises(CheckpointError, match="MiB more"):
        check_writable(tmp_path, need_bytes=2 * free + 6 * gib, keep_last=1)


@pytest.mark.slow
def test_fsdp2_run_of_two_ranks_resumes_on_one(ray_session, tiny_model, arith_files, tmp_path, caplog):
    """docs/training.md: an fsdp2 checkpoint reshards onto another actor.world_size (a ddp one
    does not: `test_resume_compatibility_rules` in test_bad_input.py). The resumed step equals
    the uninterrupted 2-rank run's within the bound 2 ranks obey against 1 (test_reference_run.py)."""
    from len_reward_job import job as small_job, read

    def run(out, ranks):
        return Trainer(small_job(tiny_model, arith_files, out, "actor.strategy=fsdp2",
                                 f"actor.world_size={ranks}", "trainer.save_every=1",
                                 "data.val_files=[]")).fit()

    run(tmp_path / "two", 2)
    resumed = tmp_path / "one"
    src = tmp_path / "two" / "checkpoints" / "step_000001"
    shutil.copytree(src, resumed / "checkpoints" / src.name)
    first_step = (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()[0]
    (resumed / "metrics.jsonl").write_text(first_step + "\n")
    with caplog.at_level("INFO"):
        run(resumed, 1)
    assert any("changed settings (allowed): actor.world_size" in r.getMessage() for r in caplog.records)
    full, again = read(tmp_path / "two"), read(resumed)
    assert [r["step"] for r in full] == [r["step"] for r in again] == [1, 2]
    assert full[1]["actor/grad_norm"] > 0
    for key, value in full[1].items():
        if not key.startswith(VOLATILE) and isinstance(value, float):
            assert again[1][key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    a, b = weights(tmp_path / "two", 2), weights(resumed, 2)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-5)
