"""verifiers environments (`agent.environment=verifiers:TASKSET`) with the real library (0.4, its
`verifiers.v1` API): a single-turn taskset and a multi-turn environment (a scripted user asks
again after a wrong answer), both written here, played by verifiers' own `null` chat harness
against polyrl's trajectory endpoint over the bundled builtin:tiny-arith model. The trajectories
are token-exact (each turn's sampled ids, what the next prompt adds masked), the reward is the
rubric's weighted sum with each function logged as reward/<name>, and two GRPO steps train
through Ray.

verifiers 0.4 pins openai<3 and mcp==2.0.0, which the CPU lock excludes (pyproject.toml), so
these tests run where `pip install 'polyrl[verifiers]'` was done (a separate environment: CI's
verifiers tier, scripts/verifiers_tier.sh) and skip elsewhere. Its harness program is a PEP 723 script verifiers prepares with `uv` on first use."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

pytest.importorskip("verifiers.v1", reason="verifiers is not installed (pip install 'polyrl[verifiers]')")

from polyrl.agents import AgentConfig, run_trajectories_sync  # noqa: E402
from polyrl.data import PromptSample  # noqa: E402
from polyrl.rollout.base import SamplingParams  # noqa: E402

COMMON = '''
import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: str = ""


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, task, trace) -> float:
        return float(trace.last_reply.strip() == task.answer)

    @vf.reward(weight=0.5)
    async def brief(self, trace) -> float:
        return float(len(trace.last_reply.strip()) <= 3)


class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self):
        for a, b in [(12, 34), (987, 654)]:
            yield SumTask(SumData(prompt=f"{a}+{b}=", answer=str(a + b)), self.config.task)
'''
SINGLE = COMMON + '\n__all__ = ["SumTaskset"]\n'
MULTI = COMMON + '''

class RetryConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()


class RetryEnv(vf.Env[RetryConfig]):
    """Two turns when the first answer is wrong: the user asks again."""

    async def run(self, task, agents):
        async with agents.agent.interaction(task) as chat:
            reply = await chat.turn()
            if not reply.terminated and reply.last_reply != task.data.answer:
                await chat.turn("Wrong. " + task.data.prompt)


__all__ = ["SumTaskset", "RetryEnv"]
'''
# verifiers' own chat loop, on this machine (its default runtime is a remote sandbox)
HARNESS = {"agent": {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}}


def weighted(text: str, answer: str) -> float:
    return float(text.strip() == answer) + 0.5 * float(len(text.strip()) <= 3)


@pytest.fixture(scope="module")
def tasksets(tmp_path_factory):
    root = tmp_path_factory.mktemp("vf_tasksets")
    for name, source in (("vf_sum_single", SINGLE), ("vf_sum_retry", MULTI)):
        (root / name).mkdir()
        (root / name / "__init__.py").write_text(textwrap.dedent(source))
    sys.path.insert(0, str(root))
    yield root
    sys.path.remove(str(root))


@pytest.fixture(scope="module")
def arith():
    from polyrl.builtin import resolve
    from polyrl.rollout.native.engine import NativeEngine
    from polyrl.training.model_loading import load_tokenizer

    return NativeEngine(resolve("builtin:tiny-arith")), load_tokenizer("builtin:tiny-arith")


def rows(tmp_path, name, tokenizer):
    from polyrl.agents.verifiers_env import write_rows

    path = tmp_path / f"{name}.jsonl"
    assert write_rows(name, HARNESS, path, data_source="arithmetic") == 2
    out = []
    for i, line in enumerate(path.read_text().splitlines()):
        row = json.loads(line)
        prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        out.append(PromptSample(i, row["data_source"], tokenizer(prompt, add_special_tokens=False)["input_ids"],
                                prompt, row["prompt"], row["reward_model"]["ground_truth"], row["extra_info"]))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["vf_sum_single", "vf_sum_retry"])
def test_an_environment_is_token_exact_and_scored_by_its_rubric(tasksets, arith, tmp_path, name):
    engine, tokenizer = arith
    data = rows(tmp_path, name, tokenizer)
    assert [r.raw_prompt for r in data] == [[{"role": "user", "content": "12+34="}],
                                            [{"role": "user", "content": "987+654="}]]
    cfg = AgentConfig(environment=f"verifiers:{name}", environment_kwargs=HARNESS, max_turns=2,
                      max_response_tokens=48)
    assert cfg.black_box == f"verifiers:{name}" and cfg.environment is None
    out = run_trajectories_sync(engine, tokenizer, data, SamplingParams(n=2, max_tokens=8, seed=0), cfg)
    assert out.metrics()["agent/env_errors"] == 0 and out.metrics()["agent/prefix_mismatch"] == 0
    metrics = out.metrics()
    assert metrics["reward/correct"] + metrics["reward/brief"] == pytest.approx(metrics["agent/env_reward_mean"])
    turns = []
    for traj in out.trajectories:
        answers = [m["content"] for m in traj.messages if m["role"] == "assistant"]
        text, truth = answers[-1].strip(), traj.row.ground_truth
        assert traj.stats.reward_terms == {"correct": float(text == truth), "brief": 0.5 * float(len(text) <= 3)}
        assert traj.stats.reward == weighted(answers[-1], truth)  # the rubric's weighted sum
        mask = [0.0] * len(traj.response_ids)
        for start, end in traj.turn_spans:  # sampled ids train, everything between them is masked
            mask[start:end] = [1.0] * (end - start)
        assert traj.loss_mask == mask and traj.prompt_ids == traj.row.prompt_ids
        turns.append(traj.stats.turns)
        if traj.stats.turns == 2:
            assert answers[0].strip() != traj.row.ground_truth
            assert {"role": "user", "content": "Wrong. " + traj.row.raw_prompt[0]["content"]} in traj.messages
    if name == "vf_sum_single":
        assert turns == [1, 1, 1, 1]
    else:  # tiny-arith answers 12+34 but not 987+654: asked again
        assert turns[:2] == [1, 1] and turns[2:] == [2, 2]


def test_a_bad_environment_is_one_line_before_ray(tasksets):
    from polyrl.agents.preflight import check_agent
    from polyrl.config import ConfigError

    for name, problem in (("no_such_taskset", "cannot be loaded: ModuleNotFoundError: taskset 'no_such_taskset'"),
                          ("", "names no taskset")):
        with pytest.raises(ConfigError) as err:
            check_agent(AgentConfig(environment=f"verifiers:{name}", environment_kwargs=HARNESS))
        (line,) = err.value.problems
        assert line.startswith(f"agent.environment=verifiers:{name} ") and problem in line, line
    check_agent(AgentConfig(environment="verifiers:vf_sum_single", environment_kwargs=HARNESS))


@pytest.mark.slow
def test_training_on_a_verifiers_environment(ray_session, tasksets, tmp_path, monkeypatch):
    """2 GRPO steps of builtin:tiny-arith; the rollout workers import the taskset via PYTHONPATH."""
    from polyrl.agents.verifiers_env import write_rows
    from polyrl.config import load_config
    from polyrl.job import JobConfig
    from polyrl.trainer.loop import Trainer

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tasksets), os.environ.get("PYTHONPATH", "")]))
    data = tmp_path / "rows.jsonl"
    write_rows("vf_sum_single", HARNESS, data, data_source="arithmetic")
    out = tmp_path / "out"
    cfg = load_config(JobConfig, overrides=[
        "model.path=builtin:tiny-arith", f"data.train_files=[{data}]", f"data.val_files=[{data}]",
        "data.train_batch_size=2", "rollout.n=2", "rollout.response_length=8", "actor.lr=1e-6",
        "agent.environment=verifiers:vf_sum_single", f"agent.environment_kwargs={json.dumps(HARNESS)}",
        "agent.max_turns=2", "agent.max_response_tokens=48",
        "trainer.total_steps=2", "trainer.val_every=2", "trainer.val_before_train=false",
        "trainer.progress_bar=false", "trainer.save_at_end=false", "actor.num_cpus_per_worker=1",
        f"trainer.output_dir={out}", "logging.plot_at_end=false"])
    Trainer(cfg).fit()
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in metrics if r["step"] > 0 and "agent/turns_mean" in r and "actor/grad_norm" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["agent/env_errors"] == 0 and r["agent/prefix_mismatch"] == 0 and r["agent/turns_mean"] == 1.0
        assert r["agent/env_reward_mean"] == r["reward/score_mean"]  # the rubric's reward is the reward
        assert r["reward/correct"] + r["reward/brief"] == pytest.approx(r["reward/score_mean"])  # its terms
