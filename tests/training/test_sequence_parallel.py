"""actor.sequence_parallel_size (DeepSpeed-Ulysses, polyrl/training/ulysses.py) on real gloo ranks
and real FSDP2: k ranks splitting every packed row compute what one rank computes (log-probs of
a frozen reference, PPO loss and gradient norm, the weights after training, a critic's loss)."""

from __future__ import annotations

import pytest
import torch

import engine_ranks
from gloo_world import run_world_ok
from polyrl.training.ulysses import check_heads

RTOL = 1e-5


@pytest.fixture(scope="module")
def one_rank(tiny_model):
    return engine_ranks.one_rank_facts(tiny_model)


def same_metrics(a: list[dict], b: list[dict], keys=engine_ranks.SHARE_KEYS) -> None:
    assert len(a) == len(b)
    for step_a, step_b in zip(a, b):
        for k in keys:
            assert step_a[k] == pytest.approx(step_b[k], rel=RTOL, abs=1e-9), (k, step_a, step_b)


def same_as_one_rank(ranks: dict, one: dict, sp: int, critic: bool = True) -> None:
    # the batch's contiguous shards, one per sp group (neighbouring ranks), in rank order
    leaders = [r for rank, r in sorted(ranks.items()) if rank % sp == 0]
    torch.testing.assert_close(torch.cat([r["reference"] for r in leaders]), one["reference"], rtol=RTOL, atol=1e-6)
    for rank, r in ranks.items():
        assert torch.equal(r["reference"], ranks[rank - rank % sp]["reference"])  # gathered on every sp rank
        same_metrics(r["metrics"], one["metrics"])
        for k in one["weights"]:  # as tests/training/test_fsdp2.py: Adam amplifies ~1e-9 noise
            torch.testing.assert_close(r["weights"][k], one["weights"][k], rtol=RTOL, atol=1e-5, msg=k)
        if critic:
            same_metrics(r["critic"], one["critic"], ("critic/value_loss", "critic/grad_norm"))
        # every micro-batch was split: each rank fed 1/sp of the padded row, at its own offset
        for fed, start in r["fed"]:
            assert start == fed * (rank % sp)
    assert ranks[0]["fed"] and ranks[0]["fed"] == [(f, 0) for f, _ in ranks[1]["fed"]]
    # the update moved the weights (the comparison is not between two untrained models)
    assert one["metrics"][0]["actor/grad_norm"] > 0.5


@pytest.mark.slow  # ~45 s on 2 cores: a one-rank run, then two ranks, each training a policy and a critic
def test_two_sequence_parallel_ranks_on_fsdp2_equal_one_rank(one_rank, tiny_model, tmp_path):
    ranks = run_world_ok(engine_ranks.sequence_parallel_facts, 2, tmp_path, args=(tiny_model, "fsdp2", 2),
                         timeout_s=240, backend_timeout_s=200)
    same_as_one_rank(ranks, one_rank, sp=2)


@pytest.mark.slow
def test_two_sequence_parallel_ranks_on_ddp_with_checkpointing_equal_one_rank(one_rank, tiny_model, tmp_path):
    """Gradient checkpointing replays each layer's forward, all-to-alls included, in the backward."""
    ranks = run_world_ok(engine_ranks.sequence_parallel_facts, 2, tmp_path,
                         args=(tiny_model, "ddp", 2, False, {"gradient_checkpointing": True}),
                         timeout_s=240, backend_timeout_s=200)
    same_as_one_rank(ranks, one_rank, sp=2, critic=False)


@pytest.mark.slow
def test_data_and_sequence_parallel_four_ranks_equal_one_rank(one_rank, tiny_model, tmp_path):
    """dp_shard=2 x sp=2: two batch shards, each split over two ranks."""
    ranks = run_world_ok(engine_ranks.sequence_parallel_facts, 4, tmp_path, args=(tiny_model, "fsdp2", 2),
                         timeout_s=480, backend_timeout_s=400)
    same_as_one_rank(ranks, one_rank, sp=2)


def test_heads_that_do_not_divide_are_refused_naming_model_and_k(tiny_model):
    from polyrl.training.model_loading import load_causal_lm

    model = load_causal_lm(tiny_model)  # 4 heads, 2 key-value heads
    check_heads(model, 2)
    with pytest.raises(ValueError, match=r"actor.sequence_parallel_size=4: model .* has 4 attention heads "
                                         r"and 2 key-value heads"):
        check_heads(model, 4)


def test_ulysses_exchange_gives_each_rank_its_slice_of_full_attention(tmp_path):
    """Two gloo ranks, each holding half a row's tokens of every head: the all-to-all around a
    causal attention gives each its half of the unsplit output and of the unsplit gradients."""
    import torch.nn.functional as F

    ranks = run_world_ok(engine_ranks.ulysses_attention_facts, 2, tmp_path)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 12, 8, generator=g).requires_grad_()
    k, v = (torch.randn(1, 2, 12, 8, generator=g).requires_grad_() for _ in range(2))
    weight = torch.randn(1, 12, 4, 8, generator=g)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)
    (out * weight).sum().backward()
    for rank, r in ranks.items():
        cut = slice(6 * rank, 6 * rank + 6)
        torch.testing.assert_close(r["out"], out[:, cut].detach(), rtol=1e-6, atol=1e-6)
        for got, full in zip(r["grads"], (q.grad, k.grad, v.grad)):
            torch.testing.assert_close(got, full[:, :, cut], rtol=1e-6, atol=1e-6)


@pytest.mark.slow  # ~30 s: a two-rank world building fsdp2 engines
def test_a_sequence_parallel_group_fed_different_samples_is_refused(tiny_model, tmp_path):
    ranks = run_world_ok(engine_ranks.sequence_parallel_misfed, 2, tmp_path, args=(tiny_model,),
                         timeout_s=240, backend_timeout_s=200)
    for message in ranks.values():
        assert "ranks of a sequence-parallel group were given different samples" in message


def test_mesh_groups_form_beside_ranks_outside_the_trainer(tmp_path):
    """Ranks outside the trainer take no part in its mesh's groups (was: a hang creating an sp
    group with the trainer group's ranks, seen in a sync standalone run)."""
    ranks = run_world_ok(engine_ranks.mesh_beside_other_ranks, 3, tmp_path, timeout_s=60, backend_timeout_s=30)
    assert ranks[0] == {"sum": 3.0, "sp_index": 0} and ranks[1] == {"sum": 3.0, "sp_index": 1}
    assert ranks[2] is None
