"""Environments on the real native engine with a random checkpoint: whatever ids the model
samples, the trained ids are the sampled ids across turns (byte-level and SentencePiece-style
tokenizers), observations are masked, rewards and errors are counted, and each row picks its
environment by its agent_name."""

from __future__ import annotations

import asyncio
import math

import pytest

from conftest import native
from polyrl.agents import ENVIRONMENTS, AgentConfig, Environment, StepResult, run_trajectories_sync
from polyrl.agents.chat import ChatDelta
from polyrl.data import PromptSample
from polyrl.rollout.base import SamplingParams
from test_tool_rollouts import assert_exact


@ENVIRONMENTS.register("test_countdown")
class Countdown(Environment):
    """Three observations, then done; reward 0.5 per step."""

    def reset(self, row):
        self.k = 0
        return [{"role": "system", "content": "count"}, {"role": "user", "content": f"start at {row.index}"}]

    def step(self, action_text):
        self.k += 1
        return f"step {self.k}: {len(action_text)} chars", 0.5, self.k >= 3


@ENVIRONMENTS.register("test_raiser")
class Raiser(Environment):
    def step(self, action_text):
        raise RuntimeError("environment bug")


def rows(tokenizer, agents):
    ids = ChatDelta(tokenizer).prompt_ids([{"role": "user", "content": "hello"}])
    return [PromptSample(i, "x", ids, "", [{"role": "user", "content": "hello"}], "",
                         {"agent_name": a} if a else {}) for i, a in enumerate(agents)]


def sampling(tokenizer, **kw):
    # a quarter of the vocabulary ends a turn, so random turns are short and end with "stop"
    # on a token that is not the template's <|im_end|> (the closing is then appended, masked)
    stops = [i for i in range(len(tokenizer)) if i % 4 == 3]
    return SamplingParams(temperature=1.0, max_tokens=12, stop_token_ids=stops, **kw)


def test_random_ids_stay_exact_across_environment_turns(tokenizer, random_dir):
    engine = native(random_dir, tokenizer)
    cfg = AgentConfig(max_turns=5, max_response_tokens=200)
    rollout = run_trajectories_sync(engine, tokenizer, rows(tokenizer, ["test_countdown"] * 3),
                                    sampling(tokenizer, n=2), cfg, seeds=[1, 2, 3])
    assert_exact(engine, rollout)
    batch = rollout.batch
    assert batch.group.tolist() == [0, 0, 1, 1, 2, 2]
    multi = [t for t in rollout.trajectories if t.stats.turns > 1]
    assert multi, "no trajectory reached a second turn"
    for traj in multi:
        assert traj.messages[1] == {"role": "user", "content": f"step 1: {len(traj.messages[0]['content'])} chars"}
        # the prompt came from reset(): its messages through the template
        assert tokenizer.decode(traj.prompt_ids).endswith(f"start at {traj.row.index}<|im_end|>\n<|im_start|>assistant\n")
    done = [t for t in rollout.trajectories if t.stats.turns == 3 and t.stats.limit is None]
    for traj in done:
        assert traj.stats.env_reward == 1.5
    rewards = rollout.env_rewards.tolist()
    assert rewards == [t.stats.env_reward for t in rollout.trajectories]
    # same seeds, same trajectories
    again = run_trajectories_sync(native(random_dir, tokenizer), tokenizer, rows(tokenizer, ["test_countdown"] * 3),
                                  sampling(tokenizer, n=2), cfg, seeds=[1, 2, 3])
    assert again.batch.response_ids.tolist() == batch.response_ids.tolist()


def test_each_row_picks_its_environment(tokenizer, random_dir):
    engine = native(random_dir, tokenizer)
    cfg = AgentConfig(max_turns=3)
    rollout = run_trajectories_sync(engine, tokenizer, rows(tokenizer, ["test_raiser", None, "test_countdown"]),
                                    sampling(tokenizer), cfg, seeds=[0, 0, 0])
    assert_exact(engine, rollout)
    raiser, single, countdown = rollout.trajectories
    assert (raiser.stats.environment, single.stats.environment, countdown.stats.environment) == \
        ("test_raiser", None, "test_countdown")
    assert raiser.stop_reason == "stop"  # (seeded) so the environment stepped, raised, and ended it
    assert raiser.stats.env_errors == 1 and raiser.stats.turns == 1 and raiser.stats.limit is None
    assert single.stats.turns == 1 and rollout.batch.loss_mask.row(1).tolist() == [1.0] * len(single.response_ids)
    assert math.isnan(rollout.env_rewards[1]) and rollout.metrics()["agent/env_errors"] == raiser.stats.env_errors


def test_unknown_environment_names_the_choices(tokenizer, random_dir):
    with pytest.raises(KeyError, match="test_countdown"):
        run_trajectories_sync(native(random_dir, tokenizer), tokenizer, rows(tokenizer, ["nope"]),
                              sampling(tokenizer), AgentConfig())


def test_sync_wrapper_inside_a_running_loop(tokenizer, random_dir):
    async def caller():
        return run_trajectories_sync(native(random_dir, tokenizer), tokenizer, rows(tokenizer, ["test_countdown"]),
                                     sampling(tokenizer), AgentConfig(max_turns=2), seeds=[5])

    rollout = asyncio.run(caller())
    assert len(rollout.batch) == 1 and rollout.trajectories[0].stats.turns >= 1


def test_observation_step_result_and_tuple_forms():
    from polyrl.agents.environments import as_messages, as_step_result

    assert as_messages("hi") == [{"role": "user", "content": "hi"}]
    assert as_messages({"role": "tool", "content": "1"}) == [{"role": "tool", "content": "1"}]
    assert as_step_result(("o", 1, True)) == StepResult("o", 1.0, True)
    with pytest.raises(TypeError):
        as_messages(3)
