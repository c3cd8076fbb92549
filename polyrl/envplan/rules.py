"""Workaround rules as data: a condition, the variables, the reason and a link.

A rule never overrides a value the user set (in their environment or the config's `env:`
section); `build_plan` enforces that for every rule. Risky workarounds are opt-in (R2).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from polyrl.backends import ENGINE_PROCESS_BACKENDS
from polyrl.config.vocabulary import DISAGGREGATED

if TYPE_CHECKING:
    from polyrl.envplan.plan import PlanContext


@dataclass(frozen=True)
class EnvRule:
    id: str
    variables: Mapping[str, str]
    reason: str
    link: str
    roles: frozenset[str] = frozenset({"job", "trainer", "rollout"})
    """Roles whose processes get the variables ("job" = the Ray job's runtime env)."""
    platforms: frozenset[str] | None = None
    backends: frozenset[str] | None = None
    placements: frozenset[str] | None = None
    modes: frozenset[str] | None = None
    min_capability: tuple[int, int] | None = None
    backend_version: str | None = None
    """A PEP 440 specifier the installed (or declared) backend version must satisfy."""
    opt_in: Mapping[str, str] = field(default_factory=dict)
    """Variables the user must set (in their environment or `env:`) to enable the rule."""
    multi_node_nvlink: bool | None = None
    """Only where the nodes do (True) or do not (False) have multi-node NVLink
    (`Platform.multi_node_nvlink`); None: either."""

    def applies(self, ctx: "PlanContext", explicit: Mapping[str, str]) -> bool:
        if ctx.role not in self.roles:
            return False
        if self.platforms is not None and ctx.platform.name not in self.platforms:
            return False
        if self.backends is not None and ctx.backend not in self.backends:
            return False
        if self.placements is not None and ctx.placement not in self.placements:
            return False
        if self.modes is not None and ctx.mode not in self.modes:
            return False
        if self.multi_node_nvlink is not None and ctx.platform.multi_node_nvlink != self.multi_node_nvlink:
            return False
        if self.min_capability is not None:
            cap = ctx.platform.capability
            if cap is None or tuple(cap) < self.min_capability:
                return False
        if self.backend_version is not None:
            if ctx.backend_version is None:
                return False
            try:
                if Version(ctx.backend_version) not in SpecifierSet(self.backend_version):
                    return False
            except InvalidVersion:
                return False
        return all(explicit.get(k) == v for k, v in self.opt_in.items())


_GPU = frozenset({"cuda", "rocm", "npu"})
_ENGINES = ENGINE_PROCESS_BACKENDS  # the GPU engines, from the one backend list (live view)

WORKER_NICENESS_VAR = "RAY_worker_niceness"
"""Ray's `worker_niceness` setting (default 15), read by each Ray worker process from its own
environment: the worker raises its nice value by it when it starts (Ray's job manager gives a
submitted job's driver 0 the same way, in its environment)."""

RULES: tuple[EnvRule, ...] = (
    # Ray nices its workers to keep its own daemons responsive beside many busy tasks; a polyrl
    # job runs few actors, one per reserved CPU share, whose threads follow the free cores
    # (polyrl/rollout/native/threads.py). The job's variable, so the ray.init runtime env and
    # every actor's (an actor's plan includes the job's variables) carry it.
    EnvRule(
        id="ray-worker-priority",
        variables={WORKER_NICENESS_VAR: "0"},
        reason="Ray starts its workers at nice 15, where a process gets ~3% of a core it shares "
        "with any nice-0 one (kernel weights 36 against 1024): beside other work a training rank "
        "kept 0.35 of its idle speed, at nice 0 0.82 (docs/benchmarks.md, \"GRPO step under "
        "contention\"); polyrl's actors run at the driver's priority. RAY_worker_niceness=15 "
        "restores Ray's",
        link="https://github.com/ray-project/ray/blob/master/src/ray/common/ray_config_def.h",
        roles=frozenset({"job"}),
    ),
    # NCCL_CUMEM_ENABLE must be one value in every process of a weight-sync NCCL group (vLLM:
    # "all processes that interact with vllm workers"): it is the job's, so every role (trainer,
    # rollout replicas, teachers) inherits the same value, or the user's where they set one.
    EnvRule(
        id="nccl-cumem-off",
        variables={"NCCL_CUMEM_ENABLE": "0"},
        reason="vLLM weight sync over NCCL can hang or crash with cuMem-based NCCL buffers, and "
        "vLLM sets 0 in its own processes; the trainer and every rollout rank share the weight-sync "
        "group, so every process gets the same value (RCCL on ROCm reads it too). Set "
        "NCCL_CUMEM_ENABLE yourself and your value is kept, in every process",
        link="https://github.com/verl-project/verl/pull/7564",
        roles=frozenset({"job"}),
        platforms=frozenset({"cuda", "rocm"}),
        placements=frozenset({DISAGGREGATED}),
        multi_node_nvlink=False,
    ),
    EnvRule(
        id="nccl-cumem-mnnvl",
        variables={"NCCL_CUMEM_ENABLE": "1"},
        reason="multi-node NVLink (GB200/GB300 NVL72, /dev/nvidia-caps-imex-channels present) "
        "needs NCCL's cuMem buffers, so vLLM leaves them on there; every process of the "
        "weight-sync group gets the same explicit 1 (a library that would set 0 when the variable "
        "is unset keeps it)",
        link="https://github.com/verl-project/verl/pull/7564",
        roles=frozenset({"job"}),
        platforms=frozenset({"cuda"}),
        placements=frozenset({DISAGGREGATED}),
        multi_node_nvlink=True,
    ),
    EnvRule(
        id="blackwell-nvls-mnnvl-off",
        variables={"NCCL_NVLS_ENABLE": "0", "NCCL_MNNVL_ENABLE": "0"},
        reason="Blackwell (capability >= 10) async Megatron weight export hangs with NVLS / "
        "MNNVL; the same setting hangs synchronous multi-node TRT-LLM rollout, so it is opt-in "
        "via TLLM_DISABLE_NVLS_MNNVL=1",
        link="https://github.com/verl-project/verl/pull/6344",
        roles=frozenset({"job", "trainer", "rollout"}),
        platforms=frozenset({"cuda"}),
        min_capability=(10, 0),
        opt_in={"TLLM_DISABLE_NVLS_MNNVL": "1"},
    ),
    EnvRule(
        id="sglang-original-logprobs",
        variables={"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"},
        reason="SGLang reports the log-probs of the temperature-scaled distribution unless this "
        "is set; polyrl's rollout log-probs (used as the trainer's old log-probs and for "
        "off-policy correction) must be those of the unmodified policy",
        link="https://github.com/sgl-project/sglang/blob/main/python/sglang/srt/layers/sampler.py",
        # colocated placement runs the engine inside the trainer process
        roles=frozenset({"trainer", "rollout"}),
        backends=frozenset({"sglang"}),
    ),
    EnvRule(
        id="cpu-malloc-keep-heap",
        variables={"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(16 * 2**30)},
        reason="glibc maps every allocation above 32 MiB afresh and unmaps it on free, so a CPU "
        "training step faults its [batch, response, vocab] logits and gradients in again every "
        "step (benchmarks/allocator.py: ~125k minor faults per 30M update); kept in the heap, "
        "freed memory is reused. Cost: a process keeps its peak heap",
        link="https://man7.org/linux/man-pages/man3/mallopt.3.html",
        roles=frozenset({"trainer", "rollout"}),
        platforms=frozenset({"cpu"}),
    ),
)

# Defaults polyrl itself needs everywhere, independent of hardware.
POLYRL_DEFAULTS: tuple[tuple[str, str, str, str], ...] = (
    (
        "TOKENIZERS_PARALLELISM",
        "false",
        "Hugging Face tokenizers' thread pool deadlocks (and warns) after a fork; Ray and "
        "polyrl batch tokenisation themselves",
        "https://github.com/huggingface/tokenizers/issues/993",
    ),
)

# Variables of the user's environment that every polyrl process must see even on a remote Ray
# cluster (whose workers do not inherit the driver's environment). Visibility variables are
# deliberately absent: Ray assigns devices per actor.
FORWARDED_PREFIXES: tuple[str, ...] = (
    "NCCL_", "GLOO_", "HCCL_", "RCCL_", "VLLM_", "SGLANG_", "TLLM_", "TRTLLM_", "HF_",
    "TRANSFORMERS_", "TOKENIZERS_", "POLYRL_", "PYTORCH_", "TORCH_",
)

ENGINE_BACKENDS = _ENGINES
GPU_PLATFORMS = _GPU

PLACEMENT_BUNDLE_VAR = "POLYRL_PLACEMENT_BUNDLE"
"""The placement-group bundle an engine-starting actor was started in (Ray tells an actor its
placement group, not its bundle); `polyrl/rollout/engines/trtllm.py:placement` reads it."""
BUNDLE_BACKENDS = frozenset({"trtllm"})
"""Engines that start Ray workers of their own in the bundles of the actor that starts them
(TensorRT-LLM's Ray orchestrator: `placement_groups` / `placement_bundle_indices`), so that
actor must know its bundle."""
