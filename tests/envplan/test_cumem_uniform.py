"""NCCL_CUMEM_ENABLE is one value in every process of a weight-sync NCCL group (issue 39, item 7).

The trainer's leader and every rollout rank of a disaggregated run broadcast weights in one NCCL
communicator, and NCCL (vLLM says so of every process that talks to its workers) needs them to
agree. `polyrl env` used to give the rollout role 0 and the trainer nothing. Here each role's plan
comes from the CLI itself (`polyrl env --role ... --platform ...`, in process), by default and
with the user's value, on simulated H100 / MI300X nodes and on GB200 / GB300 NVL72 racks, where
multi-node NVLink needs cuMem and 0 must not be forced.
"""

from __future__ import annotations

import pytest

from polyrl.config.vocabulary import COLOCATED, DISAGGREGATED
from polyrl.cli.env_cmd import plan_for
from polyrl.cli.main import build_parser
from polyrl.platform import SIMULATED_PROBES, get_platform

ROLES = ("job", "trainer", "rollout")


def cumem(role: str, machine: str, backend: str, placement: str, monkeypatch, user: str | None):
    if user is None:
        monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    else:
        monkeypatch.setenv("NCCL_CUMEM_ENABLE", user)
    args = build_parser().parse_args(["env", "--role", role, "--backend", backend, "--placement",
                                      placement, "--platform", machine, "--backend-version", "0.11.0"])
    plan = plan_for(args)
    entry = plan.entries.get("NCCL_CUMEM_ENABLE")
    return None if entry is None else (entry.value, entry.source)


@pytest.mark.parametrize("machine,default", [("cuda", "0"), ("h100", "0"), ("mi300x", "0"),
                                             ("gb200", "1"), ("gb300", "1")])
@pytest.mark.parametrize("backend", ["vllm", "native"])
def test_every_process_of_a_disaggregated_run_gets_one_value(machine, default, backend, monkeypatch):
    seen = {role: cumem(role, machine, backend, DISAGGREGATED, monkeypatch, None) for role in ROLES}
    rule = "nccl-cumem-mnnvl" if default == "1" else "nccl-cumem-off"
    assert set(seen.values()) == {(default, f"rule:{rule}")}, seen
    # a GB200/GB300 NVL72 rack is recognised by its IMEX channels, like vLLM's own check
    assert get_platform("cuda", SIMULATED_PROBES["gb200"]).multi_node_nvlink
    assert not get_platform("cuda", SIMULATED_PROBES["h100"]).multi_node_nvlink


@pytest.mark.parametrize("machine", ["h100", "gb300", "mi300x"])
@pytest.mark.parametrize("user", ["0", "1"])
def test_the_users_value_wins_in_every_process(machine, user, monkeypatch):
    seen = {role: cumem(role, machine, "vllm", DISAGGREGATED, monkeypatch, user) for role in ROLES}
    assert set(seen.values()) == {(user, "user-env")}, seen


def test_colocated_forces_nothing_and_forwards_the_users_value(monkeypatch):
    # colocated: no process outside the trainer ranks, which all host the engine alike
    assert {cumem(r, "h100", "vllm", COLOCATED, monkeypatch, None) for r in ROLES} == {None}
    assert {cumem(r, "h100", "vllm", COLOCATED, monkeypatch, "1") for r in ROLES} == {("1", "user-env")}


def test_the_configs_value_wins_in_every_process():
    from polyrl.envplan import PlanContext, build_plan

    platform = get_platform("cuda", SIMULATED_PROBES["h100"])
    seen = {build_plan(PlanContext(platform, role, "vllm", placement=DISAGGREGATED, mode="sync"), {"NCCL_CUMEM_ENABLE": "0"},
                       {"NCCL_CUMEM_ENABLE": "1"})["NCCL_CUMEM_ENABLE"].value for role in ROLES}
    assert seen == {"1"}
