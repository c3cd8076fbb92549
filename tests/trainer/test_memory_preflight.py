"""A model too big for its policy ranks is refused before Ray starts (polyrl/trainer/preflight.py
`check_memory`, on polyrl/training/memory_floor.py), by `polyrl train` and by its dry run,
naming the memory a rank needs, what it has and the settings that would fit."""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from cli_runs import train_here  # noqa: F401  (a fixture)

from polyrl.cli.common import choose_platform
from polyrl.cli.main import main
from polyrl.config import ConfigError, load_config
from polyrl.job import JobConfig
from polyrl.trainer.preflight import check_memory
from polyrl.training import memory_floor as mf
from polyrl.training import memory_plan as mp

QWEN25_72B = {**mp.QWEN25["Qwen2.5-72B"], "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
              "max_position_embeddings": 32768}
P72 = 72_706_203_648  # the published checkpoint's tensor total (tests/benchmarks/test_memory_model.py)
H100 = 81559 * 2**20  # an H100 80GB's memory as torch reports it
STANDALONE = ["actor.strategy=fsdp2", "rollout.placement=disaggregated"]


def gib(n_bytes: float) -> str:
    return f"{n_bytes / 2**30:.1f} GiB"


@pytest.fixture(scope="module")
def big_model(tmp_path_factory) -> Path:
    """A 72B model's config.json alone: no weights are needed to be refused."""
    d = tmp_path_factory.mktemp("qwen25-72b")
    (d / "config.json").write_text(json.dumps(QWEN25_72B))
    return d


def job(*overrides: str) -> JobConfig:
    return load_config(JobConfig, overrides=list(overrides))


def refusal(cfg: JobConfig, config: dict, platform: str = "h100") -> str | None:
    try:
        check_memory(cfg, config, choose_platform(platform))
    except ConfigError as exc:
        assert len(exc.problems) == 1 and "\n" not in exc.problems[0]
        return exc.problems[0]
    return None


def test_dry_run_refuses_a_model_too_big_for_its_ranks_with_the_numbers(big_model, capsys):
    argv = ["train", "--dry-run", "--json", "--platform", "h100", f"model.path={big_model}", *STANDALONE]
    assert main([*argv, "actor.world_size=8"]) == 2
    err = capsys.readouterr().err
    # fp32 parameters, gradients, two AdamW moments and AdamW's step temporary: 20 bytes / parameter
    state = 4 * P72 / 8
    assert f"need at least {gib(5 * state)} per policy rank during the update" in err
    assert f"parameters {gib(state)[:-4]}, gradients {gib(state)[:-4]}, AdamW {gib(2 * state)[:-4]}" in err
    assert f"a cuda device has {gib(H100)}" in err
    ranks = math.ceil(20 * P72 / H100)  # 18: the fewest fsdp2 ranks whose shards fit
    bf16_ranks = math.ceil(10 * P72 / H100)
    assert f"fits: actor.world_size>={ranks}; actor.offload=true; " in err
    assert f"actor.param_dtype=bfloat16 and actor.world_size>={bf16_ranks}" in err
    assert "Traceback" not in err and err.count("\n") == 1
    # what the message says fits, fits (each change: the next test); one rank fewer does not
    engine = ["rollout.backend=vllm", "rollout.tensor_parallel_size=8", "--engine-version", "0.11.0"]
    assert main([*argv, f"actor.world_size={ranks}", *engine]) == 0
    assert main([*argv, f"actor.world_size={ranks - 1}"]) == 2
    capsys.readouterr()


def test_the_floor_is_the_memory_model_s(big_model):
    """The pre-flight's terms are the memory model's (docs/scaling.md): the sharded state of
    `training_bytes`, the sharded load under disaggregated fsdp2 and the whole load under colocated."""
    s = mp.Shape.from_config(QWEN25_72B)
    setting = mf.Setting(compute=2, reference=True, lora_targets="all-linear", engine="share", engine_dtype=2,
                         tensor_parallel=1, memory_share=0.5, device_bytes=H100, on_device=True)
    knobs = mf.Knobs(world_size=64, strategy="fsdp2", offload=False, master=4, lora_rank=0, colocated_engine=False)
    floor = mf.rank_floor(s, knobs, setting)
    model = mp.training_bytes(s, 64, reference=True)
    assert {k: floor["update"][k] for k in ("parameters", "gradients", "reference")} == \
        {k: model[k] for k in ("parameters", "gradients", "reference")}
    assert floor["update"]["AdamW"] == model["optimizer"]
    assert floor["load"]["model load"] == mp.load_bytes_sharded(s, 64)
    colocated = mf.rank_floor(s, replace(knobs, colocated_engine=True), setting)
    assert colocated["load"]["model load"] == mp.load_bytes_today(s, 64)
    assert colocated["generate"]["engine"] == 0.5 * H100  # vLLM's rollout.gpu_memory_utilization


def test_colocated_loads_whole_beside_its_engine_so_only_disaggregated_fits():
    msg = refusal(job("actor.strategy=fsdp2", "actor.world_size=8", "data.train_batch_size=16",
                      "rollout.backend=vllm"), QWEN25_72B)
    # the engine starts (0.5 of the device) while the whole fp32 model is on it
    assert f"during the engine start (whole model {gib(4 * P72)[:-4]}, engine {gib(H100 / 2)[:-4]} GiB)" in msg
    assert "rollout.placement=colocated (vllm engine at rollout.gpu_memory_utilization=0.5)" in msg
    assert msg.endswith(f"fits: rollout.placement=disaggregated and actor.world_size>={math.ceil(20 * P72 / H100)}")


def test_every_change_the_message_names_fits_and_fewer_ranks_do_not():
    # Qwen2.5-7B on one H100 with ddp and a vLLM engine beside it: five different ways out
    config = {**mp.QWEN25["Qwen2.5-7B"], "model_type": "qwen2"}
    base = ["rollout.backend=vllm", "data.train_batch_size=144"]
    msg = refusal(job(*base), config)
    changes = msg.split("fits: ")[1].split("; ")
    assert len(changes) == 5, msg
    for change in changes:
        overrides = [c.replace(">=", "=").replace("model.lora_rank>0", "model.lora_rank=8")
                     for c in change.split(" and ")]
        assert refusal(job(*base, *overrides), config) is None, change
        ranks = [o for o in overrides if o.startswith("actor.world_size=")]
        if ranks:
            fewer = int(ranks[0].split("=")[1]) - 1
            assert refusal(job(*base, *[o for o in overrides if o not in ranks], f"actor.world_size={fewer}"),
                           config) is not None, change


def test_an_engine_rank_must_hold_its_weights():
    base = [*STANDALONE, "actor.world_size=18", "rollout.backend=vllm"]
    msg = refusal(job(*base), QWEN25_72B)
    assert msg.startswith("rollout.backend=vllm: the engine's float32 weights of model.path=")
    assert f"need {gib(4 * P72)} per engine rank at rollout.tensor_parallel_size=1" in msg
    assert f"rollout.gpu_memory_utilization=0.5 of a cuda device's {gib(H100)} is {gib(H100 / 2)}" in msg
    # 4 P / 8 and 2 P / 4 bytes fit half of an H100; 4 P / 4 does not
    assert msg.endswith("fits: rollout.tensor_parallel_size>=8; "
                        "rollout.dtype=bfloat16 and rollout.tensor_parallel_size>=4")
    assert refusal(job(*base, "rollout.tensor_parallel_size=8"), QWEN25_72B) is None
    assert refusal(job(*base, "rollout.tensor_parallel_size=4", "rollout.dtype=bfloat16"), QWEN25_72B) is None
    assert refusal(job(*base, "rollout.tensor_parallel_size=4"), QWEN25_72B) is not None


def test_a_device_of_unknown_memory_is_not_checked():
    # --capability replaces the simulated machine's name: its memory is not known
    platform = choose_platform("h100", "10.0")
    assert mf.device_memory_bytes(platform) is None
    check_memory(job(*STANDALONE), QWEN25_72B, platform)


def test_train_refuses_on_cpu_before_ray_starts(train_here, tiny_model, tmp_path):
    import ray

    model = tmp_path / "huge"
    shutil.copytree(tiny_model, model)  # its tokenizer, so the run gets as far as the pre-flight
    huge = {**QWEN25_72B, "hidden_size": 32768, "num_attention_heads": 256, "num_hidden_layers": 400}
    (model / "config.json").write_text(json.dumps(huge))
    params = mp.Shape.from_config(huge).params  # ~5.6 T: more than any host's memory
    ray_before = ray.is_initialized()  # another test's session may hold one
    out = train_here(f"model.path={model}", "actor.world_size=2", "data.train_batch_size=16")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    # ddp: fp32 parameters, gradients, AdamW and its temporary; the native engine's fp32 copy
    assert f"need at least {gib(24 * params)} per policy rank during the update" in out.stderr
    assert f"{gib(mf.host_memory_bytes())} shared by 2 ranks" in out.stderr
    assert "nothing fits by more ranks" in out.stderr
    assert ray.is_initialized() == ray_before  # refused before the run starts Ray
