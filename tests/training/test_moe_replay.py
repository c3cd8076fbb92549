"""Rollout routing replay (`actor.router_replay`, training/moe_replay.py; docs/moe.md): the native
engine records each generated token's experts, the routes column (polyrl/batch/routes.py) carries
them through micro-batching and packing, and the trainer's routers replay them with their
gradient kept; R2 records the trainer's own old-policy routes; the moe/ metrics; the one-line
refusals."""

from __future__ import annotations

import pytest
import torch

import engine_ranks
from moe_models import build_moe_model
from polyrl.batch import collate
from polyrl.batch.packed import collate_packed
from polyrl.batch.routes import not_routed
from polyrl.rollout.base import SamplingParams
from polyrl.rollout.native.engine import NativeEngine
from polyrl.training.moe_replay import replay_of
from polyrl.workers.generation import to_batch

PROMPTS = [[5, 6, 7, 8, 9], [8, 9], [3, 4, 5, 6]]


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory) -> str:
    return build_moe_model(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe")


@pytest.fixture(scope="module")
def sampled(moe_path):
    engine = NativeEngine(moe_path, max_model_len=64)
    outs = engine.generate_batch(PROMPTS, SamplingParams(n=3, max_tokens=10, seed=0, ignore_eos=True))
    batch = to_batch(engine.tokenizer, engine.eos_token_ids, PROMPTS, outs, [0, 1, 2])
    return batch.replace(advantages=torch.randn(len(batch), generator=torch.Generator().manual_seed(0)))


def test_engine_routes_column(sampled):
    routes = sampled.routes
    assert routes.values.dtype == torch.uint8 and routes.values.shape == (len(sampled.response_ids.values), 2, 2)
    assert torch.equal(routes.offsets, sampled.response_ids.offsets)
    last = routes.offsets[1:] - 1  # each sample's last token is never fed back: not routed
    assert bool((routes.values[last] == not_routed(torch.uint8)).all())
    assert bool((routes.values[routes.offsets[:-1]] < 6).all())
    # every top-k set holds k distinct experts
    ids = routes.values[routes.offsets[:-1]].long()
    assert bool((ids[..., 0] != ids[..., 1]).all())


def test_routes_survive_padding_packing_and_selection(sampled):
    picked = [4, 0, 7]
    padded = collate(sampled, picked, torch.device("cpu"))
    packed = collate_packed(sampled, picked, torch.device("cpu"))
    real = padded.attention_mask.bool()
    assert torch.equal(packed.routes[0], padded.routes[real])
    for row, i in enumerate(picked):
        p = len(sampled.prompt_ids.row(i))
        want = sampled.routes.row(i)[:-1].long()  # the fed response tokens
        assert torch.equal(padded.routes[row, p: p + len(want)], want)
        assert bool((padded.routes[row, :p] == -1).all())  # the trainer routes the prompt
    # a pickled trip (Ray) and a selection keep them aligned
    import pickle

    back = pickle.loads(pickle.dumps(sampled.select([2, 5])))
    assert torch.equal(back.routes.values, torch.cat([sampled.routes.row(2), sampled.routes.row(5)]))


def test_fp32_engine_and_trainer_agree_and_replay_changes_nothing(moe_path, sampled):
    """Same weights in fp32: the trainer's own routes are the engine's (route match 1), so a
    single-step update with R3 is the update without it, to the bit."""
    results = {}
    for mode in ("off", "R3"):
        trainer, actor = engine_ranks.build(moe_path, engine_ranks.actor_config("ddp", router_replay=mode, ppo_epochs=1), 0, 1)
        metrics = actor.update(sampled, 1, False, version=0)
        results[mode] = (metrics, engine_ranks.full_weights(trainer))
        assert metrics["moe/route_match"] == 1.0
        # a token's 2 slots go to 2 distinct experts of 6: the busiest holds 1/6 to 1/2 of them
        assert 1 / 6 <= metrics["moe/expert_load_max"] <= 1 / 2
    assert results["off"][0]["actor/loss"] == results["R3"][0]["actor/loss"]
    for name, w in results["off"][1].items():
        assert torch.equal(w, results["R3"][1][name]), name


def test_replayed_routes_are_used_and_the_router_keeps_its_gradient(moe_path, sampled):
    # routes the trainer would not choose: each expert id shifted by one
    mark = not_routed(torch.uint8)
    values = sampled.routes.values
    shifted = torch.where(values == mark, values, (values + 1) % 6)
    forced = sampled.replace(routes=sampled.routes.with_values(shifted))
    trainer, actor = engine_ranks.build(moe_path, engine_ranks.actor_config("ddp", router_replay="R3"), 0, 1)
    own = trainer.logprobs(sampled).values
    assert replay_of(trainer.module).metrics()["moe/route_match"] == 1.0
    replayed = trainer.logprobs(forced).values
    assert (own - replayed).abs().max() > 1e-3
    assert replay_of(trainer.module).metrics()["moe/route_match"] < 0.2
    # the router's gradient flows through probs.gather(replayed ids)
    mb = next(trainer.micro_batches(forced))
    logprob, _ = trainer.forward(mb)
    (logprob * mb.response_mask).sum().backward()
    router = trainer.module.model.layers[0].mlp.gate.weight
    assert router.grad is not None and router.grad.abs().sum() > 0


def test_r2_records_the_trainers_own_routes(moe_path, sampled):
    trainer, actor = engine_ranks.build(moe_path, engine_ranks.actor_config("ddp", router_replay="R2"), 0, 1)
    replay = replay_of(trainer.module)
    replay.record_into = replay.empty_routes(sampled.response_ids)
    trainer.logprobs(sampled.replace(routes=None))
    # fp32, same weights: the trainer's own routes are the engine's, token for token
    assert torch.equal(replay.record_into.values, sampled.routes.values)
    replay.record_into = None
    metrics = actor.update(sampled, 2, False, version=0)  # two optimizer steps: R2 replays in the second
    assert "moe/route_match" in metrics and "moe/expert_load_max" in metrics


def test_aux_loss_reaches_the_router_and_the_update(moe_path, sampled):
    routers = {}
    for coef in (0.0, 1.0):
        cfg = engine_ranks.actor_config("ddp", router_aux_loss_coef=coef, ppo_epochs=1)
        trainer, actor = engine_ranks.build(moe_path, cfg, 0, 1)
        actor.update(sampled, 1, False)
        routers[coef] = engine_ranks.full_weights(trainer)["model.layers.0.mlp.gate.weight"]
    mb = next(trainer.micro_batches(sampled))
    trainer.forward(mb)
    aux = replay_of(trainer.module).aux_loss()
    assert aux is not None and aux.requires_grad and 0 < float(aux.detach()) <= 6
    aux.backward()
    assert trainer.module.model.layers[2].mlp.gate.weight.grad.abs().sum() > 0
    # the update's loss includes it: the router moved elsewhere
    assert (routers[1.0] - routers[0.0]).abs().max() > 1e-6


def test_refusals_are_one_line(tmp_path):
    from polyrl.config import ConfigError, load_config
    from polyrl.job import JobConfig
    from polyrl.trainer.preflight import check_router_replay

    def problem(overrides, model_config):
        with pytest.raises(ConfigError) as err:
            check_router_replay(load_config(JobConfig, overrides=overrides), model_config)
        (line,) = err.value.problems
        assert "\n" not in line
        return line

    from moe_models import moe_config
    from transformers import Qwen2Config

    moe = moe_config("qwen3_moe")
    assert "declares no routed_experts" in problem(["actor.router_replay=R3", "rollout.backend=trtllm"], moe)
    assert "not a Qwen3-MoE" in problem(["actor.router_replay=R2"], Qwen2Config())
    check_router_replay(load_config(JobConfig, overrides=["actor.router_replay=R3"]), moe)  # native: fine
    with pytest.raises(ValueError, match="actor.compile=on"):
        engine_ranks.actor_config("ddp", router_replay="R3", compile="on")


def test_outputs_without_routes_are_marked_not_routed():
    """A sample whose engine output has no routes (or routes not covering its tokens, a resumed
    partial rollout) gets unmarked rows, so the batch's column stays whole."""
    from polyrl.batch.routes import encode, engine_routes
    from polyrl.rollout.base import TokenOutput

    def out(n, routes):
        extra = {} if routes is None else {"routed_experts": routes}
        return TokenOutput(token_ids=list(range(n)), logprobs=[0.0] * n, stop_reason="length", weight_version=0,
                           extra=extra)

    mark = not_routed(torch.uint8)
    good = encode(torch.ones(2, 2, 2, dtype=torch.long), 3, torch.uint8, 2, 2)
    column = engine_routes([out(3, good), out(2, None), out(4, good)])
    assert column.lengths.tolist() == [3, 2, 4]
    assert bool((column.row(0)[:2] == 1).all()) and bool((column.row(0)[2] == mark).all())
    assert bool((column.row(1) == mark).all()) and bool((column.row(2) == mark).all())
    assert engine_routes([out(2, None)]) is None


# --- sequence parallelism --------------------------------------------------------------------------
EXPERTS, TOP_K, MOE_LAYERS = 6, 2, 2  # tests/moe_models.py: 3 layers, the middle one dense


def random_routes(batch, seed: int):
    """The batch with engine routes the trainer would not all choose itself: k distinct random
    experts per response token and MoE layer, a fifth of the tokens unmarked."""
    g = torch.Generator().manual_seed(seed)
    n = len(batch.response_ids.values)
    ids = torch.rand(n, MOE_LAYERS, EXPERTS, generator=g).argsort(-1)[..., :TOP_K].to(torch.uint8)
    ids[torch.rand(n, generator=g) < 0.2] = not_routed(torch.uint8)
    return batch.replace(routes=batch.response_ids.with_values(ids))


def replay_sp_rank(rank: int, world_size: int, model_path: str, sp: int) -> dict:
    """One rank of an sp group (both ranks hold the whole batch): R3's log-probs of a batch and
    two PPO updates with the load-balancing loss (gradient checkpointing on: the recompute
    replays the slice's routes), then an R2 policy's update, whose old-policy pass records the
    routes it replays in the second epoch (each rank routes its slice; the record gathers the
    row)."""
    strategy = "fsdp2" if world_size > 1 else "ddp"
    out: dict = {}
    for mode in ("R3", "R2"):
        cfg = engine_ranks.actor_config(strategy, world_size=world_size, sequence_parallel_size=sp, packing="on",
                                        router_replay=mode, gradient_checkpointing=True,
                                        router_aux_loss_coef=0.1 if mode == "R3" else 0.0)
        engine, actor = engine_ranks.build(model_path, cfg, rank, world_size)
        if mode == "R3":
            out["logprobs"] = engine.logprobs(random_routes(engine_ranks.make_batch(9, 5), 9)).values
            replay_of(engine.module).reset_metrics()
        out[mode] = [actor.update(random_routes(engine_ranks.make_batch(seed, 6), seed), 1, False)
                     for seed in ((1, 2) if mode == "R3" else (3,))]
        if mode == "R2":
            replay = replay_of(engine.module)
            replay.record_into = replay.empty_routes(engine_ranks.make_batch(4, 6).response_ids)
            engine.logprobs(engine_ranks.make_batch(4, 6))
            out["recorded"] = replay.record_into.values
    return out


@pytest.mark.slow  # ~40 s on 2 cores: one rank, then two
def test_sequence_parallel_replay_equals_one_rank(moe_path, tmp_path):
    """actor.sequence_parallel_size=2 with R3 (engine routes) and R2 (recorded routes): the routes
    are cut like the tokens, so two ranks each holding half of every packed row equal one rank;
    the expert load and the load-balancing loss's gradient are the whole row's."""
    from gloo_world import run_world_ok

    one = replay_sp_rank(0, 1, moe_path, 1)
    two = run_world_ok(replay_sp_rank, 2, tmp_path, args=(moe_path, 2), timeout_s=300)
    assert one["R3"][0]["moe/route_match"] < 0.9  # the random routes do change the routing
    for rank, got in two.items():
        torch.testing.assert_close(got["logprobs"], one["logprobs"], rtol=0, atol=1e-5)
        for mode in ("R3", "R2"):
            for a, b in zip(one[mode], got[mode], strict=True):
                for key in ("actor/loss", "actor/grad_norm", "moe/route_match", "moe/expert_load_max"):
                    assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (mode, key)
        assert torch.equal(got["recorded"], one["recorded"])  # R2's record, gathered from the slices
