"""Named reward terms from a black-box agent (what the verifiers integration returns: each rubric
function's weighted score): their sum is the reward, each is logged as reward/<name>, and they
survive the batch's select / cat (async streams split and join batches) with NaN where a
trajectory has none."""

from __future__ import annotations

import math

import openai
import pytest
import torch

from polyrl.agents import AgentConfig, run_trajectories_sync
from polyrl.batch import AgentColumns
from polyrl.data import PromptSample
from polyrl.rollout.base import SamplingParams

TERMS = {"correct": 1.0, "brief": 0.5}


def solve(base_url, row, trajectory_id):
    with openai.OpenAI(base_url=base_url, api_key="unused") as llm:
        llm.chat.completions.create(model="policy", messages=row.raw_prompt, max_tokens=4)
    return TERMS if row.index == 0 else {"correct": float("nan")}


@pytest.mark.slow  # a native engine and its OpenAI server
def test_terms_are_summed_logged_and_a_bad_one_is_the_agents_error():
    from polyrl.builtin import resolve
    from polyrl.rollout.native.engine import NativeEngine
    from polyrl.training.model_loading import load_tokenizer

    engine, tokenizer = NativeEngine(resolve("builtin:tiny-arith")), load_tokenizer("builtin:tiny-arith")
    rows = []
    for i in range(2):
        messages = [{"role": "user", "content": "1+2="}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        rows.append(PromptSample(i, "arithmetic", tokenizer(prompt, add_special_tokens=False)["input_ids"], prompt,
                                 messages, "3", {}))
    cfg = AgentConfig(black_box=f"{__name__}:solve", max_turns=1, max_response_tokens=8)
    out = run_trajectories_sync(engine, tokenizer, rows, SamplingParams(n=1, max_tokens=4, seed=0), cfg)
    good, bad = out.stats
    assert good.reward_terms == TERMS and good.reward == 1.5 and good.env_errors == 0
    assert bad.reward_terms == {} and bad.errors_by_kind == {"black_box": 1}  # NaN: the agent's error
    assert out.metrics()["reward/correct"] == 1.0 and out.metrics()["reward/brief"] == 0.5
    terms = out.reward_terms
    assert terms["brief"][0] == 0.5 and math.isnan(terms["brief"][1])


def columns(n, terms):
    zeros = torch.zeros(n, dtype=torch.long)
    return AgentColumns(turns=zeros, tool_calls=zeros, tool_errors=zeros, tool_timeouts=zeros,
                        tool_seconds=torch.zeros(n), env_errors=zeros, limit=zeros,
                        env_rewards=torch.zeros(n), prefix_mismatch=zeros, reward_terms=terms)


def test_terms_survive_select_and_cat():
    a = columns(2, {"correct": torch.tensor([1.0, 0.0])})
    b = columns(1, {"judge": torch.tensor([0.25])})
    both = AgentColumns.cat([a, b])
    assert both.reward_terms["correct"][:2].tolist() == [1.0, 0.0] and math.isnan(both.reward_terms["correct"][2])
    assert math.isnan(both.reward_terms["judge"][0]) and both.reward_terms["judge"][2] == 0.25
    assert both.metrics()["reward/correct"] == 0.5 and both.metrics()["reward/judge"] == 0.25
    picked = both.select(torch.tensor([2, 0]))
    assert picked.reward_terms["judge"][0] == 0.25 and picked.reward_terms["correct"][1] == 1.0
    assert "reward/correct" not in columns(1, {"correct": torch.tensor([math.nan])}).metrics()
    assert columns(2, {}).select(torch.tensor([1])).reward_terms == {}


@pytest.mark.parametrize("result", [{"x": "1"}, {"x": True}, {1: 1.0}, {"x": math.inf}])
def test_malformed_terms_are_named(result):
    from polyrl.agents.black_box import BlackBoxRunner
    from polyrl.agents.stats import Trajectory, TrajectoryStats

    traj = Trajectory(prompt_ids=[1], group=0, stats=TrajectoryStats(environment="black_box"))
    error = BlackBoxRunner._apply_result(traj, result)
    assert error.startswith("returned the reward terms") and traj.stats.reward is None
