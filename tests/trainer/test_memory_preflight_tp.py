"""The memory pre-flight under training tensor parallelism (actor.tensor_parallel_size): a rank's
estimate divides what tp divides, as the memory model does (polyrl/training/memory_plan.py), so a
run that fits only with tp=2 passes it and the same run at tp=1 is refused, naming tp=2."""

from __future__ import annotations

import pytest

from polyrl.cli.common import choose_platform
from polyrl.config import ConfigError, load_config
from polyrl.job import JobConfig
from polyrl.trainer.preflight import check_memory
from polyrl.training import memory_floor as mf
from polyrl.training import memory_plan as mp

# two very wide layers: FSDP2's two gathered layers dominate a rank's update, and those are what
# tp slices (the sharded state is P / world_size either way); heads and widths divide by 2 and 4
WIDE = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=32768, hidden_size=16384,
            num_hidden_layers=2, num_attention_heads=128, num_key_value_heads=16, intermediate_size=393216,
            tie_word_embeddings=False, max_position_embeddings=4096)
RUN = ["actor.strategy=fsdp2", "actor.world_size=64", "actor.compute_dtype=bfloat16",
       "rollout.placement=disaggregated", "rollout.dtype=bfloat16"]


def refusal(config: dict, *overrides: str) -> str | None:
    try:
        check_memory(load_config(JobConfig, overrides=[*RUN, *overrides]), config, choose_platform("h100"))
    except ConfigError as exc:
        assert len(exc.problems) == 1 and "\n" not in exc.problems[0]
        return exc.problems[0]
    return None


def terms(message: str) -> dict[str, str]:
    """'(parameters 2.4, gradients 2.4, ... GiB)' of a refusal, by name."""
    inside = message.split(" GiB) with ")[0].rsplit("(", 1)[1]
    return dict(part.rsplit(" ", 1) for part in inside.split(", "))


def test_the_tp_estimate_is_the_memory_model_s():
    """Twice as wide a model is refused at tp=2 too: its terms are the memory model's at tp=2 (the
    sharded state of `training_bytes`, the transient's gathered layers with no activations)."""
    config = {**WIDE, "intermediate_size": 2 * WIDE["intermediate_size"]}
    msg = refusal(config, "actor.tensor_parallel_size=2")
    assert msg is not None and "actor.world_size=64, actor.param_dtype=float32, actor.tensor_parallel_size=2" in msg
    s = mf.model_shape(config)
    plan = mp.training_bytes(s, 64, master=4, compute=2, tp=2)
    gathered = mp._device_transient(s, False, compute=2, tokens=0, tp=2)  # no tokens: the gathered layers alone
    assert gathered == mp._device_transient(s, False, compute=2, tokens=0, tp=1) / 2
    expected = {"parameters": plan["parameters"], "gradients": plan["gradients"], "AdamW": plan["optimizer"],
                "step temporaries": gathered}
    assert terms(msg) == {name: f"{value / 2**30:.1f}" for name, value in expected.items()}, msg
    # offload is not offered (tp does not take it yet); more ranks: a multiple of tp
    assert "offload" not in msg
    ranks = int(msg.split("actor.world_size>=")[1].split(";")[0].split(" ")[0])
    assert ranks % 2 == 0


def test_a_run_that_fits_only_with_tp2_passes_and_tp1_is_refused_naming_it():
    msg = refusal(WIDE)
    assert msg is not None and msg.startswith(f"model.path={JobConfig().model.path}: its ")
    assert "during the update" in msg and "fits: " in msg
    assert "actor.tensor_parallel_size=2" in msg.split("fits: ")[1].split("; ")
    assert refusal(WIDE, "actor.tensor_parallel_size=2") is None


@pytest.mark.parametrize("sliced, lora", [(dict(tensor_parallel=2), True), (dict(expert_parallel=2), False)])
def test_no_offload_or_lora_is_suggested_where_tp_or_ep_refuses_them(sliced, lora):
    s = mf.model_shape(WIDE)
    f = mf.Setting(compute=2, reference=False, lora_targets="all-linear", engine="share", engine_dtype=2,
                   tensor_parallel=1, memory_share=0.5, device_bytes=81559 * 2**20, on_device=True)
    k = mf.Knobs(world_size=64, strategy="fsdp2", offload=False, master=4, lora_rank=0, colocated_engine=False,
                 **sliced)
    changes = mf.fitting_changes(s, k, f)
    assert not any("offload" in c for c in changes), changes
    assert any("lora" in c for c in changes) == lora, changes  # LoRA trains under tp, not yet under ep
    plain = mf.fitting_changes(s, mf.Knobs(world_size=64, strategy="fsdp2", offload=False, master=4, lora_rank=0,
                                           colocated_engine=False), f)
    assert "actor.offload=true" in plain and "model.lora_rank>0" in plain, plain
