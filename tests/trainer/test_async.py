"""trainer.mode=async with real Ray actors: streaming replicas, the staleness bound, off-policy
metrics, a replica killed mid-step or before validation, and a trainer SIGKILLed after a checkpoint
and resumed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from polyrl.config import load_config
from polyrl.trainer.checkpoint import complete_checkpoints
from polyrl.job import JobConfig
from polyrl.trainer.loop import Trainer

B, N = 4, 4


def overrides(tiny_model, arith_files, out, tmp_path, *extra):
    reward = tmp_path / "len_reward.py"
    reward.write_text("def score(solution_str, ground_truth, extra_info=None):\n"
                      "    return len(solution_str) / 10\n")
    return [f"model.path={tiny_model}", f"data.train_files=[{arith_files['train']}]",
            f"data.val_files=[{arith_files['val']}]", f"data.train_batch_size={B}", f"rollout.n={N}",
            "rollout.response_length=16", "actor.lr=0.01", f"reward.custom_function={reward}:score",
            "trainer.total_steps=3", "trainer.val_every=3", "trainer.progress_bar=false",
            "trainer.save_at_end=false", "actor.num_cpus_per_worker=1", f"trainer.output_dir={out}",
            "logging.plot_at_end=false", "rollout.placement=standalone", "trainer.mode=async",
            "async.groups_per_request=1", *extra]


def job(*args):
    return load_config(JobConfig, overrides=overrides(*args))


def read(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_async_run_within_the_staleness_bound(ray_session, tiny_model, arith_files, tmp_path):
    summary = Trainer(job(tiny_model, arith_files, tmp_path / "o", tmp_path, "async.max_staleness=1",
                          "trainer.val_before_train=false")).fit()
    rows = [r for r in read(tmp_path / "o") if r["step"] > 0 and "async/staleness_max" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["async/staleness_max"] <= 1
        assert r["async/staleness_0"] + r["async/staleness_1"] == pytest.approx(1.0)
        for key in ("async/queue_depth", "async/trainer_idle_s", "async/rollout_idle_s",
                    "async/partial_rollouts", "async/discarded_stale_total", "off_policy/is_weight_mean",
                    "off_policy/is_clipped_frac", "actor/grad_norm"):
            assert key in r, key
    assert rows[0]["async/staleness_max"] == 0  # the first batch comes from the initial weights
    # generation overlapped training: batch 2 was sampled while update 1 ran
    assert rows[1]["async/staleness_1"] > 0
    assert rows[-1]["weight_sync/version"] == 3
    assert summary["final_accuracy"] is not None


def test_replica_killed_mid_step(ray_session, tiny_model, arith_files, tmp_path):
    import ray

    cfg = job(tiny_model, arith_files, tmp_path / "o", tmp_path, "rollout.num_replicas=2",
              "trainer.val_before_train=false", "trainer.val_every=0")
    t = Trainer(cfg)
    consumed: list[int] = []
    killed = []
    try:
        t.setup()
        take = t.topology.stream.take_batch

        def take_and_record():
            if len(consumed) == B and not killed:  # step 2: kill replica 0 while it generates
                for _ in range(6000):  # each pump dispatches or waits up to 10 ms
                    if any(c.replica == 0 for c in t.topology.stream.calls.values()):
                        break
                    t.topology.stream.pump(0.01)
                else:
                    raise AssertionError("replica 0 never got work")
                killed.append(t.topology.pool.workers[0])
                ray.kill(t.topology.pool.workers[0])
            groups, metrics = take()
            for g in groups:
                assert len(g.samples) == N and set(g.samples.group.tolist()) == {g.gid}
            consumed.extend(g.gid for g in groups)
            return groups, metrics

        t.topology.stream.take_batch = take_and_record
        for step in (1, 2, 3):
            metrics = t.train_step(step)
        assert killed and t.topology.pool.workers[0] is not killed[0]
        assert metrics["async/replica_restarts_total"] == 1
        assert metrics["async/retried_groups_total"] >= 1
        # the replacement serves the trainer's current weights
        t.topology.stream.wait_replicas_current()
        assert ray.get(t.topology.pool.workers[0].weight_version.remote()) == t.topology.stream.version == 3
        # no group lost or counted twice: every drawn group is consumed once or still owed
        assert len(consumed) == len(set(consumed)) == 3 * B
        owed = list(t.topology.stream.ready) + [g.gid for g in t.topology.stream.pending] + \
            [g.gid for c in t.topology.stream.calls.values() for g in c.groups]
        assert sorted(consumed + owed) == list(range(t.topology.stream.next_gid))
    finally:
        t.shutdown()


def test_replica_dead_during_validation(ray_session, tiny_model, arith_files, tmp_path):
    """Validation in async mode survives a replica dying: its shard runs on the other replica,
    the dead one is replaced, and the result is the validation a healthy pool gives."""
    import ray

    cfg = job(tiny_model, arith_files, tmp_path / "o", tmp_path, "rollout.num_replicas=2",
              "trainer.val_before_train=false", "trainer.val_every=0")
    t = Trainer(cfg)
    try:
        t.setup()
        healthy = t.validate()  # greedy: the same weights give the same answers on any replica
        dead = t.topology.pool.workers[0]
        ray.kill(dead)  # the stream finds out only when a call to it fails
        again = t.validate()
        assert again == healthy
        assert t.topology.pool.restarts == 1 and t.topology.pool.workers[0] is not dead
        assert not t.topology.stream.side_calls
    finally:
        t.shutdown()


def test_trainer_killed_and_resumed(ray_session, tiny_model, arith_files, tmp_path):
    out = tmp_path / "o"
    args = overrides(tiny_model, arith_files, out, tmp_path, "trainer.total_steps=8", "trainer.save_every=1",
                     "trainer.keep_last=8",  # step 1's checkpoint stays, however far the run got
                     "trainer.val_before_train=false", "trainer.val_every=0", "actor.ppo_epochs=2",
                     f"ray.address={ray_session.get_runtime_context().gcs_address}")
    proc = subprocess.Popen([sys.executable, "-m", "polyrl", "-v", "train", *args], text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    # the first checkpoint that owes finished groups generated before its own version: usually
    # step 1's (batch 2 started as batch 1's groups finished, before version 1 existed, and
    # finished during update 1); on a loaded machine batch 2 can still be in flight then, so the
    # run goes on until a later step's checkpoint holds some (keep_last=8 keeps them all)
    found, checked = None, set()
    try:
        seen = []
        for line in proc.stderr:  # the run's own log says when each checkpoint is complete
            seen.append(line)
            if "checkpoint written" not in line:
                continue
            for ckpt in complete_checkpoints(out):  # (the log line wraps the path: not parsed)
                if ckpt in checked:
                    continue
                checked.add(ckpt)
                step = int(ckpt.name.rsplit("_", 1)[1])
                state = torch.load(ckpt / "driver.pt", weights_only=False)["async"]
                stale = sum(1 for g in state["ready"] if int(g.samples.min_version.min()) < step)
                if stale:
                    found = ckpt, step, state, stale
                    break
            if found:
                break
        else:
            raise AssertionError("no checkpoint held finished stale groups:\n" + "".join(seen[-40:]))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    ckpt, step, state, stale = found
    # the checkpoint owes exactly the drawn but untrained prompts (data position)
    assert state["consumed"] == B * step
    # (groups finish out of order: a batch is the first B to finish, not necessarily consecutive gids)
    owed = [g.gid for g in state["ready"]] + [g.gid for g in state["pending"]]
    assert len(set(owed)) == len(owed) == state["next_gid"] - B * step
    assert set(owed) <= set(range(state["next_gid"]))

    # (the killed driver's actors free their CPUs lazily: Trainer.setup waits for them)
    # resume with a tighter bound: the saved groups from before version `step` are now too stale
    from polyrl.cli.train import (
        EMBEDDED_DEFAULT,  # what `polyrl train` without -c starts from
    )

    cfg = load_config(JobConfig, files=[EMBEDDED_DEFAULT], overrides=overrides(
        tiny_model, arith_files, out, tmp_path, f"trainer.total_steps={step + 2}", "trainer.save_every=2",
        "trainer.val_before_train=false", "trainer.val_every=0", "actor.ppo_epochs=2",
        "async.max_staleness=0", f"trainer.resume={ckpt}"))
    Trainer(cfg).fit()
    rows = [r for r in read(out) if "async/staleness_max" in r]
    assert [r["step"] for r in rows if r["step"] > step] == [step + 1, step + 2]
    assert rows[-1]["async/discarded_stale_total"] == stale
    assert all(r["async/staleness_max"] == 0 for r in rows if r["step"] > step)
