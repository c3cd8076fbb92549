"""A mixture-of-experts policy loads sharded (polyrl/training/sharded_load.py `FusedExperts`): the
checkpoint's per-expert tensors are read into the fused expert tensors by experts, so under FSDP2
and expert parallelism each gloo rank reads its own experts only; every rank's shards equal the
whole load's slices, the log-probs equal one rank's whole load, and the bytes a rank reads fall
with the ranks."""

from __future__ import annotations

import pytest
import torch

import engine_ranks
from gloo_world import run_world_ok
from moe_models import build_moe_model


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory) -> str:
    # 3 layers (one dense between two expert layers), 6 experts: 3 per rank at ep=2, 3 per rank
    # as FSDP2's dim-0 chunk at ep=1; the checkpoint in bf16, loaded as fp32 (a converting read)
    from transformers import AutoModelForCausalLM

    path = build_moe_model(tmp_path_factory.mktemp("moe"), "qwen3_moe")
    AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).save_pretrained(path + "-bf16")
    return path


def _local_block(p) -> tuple[torch.Tensor, int]:
    """This rank's rows of a (DTensor) parameter and the row of the full tensor they start at."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(p, DTensor):
        return p.detach(), 0
    _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    assert all(o == 0 for o in offset[1:])  # whole rows
    return p.to_local().detach(), offset[0]


def sharded_load_rank(rank: int, world_size: int, model_path: str, ep: int) -> dict:
    """One rank: the deferred fsdp2 load at `ep`, with every byte the sharded reader reads
    counted; whether each local block equals the whole load's rows, and the log-probs."""
    import torch.distributed as dist

    from polyrl.platform import get_platform
    from polyrl.training import build_engine, sharded_load
    from polyrl.training.model_loading import load_causal_lm

    read = {"bytes": 0}
    plain_read = sharded_load._read_into

    def counted(file, offset, out):
        read["bytes"] += out.numel() * out.element_size()
        plain_read(file, offset, out)

    sharded_load._read_into = counted
    cfg = engine_ranks.actor_config("fsdp2", world_size=world_size, expert_parallel_size=ep)
    platform = get_platform("cpu")
    model = load_causal_lm(model_path, cfg.param_dtype, deferred=True)
    deferred = all(p.is_meta for p in model.parameters())
    engine = build_engine(model, cfg, platform, platform.torch_device(0), rank=rank, world_size=world_size,
                          group=dist.group.WORLD if world_size > 1 else None, horizon=None)
    sharded_load._read_into = plain_read
    whole = load_causal_lm(model_path, cfg.param_dtype).state_dict()
    mismatched, experts_held = [], {}
    for name, p in engine.module.named_parameters():
        local, first = _local_block(p)
        if not torch.equal(local, whole[name][first:first + local.shape[0]]):
            mismatched.append(name)
        if name.endswith("experts.gate_up_proj"):
            experts_held[name] = (first, local.shape[0])
    return {"deferred": deferred, "bytes": read["bytes"], "mismatched": mismatched, "experts_held": experts_held,
            "logprobs": engine.logprobs(engine_ranks.make_batch(9, 5)).values}


@pytest.mark.slow
def test_each_rank_reads_its_experts_only(moe_path, tmp_path):
    one = sharded_load_rank(0, 1, moe_path, 1)
    bf16 = sharded_load_rank(0, 1, moe_path + "-bf16", 1)
    assert one["deferred"] and not one["mismatched"] and not bf16["mismatched"]
    (tmp_path / "ep1").mkdir()
    (tmp_path / "ep2").mkdir()
    fsdp = run_world_ok(sharded_load_rank, 2, tmp_path / "ep1", args=(moe_path, 1), timeout_s=240)
    ep2 = run_world_ok(sharded_load_rank, 2, tmp_path / "ep2", args=(moe_path, 2), timeout_s=240)
    layers = ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.2.mlp.experts.gate_up_proj")
    for world in (fsdp, ep2):
        for rank, got in world.items():
            assert got["deferred"] and not got["mismatched"], got["mismatched"]
            # experts 0-2 on rank 0, 3-5 on rank 1 (FSDP2's dim-0 chunk, or the ep split)
            assert got["experts_held"] == {name: (3 * rank, 3) for name in layers}
            torch.testing.assert_close(got["logprobs"], one["logprobs"], rtol=0, atol=1e-5)
    whole = one["bytes"]
    print(f"\nbytes read per rank: 1 rank {whole}; 2 ranks ep=1 {[r['bytes'] for r in fsdp.values()]}; "
          f"2 ranks ep=2 {[r['bytes'] for r in ep2.values()]}")
    for world in (fsdp, ep2):
        # every byte read once over the ranks, about half on each
        assert sum(r["bytes"] for r in world.values()) == whole
        assert all(r["bytes"] <= 0.6 * whole for r in world.values())
