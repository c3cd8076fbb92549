"""OpenEnv (`agent.environment=openenv:...`) against a real OpenEnv server process on 127.0.0.1:
tests/agents/openenv_sum_server.py, built with openenv-core's `create_app`, served by the uvicorn
process polyrl starts for a file, with the bundled builtin:tiny-arith model. One session per
trajectory, reset with the row's arguments, a step per turn, the environment's reward; an
observation without text, a step that never answers and a server that dies end only their own
trajectories, counted in agent/env_errors; bad targets are one line before Ray."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("openenv.core", reason="openenv-core is not installed (pip install 'polyrl[openenv]')")

from polyrl.agents import AgentConfig, run_trajectories_sync  # noqa: E402
from polyrl.agents.openenv_env import stop_servers  # noqa: E402
from polyrl.data import PromptSample  # noqa: E402
from polyrl.rollout.base import SamplingParams  # noqa: E402

SERVER = Path(__file__).parent / "openenv_sum_server.py"
ENV = f"openenv:{SERVER}"


@pytest.fixture(scope="module")
def arith():
    from polyrl.builtin import resolve
    from polyrl.rollout.native.engine import NativeEngine
    from polyrl.training.model_loading import load_tokenizer

    yield NativeEngine(resolve("builtin:tiny-arith")), load_tokenizer("builtin:tiny-arith")
    stop_servers()


def row(tokenizer, index, a, b, mode="ok"):
    messages = [{"role": "user", "content": f"{a}+{b}="}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return PromptSample(index, "arithmetic", tokenizer(prompt, add_special_tokens=False)["input_ids"], prompt,
                        messages, str(a + b), {"openenv_reset": {"a": a, "b": b, "mode": mode}})


def config(**kw):
    return AgentConfig(environment=ENV, max_turns=2, max_response_tokens=32, tool_timeout_s=3,
                       environment_kwargs={"timeout_s": 5}, **kw)


@pytest.mark.slow
def test_sessions_rewards_and_failures_end_only_their_trajectory(arith):
    engine, tokenizer = arith
    rows = [row(tokenizer, 0, 12, 34), row(tokenizer, 1, 5, 7), row(tokenizer, 2, 1, 1, "no_text"),
            row(tokenizer, 3, 2, 2, "hang")]
    out = run_trajectories_sync(engine, tokenizer, rows, SamplingParams(n=2, max_tokens=8, seed=0), config())
    by_row = [out.trajectories[i:i + 2] for i in range(0, 8, 2)]
    for traj in by_row[0] + by_row[1]:  # the healthy sessions: the server's verdict is the reward
        stats, answers = traj.stats, [m["content"] for m in traj.messages if m["role"] == "assistant"]
        assert stats.env_errors == 0 and 1 <= stats.turns <= 2
        right = answers[-1].strip() == traj.row.ground_truth
        assert stats.env_reward == float(right)
        assert stats.turns == 2 or right  # a wrong first answer is asked again, a right one ends it
        if stats.turns == 2:  # the re-asked question is a masked user turn between the answers
            assert traj.messages[1] == {"role": "user", "content": traj.row.raw_prompt[0]["content"]}
            (s1, e1), (s2, _) = traj.turn_spans
            assert traj.loss_mask[e1:s2] == [0.0] * (s2 - e1) and 1.0 in traj.loss_mask[s1:e1]
    assert [t.stats.turns for t in by_row[0]] == [1, 1]  # tiny-arith answers 12+34 right
    for traj in by_row[2]:  # a step observation without text: counted, the turn before it kept
        assert traj.stats.errors_by_kind == {"env_error": 1} and traj.stats.turns == 1
    for traj in by_row[3]:  # a step that never answers: the trajectory ends at agent.tool_timeout_s
        assert traj.stats.errors_by_kind == {"env_timeout": 1} and traj.stats.turns == 1
    metrics = out.metrics()
    assert metrics["agent/env_errors"] == 4.0 and metrics["agent/prefix_mismatch"] == 0.0


@pytest.mark.slow
def test_a_server_that_dies_ends_its_trajectory_and_is_started_again(arith):
    engine, tokenizer = arith
    sampling = SamplingParams(n=1, max_tokens=8, seed=0)
    died = run_trajectories_sync(engine, tokenizer, [row(tokenizer, 0, 3, 4, "die")], sampling, config())
    assert died.stats[0].errors_by_kind == {"env_error": 1} and died.stats[0].turns == 1
    again = run_trajectories_sync(engine, tokenizer, [row(tokenizer, 1, 12, 34)], sampling, config())
    assert again.stats[0].env_errors == 0 and again.stats[0].env_reward == 1.0


@pytest.mark.slow
def test_a_running_server_is_reached_by_its_url(arith):
    from polyrl.agents.openenv_env import LocalServer
    from polyrl.agents.preflight import check_environments

    engine, tokenizer = arith
    server = LocalServer(str(SERVER))
    try:
        cfg = AgentConfig(environment=f"openenv:{server.ensure()}", max_turns=2, max_response_tokens=32)
        check_environments(cfg)  # GET /health answers
        out = run_trajectories_sync(engine, tokenizer, [row(tokenizer, 0, 12, 34)],
                                    SamplingParams(n=1, max_tokens=8, seed=0), cfg)
        assert out.stats[0].env_errors == 0 and out.stats[0].env_reward == 1.0
    finally:
        server.stop()


def test_bad_targets_are_one_line_naming_the_key(tmp_path):
    from polyrl.agents.preflight import check_environments
    from polyrl.config import ConfigError

    cases = {"openenv:no_such_pkg.server": "not importable",
             f"openenv:{tmp_path / 'missing.py'}": "does not exist",
             "openenv:http://127.0.0.1:9": "is not reachable: GET http://127.0.0.1:9/health failed",
             "openenv:": "names no server"}
    for name, problem in cases.items():
        with pytest.raises(ConfigError) as err:
            check_environments(AgentConfig(environment=name))
        (line,) = err.value.problems
        assert line.startswith(f"agent.environment={name} ") and problem in line, line
    check_environments(AgentConfig(environment=ENV))  # a server file that exists passes


@pytest.mark.slow
def test_training_against_an_openenv_server(ray_session, tmp_path):
    """2 GRPO steps of builtin:tiny-arith; every rollout worker starts its own server process."""
    from polyrl.config import load_config
    from polyrl.job import JobConfig
    from polyrl.trainer.loop import Trainer

    data = tmp_path / "sums.jsonl"
    pairs = [(12, 34), (5, 7), (20, 3), (41, 8)]
    data.write_text("\n".join(json.dumps({
        "data_source": "arithmetic", "prompt": [{"role": "user", "content": f"{a}+{b}="}],
        "reward_model": {"ground_truth": str(a + b)}, "extra_info": {"openenv_reset": {"a": a, "b": b}}})
        for a, b in pairs))
    out = tmp_path / "out"
    cfg = load_config(JobConfig, overrides=[
        "model.path=builtin:tiny-arith", f"data.train_files=[{data}]", f"data.val_files=[{data}]",
        "data.train_batch_size=4", "rollout.n=2", "rollout.response_length=8", "actor.lr=1e-6",
        f"agent.environment={ENV}", "agent.max_turns=2", "agent.max_response_tokens=32",
        "trainer.total_steps=2", "trainer.val_every=2", "trainer.val_before_train=false",
        "trainer.progress_bar=false", "trainer.save_at_end=false", "actor.num_cpus_per_worker=1",
        f"trainer.output_dir={out}", "logging.plot_at_end=false"])
    Trainer(cfg).fit()
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0 and "agent/turns_mean" in r and "actor/grad_norm" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["agent/env_errors"] == 0 and r["agent/prefix_mismatch"] == 0
        assert 1.0 <= r["agent/turns_mean"] <= 2.0
        assert r["agent/env_reward_mean"] == r["reward/score_mean"]  # the environment's reward is the reward
