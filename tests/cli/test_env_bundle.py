"""`polyrl env --bundle INDEX`: the environment a TensorRT-LLM engine starter gets in bundle
INDEX, the same variables (value, source, reason) the launch plan gives the actor started there
(in-process through polyrl.cli.main.main, the function `python -m polyrl` exits with)."""

from __future__ import annotations

import json
import os

import pytest

from polyrl.config import load_config
from polyrl.envplan.rules import FORWARDED_PREFIXES, PLACEMENT_BUNDLE_VAR
from polyrl.job import JobConfig
from polyrl.platform import SIMULATED_PROBES, get_platform
from polyrl.topology.launch_plan import plan_launch

NOSET = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


@pytest.fixture
def polyrl_env(capsys, monkeypatch):
    """`polyrl env ARGS` in this process, with no POLYRL_* / NCCL_* ... of this shell."""
    from polyrl.cli.main import main

    for name in list(os.environ):
        if name.startswith(FORWARDED_PREFIXES):
            monkeypatch.delenv(name)

    def run(*args):
        code = main(["env", *args])
        out = capsys.readouterr()
        return code, out.out, " ".join(out.err.split())

    return run


def test_bundle_shows_what_the_launch_plan_gives_the_actor_in_that_bundle(polyrl_env):
    """1 policy rank + 2 TP-2 TRT-LLM replicas on one H100 node: replica 1's leader starts its
    engine in bundle 3 (after the policy rank and replica 0's two ranks)."""
    code, out, _ = polyrl_env("--role", "rollout", "--backend", "trtllm", "--placement", "standalone",
                              "--platform", "h100", "--bundle", "3", "--json")
    assert code == 0
    shown = json.loads(out)
    assert shown[PLACEMENT_BUNDLE_VAR]["value"] == "3" and shown[NOSET]["value"] == "1"
    assert shown[PLACEMENT_BUNDLE_VAR]["source"] == shown[NOSET]["source"] == "placement"
    cfg = load_config(JobConfig, overrides=[
        "rollout.backend=trtllm", "rollout.placement=standalone", "rollout.num_replicas=2",
        "rollout.tensor_parallel_size=2", "rollout.max_model_len=64", "actor.num_cpus_per_worker=1"])
    plan = plan_launch(cfg, get_platform("cuda", SIMULATED_PROBES["h100"]), nodes=1)
    leader = next(a for a in plan.actors if a.name == "rollout replica 1 (rank 3)")
    assert leader.env.to_json() == shown
    # without --bundle: the plan of an actor told no bundle (as before)
    code, out, _ = polyrl_env("--role", "rollout", "--backend", "trtllm", "--placement", "standalone",
                              "--platform", "h100", "--json")
    assert code == 0 and PLACEMENT_BUNDLE_VAR not in json.loads(out) and NOSET not in json.loads(out)


def test_a_colocated_policy_rank_starts_the_engine_too(polyrl_env):
    code, out, _ = polyrl_env("--role", "trainer", "--backend", "trtllm", "--placement", "colocated",
                              "--platform", "h100", "--bundle", "0", "--json")
    assert code == 0
    assert {k: v["value"] for k, v in json.loads(out).items() if v["source"] == "placement"} == {
        PLACEMENT_BUNDLE_VAR: "0", NOSET: "1"}
    code, out, _ = polyrl_env("--role", "trainer", "--backend", "trtllm", "--placement", "colocated",
                              "--platform", "h100", "--bundle", "0")  # the table says which bundle
    assert code == 0 and "bundle=0" in out


@pytest.mark.parametrize("args,message", [
    (["--backend", "vllm", "--platform", "h100", "--bundle", "1"],
     "--bundle: only trtllm engine starters are told their bundle; the vllm engine runs in its "
     "actor's own reservation (add --backend trtllm)"),
    (["--role", "job", "--backend", "trtllm", "--platform", "h100", "--bundle", "1"],
     "--bundle: the job role starts no engine in colocated placement; use --role rollout (or --role "
     "trainer --placement colocated)"),
    (["--role", "trainer", "--placement", "disaggregated", "--backend", "trtllm", "--platform", "h100",
      "--bundle", "1"], "--bundle: the trainer role starts no engine in disaggregated placement"),
    # an earlier spelling is read as its name
    (["--role", "trainer", "--placement", "standalone", "--backend", "trtllm", "--platform", "h100",
      "--bundle", "1"], "--bundle: the trainer role starts no engine in disaggregated placement"),
    (["--backend", "trtllm", "--platform", "cpu", "--bundle", "1"],
     "--bundle: on cpu TensorRT-LLM places no Ray workers in polyrl's bundles; add --platform cuda "
     "or a machine such as h100"),
    (["--backend", "trtllm", "--platform", "h100", "--bundle", "-1"],
     "--bundle: expected a bundle index >= 0, got -1"),
])
def test_bundle_where_no_actor_is_told_one_is_refused_in_one_line(polyrl_env, args, message):
    code, out, err = polyrl_env(*args)
    assert code == 2 and out == "" and err.startswith("error:") and message in err
