"""Multi-turn samples of a mixture-of-experts policy carry routes only where the model generated
(polyrl/agents/stats.py `_routes`; docs/moe.md): a real multi-turn rollout on the native engine,
whose routes column lines up with the response mask and which the trainer replays (R3) with its
own router agreeing on every routed token in fp32."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from conftest import ANSWER, BAD_CALL, CALL, native  # at import: another directory's conftest is `conftest` later
from polyrl.agents import AgentConfig, run_trajectories_sync
from polyrl.batch.routes import not_routed
from polyrl.training.moe_replay import replay_of
from test_environments import rows, sampling

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
import engine_ranks  # noqa: E402

EXPERTS = 6


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from agent_models import byte_level_tokenizer
    from moe_models import moe_config
    from transformers import AutoModelForCausalLM

    tokenizer = byte_level_tokenizer([CALL, BAD_CALL, ANSWER])
    config = moe_config("qwen3_moe", experts=EXPERTS)
    config.max_position_embeddings = 1024
    config.vocab_size, config.eos_token_id, config.pad_token_id = (len(tokenizer), tokenizer.eos_token_id,
                                                                   tokenizer.pad_token_id)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("moe_agent")
    AutoModelForCausalLM.from_config(config).save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return str(path), tokenizer


def test_multi_turn_routes_follow_the_generated_tokens_and_replay(moe_dir):
    path, tokenizer = moe_dir
    # the prefix cache on: later turns prefill only their new tokens (extend.py)
    engine = native(path, tokenizer, prefix_cache_tokens=4096)
    rollout = run_trajectories_sync(engine, tokenizer, rows(tokenizer, ["test_countdown"] * 3),
                                    sampling(tokenizer, n=2), AgentConfig(max_turns=4, max_response_tokens=120),
                                    seeds=[1, 2, 3])
    batch = rollout.batch
    assert sum(t.stats.turns - 1 for t in rollout.trajectories) > 0  # some samples had several turns
    routes, mark = batch.routes, not_routed(torch.uint8)
    assert routes is not None and torch.equal(routes.offsets, batch.response_ids.offsets)
    assert routes.values.shape[1:] == (2, 2)
    for i, traj in enumerate(rollout.trajectories):
        rows_ = routes.row(i)
        generated, last = (torch.zeros(len(traj.response_ids), dtype=torch.bool) for _ in range(2))
        for start, end in traj.turn_spans:
            generated[start:end - 1] = True
            last[end - 1] = True  # a turn's last token is fed by the next turn's prefill: the trainer routes it
        assert torch.equal(generated | last, batch.loss_mask.row(i) == 1)  # the response mask's tokens
        assert bool((rows_[generated] < EXPERTS).all()) and bool((rows_[~generated] == mark).all())
    # R3 in fp32: the trainer replays them, its own router choosing the same experts everywhere
    trainer, _ = engine_ranks.build(path, engine_ranks.actor_config("ddp", router_replay="R3"), 0, 1)
    logprobs = trainer.logprobs(batch)
    replay = replay_of(trainer.module)
    replay._commit()
    assert replay.compared == int((routes.values[:, 0, 0] != mark).sum()) * 2  # every routed token, both layers
    assert replay.metrics()["moe/route_match"] == 1.0
    sampled = batch.loss_mask.values == 1
    gap = (logprobs.values - batch.rollout_logprobs.values)[sampled].abs().max()
    assert gap < 1e-5
