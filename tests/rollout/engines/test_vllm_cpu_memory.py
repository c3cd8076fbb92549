"""vLLM's memory share on its CPU build (`launch_merge.vllm_memory_share`): there
`gpu_memory_utilization` is a share of host RAM, so an unset value is a tenth, not the GPU
default's half; a value the user sets is kept."""

from __future__ import annotations

from polyrl.platform import SIMULATED_PROBES, get_platform
from polyrl.rollout.config import RolloutConfig
from polyrl.rollout.engines.launch_merge import VLLM_CPU_MEMORY_SHARE, vllm_memory_share
from polyrl.rollout.launch_args import engine_launch_args
from tests.rollout.colocation import colocated

MODEL = "/models/Qwen3-0.6B"


def _vllm(**kw) -> RolloutConfig:
    return RolloutConfig(backend="vllm", placement="standalone", **kw)


def test_cpu_default_is_a_tenth_of_host_ram_and_a_set_value_is_kept():
    assert vllm_memory_share(_vllm(), "cpu") == VLLM_CPU_MEMORY_SHARE == 0.1
    assert vllm_memory_share(_vllm(gpu_memory_utilization=0.5), "cpu") == 0.5  # set, even to the default
    assert vllm_memory_share(_vllm(), "cuda") == 0.5  # GPUs: rollout.gpu_memory_utilization's default
    assert vllm_memory_share(_vllm(gpu_memory_utilization=0.7), "cuda") == 0.7


def test_the_default_survives_a_copy_and_the_config_loader():
    from polyrl.config.base import load_config
    from polyrl.job import JobConfig

    unset = load_config(JobConfig, (), ["rollout.backend=vllm"]).rollout
    chosen = load_config(JobConfig, (), ["rollout.backend=vllm", "rollout.gpu_memory_utilization=0.5"]).rollout
    assert vllm_memory_share(unset.model_copy(update={"max_num_seqs": 8}), "cpu") == 0.1
    assert vllm_memory_share(chosen, "cpu") == 0.5


def test_launch_args_on_cpu_use_the_cpu_share():
    cpu = get_platform(None, SIMULATED_PROBES["cpu"])
    h100 = get_platform(None, SIMULATED_PROBES["h100"])
    assert engine_launch_args(_vllm(), MODEL, cpu, colocated=colocated(_vllm()))["gpu_memory_utilization"] == 0.1
    assert engine_launch_args(_vllm(gpu_memory_utilization=0.3), MODEL, cpu,
                              colocated=False)["gpu_memory_utilization"] == 0.3
    mine = _vllm(engine_kwargs={"vllm": {"gpu_memory_utilization": 0.2}})
    assert engine_launch_args(mine, MODEL, cpu, colocated=colocated(mine))["gpu_memory_utilization"] == 0.2
    assert engine_launch_args(_vllm(), MODEL, h100, colocated=colocated(_vllm()))["gpu_memory_utilization"] == 0.5
