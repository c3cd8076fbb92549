"""A user environment that fails anywhere - its constructor, `reset`, `step`, `close`, or what
they return - ends its own trajectory and is counted in agent/env_errors by kind; the rollout and
the other trajectories of the batch go on (real native engine, random checkpoint)."""

from __future__ import annotations

import math
import threading

import pytest

from conftest import native
from polyrl.agents import ENVIRONMENTS, AgentConfig, Environment, StepResult, run_trajectories_sync
from test_environments import rows, sampling
from test_tool_rollouts import assert_exact

RELEASE = threading.Event()
"""Hanging environments block on it; set when each test ends."""


class _Steps(Environment):
    def reset(self, row):
        return None

    def step(self, action_text):
        return "go on", 0.0, False


@ENVIRONMENTS.register("fail_init")
class FailInit(_Steps):
    def __init__(self):
        raise RuntimeError("cannot open the sandbox")


@ENVIRONMENTS.register("hang_init")
class HangInit(_Steps):
    def __init__(self):
        RELEASE.wait()


@ENVIRONMENTS.register("hang_step")
class HangStep(_Steps):
    def step(self, action_text):
        RELEASE.wait()


@ENVIRONMENTS.register("fail_reset")
class FailReset(_Steps):
    def reset(self, row):
        raise KeyError("no such task")


@ENVIRONMENTS.register("hang_reset")
class HangReset(_Steps):
    def reset(self, row):
        RELEASE.wait()


@ENVIRONMENTS.register("reset_no_content")
class ResetNoContent(_Steps):
    def reset(self, row):
        return {"role": "user"}


@ENVIRONMENTS.register("fail_close")
class FailClose(_Steps):
    def close(self):
        raise OSError("already closed")


@ENVIRONMENTS.register("hang_close")
class HangClose(_Steps):
    def close(self):
        RELEASE.wait()


@ENVIRONMENTS.register("step_bad_observation")
class StepBadObservation(_Steps):
    def step(self, action_text):
        return StepResult(observation=42)


@ENVIRONMENTS.register("step_bad_reward")
class StepBadReward(_Steps):
    def step(self, action_text):
        return StepResult("go on", reward="high")


@ENVIRONMENTS.register("step_nan_reward")
class StepNanReward(_Steps):
    def step(self, action_text):
        return "go on", math.nan, False


@ENVIRONMENTS.register("step_exit")
class StepExit(_Steps):
    def step(self, action_text):
        raise SystemExit(3)


@pytest.fixture(autouse=True)
def release_hangs():
    RELEASE.clear()
    yield
    RELEASE.set()


# name -> (kind counted, whether the trajectory got its first turn)
CASES = {
    "fail_init": ("env_error", False),
    "hang_init": ("env_timeout", False),
    "hang_step": ("env_timeout", True),
    "fail_reset": ("env_error", False),
    "hang_reset": ("env_timeout", False),
    "reset_no_content": ("env_bad_output", False),
    "fail_close": ("env_error", True),
    "hang_close": ("env_timeout", True),
    "step_bad_observation": ("env_bad_output", True),
    "step_bad_reward": ("env_bad_output", True),
    "step_nan_reward": ("env_bad_output", True),
    "step_exit": ("env_error", True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_failing_environment_ends_only_its_trajectory(tokenizer, random_dir, name):
    kind, stepped = CASES[name]
    engine = native(random_dir, tokenizer)
    cfg = AgentConfig(max_turns=3, max_response_tokens=64, tool_timeout_s=0.05)
    rollout = run_trajectories_sync(engine, tokenizer, rows(tokenizer, [name, "test_countdown"]),
                                    sampling(tokenizer), cfg, seeds=[0, 0])
    assert_exact(engine, rollout)
    failed, healthy = rollout.trajectories
    assert failed.stats.errors_by_kind == {kind: 1} and failed.stats.env_errors == 1
    assert rollout.metrics()["agent/env_errors"] == 1.0
    assert healthy.stats.env_errors == 0 and healthy.stats.turns >= 1
    if stepped:  # (seeded) its first turn ended on a stop token, so the environment stepped
        assert failed.stats.turns >= 1 and failed.stop_reason == "stop"
    else:  # it never started: no turn, nothing to train on
        assert failed.stats.turns == 0 and failed.response_ids == []
        assert failed.prompt_ids == rows(tokenizer, [name])[0].prompt_ids


def test_a_stepped_failure_keeps_the_turns_before_it(tokenizer, random_dir):
    """The first step fails: the trajectory is the first turn, trained on as sampled, reward 0."""
    engine = native(random_dir, tokenizer)
    rollout = run_trajectories_sync(engine, tokenizer, rows(tokenizer, ["step_bad_reward"]), sampling(tokenizer),
                                    AgentConfig(max_turns=3), seeds=[0])
    traj = rollout.trajectories[0]
    assert traj.stop_reason == "stop"  # (seeded) the turn ended on a stop token, so the step ran
    assert traj.stats.turns == 1 and traj.stats.turn_rewards == [0.0] and traj.stats.env_errors == 1
    assert rollout.batch.loss_mask.row(0).tolist() == [1.0] * len(traj.response_ids)


@ENVIRONMENTS.register("reset_too_long")
class ResetTooLong(_Steps):
    def reset(self, row):
        return "many words " * 2000  # past the engine's max_model_len of 512


@ENVIRONMENTS.register("step_observation_role")
class StepObservationRole(_Steps):
    def step(self, action_text):
        return {"role": "observation", "content": "the template below refuses this role"}, 0.0, False


def test_a_reset_prompt_longer_than_the_context_is_counted(tokenizer, random_dir):
    rollout = run_trajectories_sync(native(random_dir, tokenizer), tokenizer, rows(tokenizer, ["reset_too_long"]),
                                    sampling(tokenizer), AgentConfig(), seeds=[0])
    traj = rollout.trajectories[0]
    assert traj.stats.errors_by_kind == {"env_bad_output": 1} and traj.stats.turns == 0


def test_an_observation_the_template_refuses_is_counted(tokenizer, random_dir):
    import copy

    from agent_models import TEMPLATE

    tokenizer = copy.deepcopy(tokenizer)  # the session's tokenizer keeps its template
    tokenizer.chat_template = ("{%- for m in messages %}{%- if m.role == 'observation' %}"
                               "{{ raise_exception('unknown role observation') }}{%- endif %}{%- endfor %}" + TEMPLATE)
    engine = native(random_dir, tokenizer)
    rollout = run_trajectories_sync(engine, tokenizer, rows(tokenizer, ["step_observation_role"]),
                                    sampling(tokenizer), AgentConfig(), seeds=[0])
    traj = rollout.trajectories[0]
    assert traj.stop_reason == "stop" and traj.stats.turns == 1
    assert traj.stats.errors_by_kind == {"env_bad_output": 1} and traj.stats.env_errors == 1
    assert_exact(engine, rollout)


def test_rewards_may_be_numpy_scalars_or_0d_tensors():
    import numpy as np
    import torch

    from polyrl.agents.environments import as_step_result

    assert as_step_result(("o", np.float32(0.5), np.bool_(True))) == StepResult("o", 0.5, True)
    assert as_step_result(StepResult("o", torch.tensor(2.0))).reward == 2.0
    for bad in ("1.0", torch.tensor([1.0, 2.0]), math.inf, [1.0]):
        with pytest.raises((TypeError, ValueError)):
            as_step_result(("o", bad, False))
