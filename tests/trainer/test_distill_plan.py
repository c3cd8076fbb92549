"""A standalone distillation teacher (distill.placement=standalone) in the launch plan that
`polyrl train --dry-run` shows: its own ranks, devices, environment and process group, on a
simulated GPU node; none when the teacher is colocated."""

from __future__ import annotations

import json

from polyrl.cli.main import main

STANDALONE = ("distill.teacher=builtin:tiny-arith", "distill.placement=standalone", "distill.world_size=2",
              "distill.strategy=fsdp2")


def plan(capsys, *args: str) -> dict:
    assert main(["train", "--dry-run", "--json", "--platform", "gb200", "actor.num_cpus_per_worker=1",
                 "actor.world_size=2", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_standalone_teacher_ranks_get_their_own_devices_and_world(capsys):
    p = plan(capsys, *STANDALONE)
    teachers = [a for a in p["actors"] if a["role"] == "teacher"]
    assert [a["name"] for a in teachers] == ["teacher rank 0", "teacher rank 1"]
    policy_ids = {i for a in p["actors"] if a["role"] == "policy" for i in a["devices"]["ids"]}
    teacher_ids = [i for a in teachers for i in a["devices"]["ids"]]
    # one device each, beside the policy's two on the 4-GPU node, not shared with them
    assert len(teacher_ids) == 2 and not set(teacher_ids) & policy_ids and p["devices"]["needed"] == 4
    for r, a in enumerate(teachers):
        assert a["resources"] == {"num_cpus": 1, "num_gpus": 1} and a["env_role"] == "trainer"
        assert a["env"]  # the same planned environment as every other actor
        # its own world of the two teacher ranks, not a rank of the policy's world
        assert a["rank"] is None and a["process_groups"] == []
        assert a["plan"]["role"] == "teacher" and a["plan"]["rank"] == r and a["plan"]["world_size"] == 2
        assert a["plan"]["groups"] == ["teacher"] and not a["plan"]["hosts_engine"]
        assert not a["plan"]["sends_weights"] and a["engine"] is None
    assert {g["name"] for g in p["devices"]["gangs"]} >= {"teacher rank 0", "teacher rank 1"}
    # a local Ray instance holds every rank's CPU: 2 policy + 2 teacher ranks at 1 CPU each
    assert p["job"]["ray_init"]["num_cpus"] >= 4


def test_a_colocated_teacher_adds_no_actor(capsys):
    p = plan(capsys, "distill.teacher=builtin:tiny-arith")
    assert {a["role"] for a in p["actors"]} == {"policy"} and p["devices"]["needed"] == 2


def test_the_tree_shows_the_teacher_ranks_and_their_devices(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")  # one tree line per entry
    assert main(["train", "--dry-run", "--platform", "gb200", "actor.num_cpus_per_worker=1",
                 "actor.world_size=2", *STANDALONE]) == 0
    text = capsys.readouterr().out
    assert "teacher rank 0, teacher rank 1: num_cpus=1, num_gpus=1; torch threads 1; env role trainer" in text
    assert "devices: teacher rank 0 -> node 0 [2]; teacher rank 1 -> node 0 [3]" in text
