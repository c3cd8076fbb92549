"""The environment plan over simulated platforms x roles x backends x placements x modes.

`expected()` restates the requirements (R1-R3 of docs/architecture.md, issue 2) independently of the rule
tables, so a rule that drifts from the spec fails here.
"""

from __future__ import annotations

import itertools

import pytest

from polyrl.config.vocabulary import COLOCATED, DISAGGREGATED
from polyrl.envplan import BACKENDS, MODES, PLACEMENTS, ROLES, PlanContext, build_plan
from polyrl.envplan.rules import WORKER_NICENESS_VAR
from polyrl.platform import SIMULATED_PROBES, get_platform

HARDWARE = ["cpu", "h100", "gb200", "gb300", "mi300x", "ascend910"]
ENGINES = {"vllm", "sglang", "trtllm"}
NOSET = {
    "cuda": ["CUDA_VISIBLE_DEVICES"],
    "rocm": ["CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"],
    "npu": ["ASCEND_RT_VISIBLE_DEVICES"],
    "cpu": [],
}


def platform_of(hw: str):
    probe = SIMULATED_PROBES[hw]
    return get_platform(None if hw == "cpu" else {"h100": "cuda", "gb200": "cuda", "gb300": "cuda",
                                                   "mi300x": "rocm", "ascend910": "npu"}[hw], probe)


def expected(hw: str, role: str, backend: str, opt_in: bool, placement: str = COLOCATED,
             hands_devices: bool = False) -> dict[str, tuple[str, str]]:
    p = platform_of(hw)
    out = {"TOKENIZERS_PARALLELISM": ("false", "polyrl-default"),
           # every Ray worker of the job at the driver's priority, not Ray's nice 15 (issue 42)
           "RAY_worker_niceness": ("0", "rule:ray-worker-priority")}
    if p.name == "rocm":
        out["RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"] = ("0", "platform-default")
    if opt_in and p.name == "cuda" and p.capability >= (10, 0):
        out["NCCL_NVLS_ENABLE"] = ("0", "rule:blackwell-nvls-mnnvl-off")
        out["NCCL_MNNVL_ENABLE"] = ("0", "rule:blackwell-nvls-mnnvl-off")
    if opt_in:
        out["TLLM_DISABLE_NVLS_MNNVL"] = ("1", "user-env")
    if backend == "sglang" and role in ("trainer", "rollout"):
        # SGLang must report the unmodified policy's log-probs (the colocated engine lives in the
        # trainer process)
        out["SGLANG_RETURN_ORIGINAL_LOGPROB"] = ("1", "rule:sglang-original-logprobs")
    if placement == DISAGGREGATED and p.name in ("cuda", "rocm"):
        # one value in every process of the weight-sync NCCL group (issue 39; RCCL reads it too,
        # issue 15), and multi-node NVLink (GB200/GB300 NVL72) keeps NCCL's cuMem buffers
        out["NCCL_CUMEM_ENABLE"] = (("1", "rule:nccl-cumem-mnnvl") if p.multi_node_nvlink
                                    else ("0", "rule:nccl-cumem-off"))
    if role == "rollout":
        # only an engine host that reserves no Ray devices keeps the node's visibility (issue 15)
        if backend in ENGINES and hands_devices:
            for var in NOSET[p.name]:
                out[f"RAY_EXPERIMENTAL_NOSET_{var}"] = ("1", "platform-default")
    # CPU training and decoding keep freed large tensors in the heap (issue 17, allocator churn)
    if p.name == "cpu" and role in ("trainer", "rollout"):
        out["MALLOC_MMAP_MAX_"] = ("0", "rule:cpu-malloc-keep-heap")
        out["MALLOC_TRIM_THRESHOLD_"] = (str(16 * 2**30), "rule:cpu-malloc-keep-heap")
    # the engine's environment follows the engine: a colocated engine lives in the trainer (issue 15)
    engine_here = role == "rollout" or (role == "trainer" and placement == COLOCATED)
    if engine_here and p.name == "rocm" and backend == "sglang":
        out["SGLANG_USE_AITER"] = ("1", "platform-default")
    return out


CASES = list(itertools.product(HARDWARE, ROLES, BACKENDS, PLACEMENTS, MODES, [False, True]))


@pytest.mark.parametrize("hw,role,backend,placement,mode,opt_in", CASES)
def test_exact_plan(hw, role, backend, placement, mode, opt_in):
    user_env = {"TLLM_DISABLE_NVLS_MNNVL": "1"} if opt_in else {}
    plan = build_plan(PlanContext(platform_of(hw), role, backend, placement=placement, mode=mode), user_env, {})
    got = {name: (e.value, e.source) for name, e in plan.entries.items()}
    assert got == expected(hw, role, backend, opt_in, placement)
    for entry in plan.entries.values():
        assert entry.reason, "every variable carries a reason"


@pytest.mark.parametrize("hw,role,backend", list(itertools.product(HARDWARE, ROLES, BACKENDS)))
def test_user_value_survives_for_every_planned_variable(hw, role, backend):
    base = build_plan(PlanContext(platform_of(hw), role, backend, placement=COLOCATED, mode="sync"), {"TLLM_DISABLE_NVLS_MNNVL": "1"}, {})
    for name in base.entries:
        user_env = {"TLLM_DISABLE_NVLS_MNNVL": "1", name: "user-value-42"}
        plan = build_plan(PlanContext(platform_of(hw), role, backend, placement=COLOCATED, mode="sync"), user_env, {})
        assert plan[name].value == "user-value-42", name
        assert plan[name].source == "user-env"


def test_gb300_user_cumem_passes_through_unchanged():
    # The verl PR 7564 bug: a GB300 user needs NCCL_CUMEM_ENABLE=1 and polyrl must keep it.
    plan = build_plan(PlanContext(platform_of("gb300"), "rollout", "vllm", placement=COLOCATED, mode="sync"), {"NCCL_CUMEM_ENABLE": "1"}, {})
    assert plan["NCCL_CUMEM_ENABLE"].value == "1"
    assert plan["NCCL_CUMEM_ENABLE"].source == "user-env"


def test_nvls_rule_needs_opt_in_and_blackwell():
    for hw, opt_in, applies in [("gb200", True, True), ("gb200", False, False), ("h100", True, False)]:
        env = {"TLLM_DISABLE_NVLS_MNNVL": "1"} if opt_in else {}
        plan = build_plan(PlanContext(platform_of(hw), "job", "trtllm", placement=COLOCATED, mode="sync"), env, {})
        assert ("NCCL_NVLS_ENABLE" in plan) is applies
        assert ("NCCL_MNNVL_ENABLE" in plan) is applies


def test_opt_in_through_config_env_counts():
    plan = build_plan(PlanContext(platform_of("gb200"), "job", "trtllm", placement=COLOCATED, mode="sync"), {},
                      {"TLLM_DISABLE_NVLS_MNNVL": "1"})
    assert plan["NCCL_NVLS_ENABLE"].value == "0"
    assert plan["TLLM_DISABLE_NVLS_MNNVL"].source == "config"


def test_config_beats_user_env_and_warns_once(caplog):
    ctx = PlanContext(platform_of("h100"), "rollout", "vllm", placement=COLOCATED, mode="sync")
    with caplog.at_level("WARNING"):
        for _ in range(3):
            plan = build_plan(ctx, {"NCCL_CUMEM_ENABLE": "1"}, {"NCCL_CUMEM_ENABLE": "0"})
    assert plan["NCCL_CUMEM_ENABLE"].value == "0"
    assert plan["NCCL_CUMEM_ENABLE"].source == "config"
    warnings = [r for r in caplog.records if "NCCL_CUMEM_ENABLE" in r.getMessage()]
    assert len(warnings) == 1
    assert "NCCL_CUMEM_ENABLE=1" in warnings[0].getMessage()


def test_config_only_variable_and_forwarded_user_variables():
    plan = build_plan(PlanContext(platform_of("cpu"), "trainer", placement=COLOCATED, mode="sync"),
                      {"NCCL_DEBUG": "INFO", "HOME": "/root", "CUDA_VISIBLE_DEVICES": "3"},
                      {"MY_FLAG": "on"})
    assert plan["MY_FLAG"].source == "config"
    assert plan["NCCL_DEBUG"].value == "INFO" and plan["NCCL_DEBUG"].source == "user-env"
    assert "HOME" not in plan  # unrelated variables reach local workers by inheritance only
    assert "CUDA_VISIBLE_DEVICES" not in plan  # Ray assigns devices per actor


def test_backend_version_condition():
    from polyrl.envplan import EnvRule

    rule = EnvRule(id="x", variables={"X": "1"}, reason="r", link="",
                   backends=frozenset({"sglang"}), backend_version=">=0.5.12")
    p = platform_of("h100")
    for version, applies in [("0.5.12", True), ("0.6.0", True), ("0.5.11", False), (None, False)]:
        plan = build_plan(PlanContext(p, "rollout", "sglang", placement=COLOCATED, mode="sync", backend_version=version), {}, {},
                          rules=(rule,))
        assert ("X" in plan) is applies, version


def test_context_rejects_unknown_values():
    with pytest.raises(ValueError, match="backend: 'vlm' is not one of native, vllm, sglang, trtllm"):
        PlanContext(platform_of("cpu"), "rollout", "vlm", placement=COLOCATED, mode="sync")


@pytest.mark.parametrize("hw", HARDWARE)
@pytest.mark.parametrize("backend", sorted(ENGINES))
def test_exact_plan_of_an_engine_host_that_hands_devices(hw, backend):
    ctx = PlanContext(platform_of(hw), "rollout", backend, placement=DISAGGREGATED, mode="sync", hands_devices=True)
    got = {name: (e.value, e.source) for name, e in build_plan(ctx, {}, {}).entries.items()}
    assert got == expected(hw, "rollout", backend, False, DISAGGREGATED, hands_devices=True)
    if NOSET[platform_of(hw).name]:
        reason = build_plan(ctx, {}, {})[f"RAY_EXPERIMENTAL_NOSET_{NOSET[platform_of(hw).name][0]}"].reason
        assert "num_gpus=0" in reason and "exactly the devices" in reason


@pytest.mark.parametrize("placement,aiter", [(COLOCATED, True), (DISAGGREGATED, False)])
def test_colocated_sglang_on_rocm_trainer_gets_aiter_and_user_value_wins(placement, aiter):
    # seed 6664: the colocated engine got attention_backend=aiter but not SGLANG_USE_AITER=1
    ctx = PlanContext(platform_of("mi300x"), "trainer", "sglang", placement=placement, mode="sync")
    plan = build_plan(ctx, {}, {})
    assert ("SGLANG_USE_AITER" in plan) is aiter
    if aiter:
        assert plan["SGLANG_USE_AITER"].value == "1"
        kept = build_plan(ctx, {"SGLANG_USE_AITER": "0"}, {})["SGLANG_USE_AITER"]
        assert (kept.value, kept.source) == ("0", "user-env")


def test_rocm_rollout_gets_cumem_off_and_user_value_wins():
    ctx = PlanContext(platform_of("mi300x"), "rollout", "vllm", placement=DISAGGREGATED, mode="sync")
    entry = build_plan(ctx, {}, {})["NCCL_CUMEM_ENABLE"]
    assert (entry.value, entry.source) == ("0", "rule:nccl-cumem-off")
    kept = build_plan(ctx, {"NCCL_CUMEM_ENABLE": "1"}, {})["NCCL_CUMEM_ENABLE"]
    assert (kept.value, kept.source) == ("1", "user-env")


def test_runtime_env_renders_values():
    plan = build_plan(PlanContext(platform_of("mi300x"), "rollout", "sglang", placement=COLOCATED, mode="sync", hands_devices=True),
                      {}, {})
    env = plan.runtime_env({"env_vars": {"KEEP": "1"}, "pip": []})
    assert env["pip"] == []
    assert env["env_vars"]["KEEP"] == "1"
    assert env["env_vars"]["RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES"] == "1"
    assert env["env_vars"]["RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"] == "0"


def test_a_users_malloc_setting_wins_over_the_cpu_rule():
    plan = build_plan(PlanContext(platform_of("cpu"), "trainer", placement=COLOCATED, mode="sync"), {"MALLOC_MMAP_MAX_": "65536"}, {})
    assert plan.entries["MALLOC_MMAP_MAX_"].value == "65536"
    assert plan.entries["MALLOC_MMAP_MAX_"].source == "user-env"
    assert plan.entries["MALLOC_TRIM_THRESHOLD_"].source == "rule:cpu-malloc-keep-heap"


@pytest.mark.parametrize("role", ROLES)
def test_worker_priority_is_a_rule_and_a_users_value_is_kept(role):
    """RAY_worker_niceness=0 is the job's rule, so every role's runtime env carries it (the
    ray.init one and each actor's); a value in the user's environment is kept (15: Ray's own), and
    the config's `env:` wins over both."""
    ctx = PlanContext(platform_of("cpu"), role, placement=COLOCATED, mode="sync")
    planned = build_plan(ctx, {}, {})[WORKER_NICENESS_VAR]
    assert (planned.value, planned.source) == ("0", "rule:ray-worker-priority")
    assert "nice 15" in planned.reason and "RAY_worker_niceness=15 restores" in planned.reason
    assert build_plan(ctx, {}, {}).runtime_env()["env_vars"][WORKER_NICENESS_VAR] == "0"
    kept = build_plan(ctx, {WORKER_NICENESS_VAR: "15"}, {})[WORKER_NICENESS_VAR]
    assert (kept.value, kept.source) == ("15", "user-env")
    assert "rule:ray-worker-priority would be 0" in kept.reason
    config = build_plan(ctx, {WORKER_NICENESS_VAR: "15"}, {WORKER_NICENESS_VAR: "5"})[WORKER_NICENESS_VAR]
    assert (config.value, config.source) == ("5", "config")
