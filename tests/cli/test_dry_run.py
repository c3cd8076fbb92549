"""`polyrl train --dry-run` as a user runs it: a real subprocess that plans a GPU-cluster run on
this CPU machine and starts no Ray."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from polyrl.cli.main import main
from polyrl.envplan.rules import FORWARDED_PREFIXES
from polyrl.rollout import launch_args


def clean_environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(FORWARDED_PREFIXES)}


def polyrl(tmp_path, *args, env=None):
    """Run the CLI with a private Ray temp dir and an unreachable RAY_ADDRESS: any ray.init
    would either leave a session directory behind or fail."""
    ray_tmp = tmp_path / "ray-tmp"
    ray_tmp.mkdir(exist_ok=True)
    full_env = {**clean_environ(), "RAY_TMPDIR": str(ray_tmp), "RAY_ADDRESS": "127.0.0.1:1",
                "COLUMNS": "220", **(env or {})}
    out = subprocess.run([sys.executable, "-m", "polyrl", "train", *args], capture_output=True,
                         text=True, env=full_env, timeout=120)
    assert list(ray_tmp.iterdir()) == [], "a Ray session was started"
    return out


def test_json_plan_for_gb200_cluster_from_this_machine(tmp_path):
    out = polyrl(tmp_path, "--dry-run", "--json", "--platform", "gb200", "--gpus-per-node", "2",
                 "rollout.placement=standalone", "rollout.num_replicas=2", "rollout.backend=vllm",
                 "actor.num_cpus_per_worker=2", "rollout.max_model_len=128",
                 env={"NCCL_CUMEM_ENABLE": "1", "TLLM_DISABLE_NVLS_MNNVL": "1"})
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)  # one JSON object, nothing else on stdout
    assert plan["dry_run"] is True
    assert plan["platform"]["name"] == "cuda" and plan["platform"]["capability"] == [10, 0]
    assert plan["platform"]["simulated"] is True and plan["platform"]["device_count"] == 2
    assert plan["devices"] == {"needed": 3, "per_node": 2, "nodes": 2, "nodes_available": None,
                               "gangs": [{"name": "policy rank 0", "node": 0, "ids": [0]},
                                         {"name": "rollout replica 0", "node": 0, "ids": [1]},
                                         {"name": "rollout replica 1", "node": 1, "ids": [0]}]}
    assert plan["placement"]["rollout_replicas"] == 2 and plan["placement"]["policy_ranks"] == 1
    assert plan["config"]["rollout"]["backend"] == "vllm"
    # RAY_ADDRESS (the helper's unreachable one) is what an unset ray.address joins, as Ray's own
    # ray.init() and `ray job submit` entrypoints do (topology/launch_plan.py plan_job)
    assert plan["job"]["ray_init"] == {"address": "127.0.0.1:1", "namespace": "polyrl",
                                       "runtime_env": {"env_vars": {
                                           k: v["value"] for k, v in plan["job"]["env"].items()}}}
    actors = plan["actors"]
    assert [a["name"] for a in actors] == ["policy rank 0", "rollout replica 0 (rank 1)",
                                           "rollout replica 1 (rank 2)"]
    assert [a["devices"] for a in actors] == [{"node": 0, "ids": [0]}, {"node": 0, "ids": [1]},
                                              {"node": 1, "ids": [0]}]
    for a in actors:
        assert a["resources"] == {"num_cpus": 2, "num_gpus": 1} and a["num_threads"] == 2
        env = a["env"]
        assert env["NCCL_CUMEM_ENABLE"]["value"] == "1"  # R1: the user's value survives
        assert env["NCCL_CUMEM_ENABLE"]["source"] == "user-env"
        assert env["NCCL_NVLS_ENABLE"] == {  # R2: opted in, capability 10.0
            "value": "0", "source": "rule:blackwell-nvls-mnnvl-off",
            "reason": env["NCCL_NVLS_ENABLE"]["reason"],
            "link": "https://github.com/verl-project/verl/pull/6344"}
        for entry in env.values():
            assert set(entry) >= {"value", "source", "reason"}
    rollout = actors[1]
    # issue 15: a replica reserving a GPU keeps the visibility Ray gives it
    assert not any(k.startswith("RAY_EXPERIMENTAL_NOSET_") for k in rollout["env"])
    assert rollout["engine"]["args"]["max_model_len"] == 128
    assert rollout["engine"]["args"]["tensor_parallel_size"] == 1


def test_human_plan_for_rocm_keeps_bracketed_text(tmp_path):
    out = polyrl(tmp_path, "--dry-run", "--platform", "mi300x", "rollout.placement=standalone",
                 "rollout.num_replicas=2", "rollout.backend=sglang", "actor.num_cpus_per_worker=1",
                 "rollout.engine_kwargs={sglang: {chunked_prefill_size: '[x]'}}")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "platform: rocm: 8 device(s) (AMD Instinct MI300X), capability 9.4 [simulated]" in text
    assert "rollout replica 0 (rank 1), rollout replica 1 (rank 2): num_cpus=1, num_gpus=1" in text
    for name in ("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "NCCL_CUMEM_ENABLE", "SGLANG_USE_AITER"):
        assert name in text
    assert "RAY_EXPERIMENTAL_NOSET_" not in text
    assert ("devices: rollout replica 0 (rank 1) -> node 0 [1]; rollout replica 1 (rank 2) -> "
            "node 0 [2]") in text
    assert '"[x]"' in text  # rich markup would have eaten [x]
    try:
        import sglang  # noqa: F401
    except ImportError:
        assert 'pip install "polyrl[sglang]"' in text  # ... and [sglang]


def test_plan_error_and_flag_errors(capsys, monkeypatch):
    monkeypatch.delitem(launch_args.BUILDERS, "trtllm", raising=False)
    assert main(["train", "--dry-run", "--json", "--platform", "h100",
                 "rollout.backend=trtllm"]) == 1
    plan = json.loads(capsys.readouterr().out)
    assert plan["errors"] == [plan["actors"][0]["name"] + ": " + plan["actors"][0]["engine"]["error"]]
    assert "no launch-argument builder" in plan["errors"][0]

    for argv, message in (
        (["--dry-run", "--capability", "ten"], "--capability: expected MAJOR.MINOR"),
        (["--json"], "--json only apply with --dry-run"),
        (["--platform", "h100"], "--platform only apply with --dry-run"),
        (["--dry-run", "--platform", "tpu"], "unknown platform 'tpu'"),
        (["--dry-run", "--gpus-per-node", "4"], "--gpus-per-node needs an accelerator platform"),
        (["--dry-run", "rollout.bakend=vllm"], "did you mean 'rollout.backend'"),
    ):
        assert main(["train", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (argv, err)
        if "rollout.bakend=vllm" not in argv:  # config errors list every bad key, one per line
            assert len(err.strip().splitlines()) == 1, err


def test_nodes_limit_the_cluster_and_impossible_layouts_say_what_fits(capsys):
    from polyrl.cli.dry_run import dry_run
    from polyrl.config import load_config
    from polyrl.platform import SIMULATED_PROBES, get_platform
    from polyrl.job import JobConfig

    h100 = get_platform("cuda", SIMULATED_PROBES["h100"])
    cfg = load_config(JobConfig, overrides=[  # TP needs a GPU engine (the launch check, issue 28)
        "rollout.backend=vllm",
        "rollout.placement=standalone", "rollout.num_replicas=4", "rollout.tensor_parallel_size=4",
        "trainer.mode=async", "actor.num_cpus_per_worker=1", "rollout.max_model_len=64"])
    assert dry_run(cfg, h100, None, as_json=True, nodes=3) == 0
    plan = json.loads(capsys.readouterr().out)
    assert {a["name"]: a["devices"] for a in plan["actors"]} == {
        "policy rank 0": {"node": 0, "ids": [0]},
        "rollout replica 0": {"node": 0, "ids": [1, 2, 3, 4]},
        "rollout replica 1": {"node": 1, "ids": [0, 1, 2, 3]},
        "rollout replica 2": {"node": 1, "ids": [4, 5, 6, 7]},
        "rollout replica 3": {"node": 2, "ids": [0, 1, 2, 3]},
        "weight mailbox": None}
    assert plan["devices"]["nodes"] == 3 and plan["devices"]["nodes_available"] == 3
    assert dry_run(cfg, h100, None, as_json=True, nodes=2) == 1
    errors = json.loads(capsys.readouterr().out)["errors"]
    assert errors == ["placement: the job needs 17 devices on 3 node(s) of 8 (1 policy rank x 1, 4 "
                      "rollout replica x 4), but the cluster has 2 node(s), 16 devices: use 3 nodes "
                      "(--nodes 3, or a Ray cluster that large) or shrink the job by 1 device(s) at "
                      "least (actor.world_size, rollout.num_replicas, rollout.tensor_parallel_size)"]


def test_engine_version_reaches_the_builder(capsys):
    args = ["train", "--dry-run", "--json", "--platform", "h100", "rollout.backend=sglang"]
    assert main([*args, "--engine-version", "0.5.9"]) == 0
    old = json.loads(capsys.readouterr().out)
    assert old["placement"]["engine_version"] == "0.5.9"
    assert old["actors"][0]["engine"]["args"]["attention_backend"] == "fa3"
    assert main([*args, "--engine-version", "0.5.12"]) == 0
    assert json.loads(capsys.readouterr().out)["actors"][0]["engine"]["args"][
        "attention_backend"] == "flashinfer"


def test_the_reward_model_worker_is_planned_and_shown(capsys):
    args = ["train", "--dry-run", "--platform", "h100", "--nodes", "1", "actor.world_size=2",
            "actor.num_cpus_per_worker=1", "rollout.max_model_len=64", "reward.model.path=/models/rm",
            "reward.model.num_devices=1", "reward.model.num_cpus=2"]
    assert main([*args, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    reward = plan["actors"][-1]
    assert (reward["name"], reward["role"], reward["rank"]) == ("reward model worker", "reward", None)
    assert reward["resources"] == {"num_cpus": 2, "num_gpus": 1}
    assert reward["devices"] == {"node": 0, "ids": [2]}  # after policy ranks 0 and 1
    assert {"name": "reward model worker", "node": 0, "ids": [2]} in plan["devices"]["gangs"]
    assert plan["devices"]["needed"] == 3
    assert main(args) == 0  # the readable tree lists it with its devices
    out = capsys.readouterr().out
    assert "reward model worker: num_cpus=2, num_gpus=1;" in out.replace("\n", " ")
    assert "reward model worker -> node 0 [2]" in out


def test_the_sharding_of_a_two_node_fsdp2_job_is_shown(capsys):
    """issue 16: which ranks share the FSDP2 shard group, over which backend, on which nodes."""
    base = ["train", "--dry-run", "--json", "--nodes", "2"]
    common = ["actor.strategy=fsdp2", "actor.num_cpus_per_worker=1", "rollout.max_model_len=64"]
    assert main([*base, "--platform", "h100", *common, "actor.world_size=16",
                 "data.train_batch_size=32"]) == 0
    plan = json.loads(capsys.readouterr().out)
    world = plan["process_groups"]
    assert (world["world_size"], world["backend"], world["library"]) == (16, "nccl", "NCCL")
    shard, control = world["groups"]
    assert (shard["kind"], shard["ranks"], shard["leader"]) == ("trainer", list(range(16)), 0)
    assert shard["nodes"] == [0] * 8 + [1] * 8 and "FSDP2 shard group" in shard["purpose"]
    assert (control["kind"], control["backend"], control["library"]) == ("fsdp2_control", "gloo", "GLOO")
    assert plan["actors"][9]["process_groups"][0] == {"kind": "trainer", "ranks": list(range(16)),
                                                      "leader": 0, "backend": "nccl"}

    # standalone: 8 policy ranks + 2 TP-4 replicas on 2 nodes, on ROCm and Ascend
    standalone = [*common, "actor.world_size=8", "rollout.placement=standalone", "rollout.backend=vllm",
                  "rollout.num_replicas=2", "rollout.tensor_parallel_size=4"]
    for platform, backend, library in (("mi300x", "nccl", "RCCL"), ("ascend910", "hccl", "HCCL")):
        assert main([*base, "--platform", platform, *standalone]) == 0
        world = json.loads(capsys.readouterr().out)["process_groups"]
        assert (world["world_size"], world["backend"], world["library"]) == (16, backend, library)
        kinds = {(g["kind"], tuple(g["ranks"])): g for g in world["groups"]}
        assert kinds[("trainer", tuple(range(8)))]["nodes"] == [0] * 8
        assert kinds[("replica", (8, 9, 10, 11))]["leader"] == 8
        assert kinds[("replica", (12, 13, 14, 15))]["leader"] == 12  # never rank 0 (R5)
        assert kinds[("replica", (12, 13, 14, 15))]["nodes"] == [1] * 4
        assert kinds[("weight_sync", (0, *range(8, 16)))]["leader"] == 0
    assert main(["train", "--dry-run", "--json", "actor.world_size=2", "actor.strategy=fsdp2"]) == 0
    world = json.loads(capsys.readouterr().out)["process_groups"]  # CPU: gloo, no control group
    assert [(g["kind"], g["backend"]) for g in world["groups"]] == [("trainer", "gloo")]
    assert main(["train", "--dry-run", "--json"]) == 0  # one rank: no process group
    assert json.loads(capsys.readouterr().out)["process_groups"] is None


def test_hybrid_tensor_parallel_is_refused_by_the_dry_run_as_by_the_launch(capsys):
    # issue 28: the dry run planned it and exited 0, then the launch raised in the factory
    args = ["train", "--dry-run", "--json", "--platform", "h100", "rollout.backend=vllm",
            "rollout.tensor_parallel_size=2", "actor.world_size=2", "actor.num_cpus_per_worker=1",
            "rollout.max_model_len=64"]
    assert main(args) == 1
    errors = json.loads(capsys.readouterr().out)["errors"]
    assert errors[0] == ("policy rank 0: rollout.tensor_parallel_size=2 with rollout.placement=colocated: "
                         "a colocated engine runs on its trainer rank's one device; use "
                         "rollout.placement=disaggregated for tensor parallelism")
    standalone = [a for a in args if a != "actor.world_size=2"] + ["rollout.placement=standalone"]
    assert main(standalone) == 0
    plan = json.loads(capsys.readouterr().out)
    engine = next(a["engine"] for a in plan["actors"] if a["engine"])
    assert engine["args"]["distributed_executor_backend"] == "mp"  # issue 28, fix 2


def test_native_engine_kwargs_are_checked_and_shown_as_launched(capsys):
    base = ["train", "--dry-run", "--json", "actor.num_cpus_per_worker=1", "rollout.max_model_len=64"]
    assert main([*base, "rollout.engine_kwargs={native: {max_num_seqs: 4}}"]) == 0
    args = json.loads(capsys.readouterr().out)["actors"][0]["engine"]["args"]
    assert args["max_num_seqs"] == 4 and list(args).count("max_num_seqs") == 1
    assert main([*base, "rollout.engine_kwargs={native: {max_num_seqs: null}}"]) == 1
    assert json.loads(capsys.readouterr().out)["errors"] == [
        "policy rank 0: rollout.engine_kwargs.native.max_num_seqs is null; give it a value or "
        "remove the key"]


SIMULATED = [("h100", "cuda", "nccl", "NCCL"), ("mi300x", "cuda", "nccl", "RCCL"),
             ("ascend910", "npu", "hccl", "HCCL"), ("cpu", "cpu", "gloo", "GLOO")]


def handoff(kind: str, backend: str, path: str) -> dict:
    end = {"device": kind, "backend": backend}
    return {"path": path, "sender": end, "receiver": end}


def dry_json(capsys, *args: str) -> dict:
    assert main(["train", "--dry-run", "--json", "actor.num_cpus_per_worker=1", "rollout.max_model_len=64",
                 *args]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("machine, kind, wire, library", SIMULATED)
def test_the_weight_handoff_is_planned_on_both_ends_per_platform(capsys, monkeypatch, machine, kind, wire,
                                                                library):
    """issue 39's hang (a sender packing on cuda, receivers staging on cpu) is a GPU-only fact:
    the dry run plans each end's device and backend for the platform, colocated and
    disaggregated, from the transports' own rules (polyrl/weights/handoff.py)."""
    colocated = dry_json(capsys, "--platform", machine)["weights"]
    assert colocated == {"transport": "in_place", "senders": ["policy rank 0"],
                         "receivers": ["policy rank 0's engine"],
                         "handoffs": [handoff(kind, "none", "engine.update_weights")],
                         "group": None, "control": None, "via": None}
    plan = dry_json(capsys, "--platform", machine, "rollout.placement=disaggregated", "rollout.num_replicas=2")
    weights = plan["weights"]
    assert (weights["transport"], weights["senders"]) == ("broadcast", ["policy rank 0"])
    assert weights["receivers"] == ["rollout replica 0 (rank 1)", "rollout replica 1 (rank 2)"]
    # device bytes go over the device's library; only the CPU's take the shared-memory ring first
    rows = [handoff(kind, wire, "backend")]
    if kind == "cpu":
        rows.insert(0, handoff("cpu", "shared memory", "shared memory"))
    assert weights["handoffs"] == rows
    assert weights["group"] == {"kind": "weight_sync", "ranks": [0, 1, 2], "leader": 0, "backend": wire,
                                "library": library}
    assert weights["control"] == "gloo"  # offers, votes and manifests ride the group's gloo side
    # the group the bytes travel in is the process-group plan's own
    (group,) = [g for g in plan["process_groups"]["groups"] if g["kind"] == "weight_sync"]
    assert (group["ranks"], group["backend"]) == (weights["group"]["ranks"], wire)
    store = dry_json(capsys, "--platform", machine, "rollout.placement=disaggregated",
                     "weights.transport=object_store")["weights"]
    assert store["handoffs"] == [handoff("cpu", "ray object store", "object store")]
    assert store["via"] == "weight mailbox"
    monkeypatch.setenv("COLUMNS", "300")  # one tree line per line
    assert main(["train", "--dry-run", "--platform", machine, "actor.num_cpus_per_worker=1",
                 "rollout.max_model_len=64"]) == 0
    text = capsys.readouterr().out
    assert f"weights: in_place engine.update_weights: {kind} -> {kind}, policy rank 0 -> policy" in text


def test_shared_memory_off_leaves_the_backend_alone(capsys):
    weights = dry_json(capsys, "rollout.placement=disaggregated", "weights.shared_memory=false")["weights"]
    assert weights["handoffs"] == [handoff("cpu", "gloo", "backend")]


@pytest.mark.parametrize("machine, device", [("h100", "cuda:0"), ("cpu", "cpu")])
def test_an_in_process_dry_run_shows_the_one_process_not_a_ray_launch(capsys, monkeypatch, machine, device):
    ray_run = dry_json(capsys, "--platform", machine)
    plan = dry_json(capsys, "--platform", machine, "ray.enabled=false")
    assert plan["in_process"] is True
    assert not {"job", "actors", "devices", "process_groups"} & set(plan)  # it starts none of them
    (worker,) = plan["workers"]
    (rank,) = ray_run["actors"]
    assert (worker["name"], worker["class"], worker["device"]) == ("policy rank 0", "PolicyWorker", device)
    assert worker["num_threads"] == rank["num_threads"] == 1
    assert worker["env"] == rank["env"]  # what the Ray actor's runtime env would have set, set here
    assert worker["engine"] == rank["engine"] and worker["plan"] == rank["plan"]
    assert plan["weights"]["handoffs"] == ray_run["weights"]["handoffs"]
    assert any("when exported before polyrl starts" in n for n in plan["notes"])
    monkeypatch.setenv("COLUMNS", "300")
    assert main(["train", "--dry-run", "--platform", machine, "ray.enabled=false",
                 "actor.num_cpus_per_worker=1", "rollout.max_model_len=64"]) == 0
    text = capsys.readouterr().out
    assert "no Ray job, no actor, no process group" in text and "ray.init" not in text
    assert "a PolicyWorker object of this process (LocalActor)" in text and f"device {device}" in text


@pytest.mark.parametrize("setting", [
    ["actor.world_size=2"], ["rollout.placement=disaggregated"], ["trainer.mode=async"],
    ["distill.teacher=builtin:tiny-arith", "distill.placement=disaggregated"],
    ["reward.model.path=builtin:tiny-arith"], ["ray.address=auto"]])
def test_what_one_process_cannot_run_is_refused_by_the_dry_run_as_by_the_run(capsys, tmp_path, setting):
    """The dry run and the run load the config through the same check (JobConfig), so the
    dry run's error is the run's, word for word."""
    args = ["ray.enabled=false", f"trainer.output_dir={tmp_path}", *setting]
    assert main(["train", "--dry-run", "--json", *args]) == 2
    dry = capsys.readouterr()
    assert dry.out == ""
    assert main(["train", *args]) == 2
    run = capsys.readouterr()
    assert dry.err == run.err and "Traceback" not in run.err
    assert list(tmp_path.iterdir()) == []  # refused before anything was written
    if setting != ["trainer.mode=async"]:  # refused first as needing disaggregated placement
        assert "ray.enabled=false runs the whole run in this one process" in run.err
