"""The bundled calculator recipe: configs/tools_calculator.yaml runs as written on the bundled
tool-calling model (builtin:tiny-calc), whose warm start calls the tool sometimes and copies
its result, so RL has a direction to push (docs/tools_calculator.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polyrl.config import load_config
from polyrl.job import JobConfig

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "tools_calculator.yaml"


def job(*overrides: str) -> JobConfig:
    return load_config(JobConfig, files=[CONFIG], overrides=list(overrides))


@pytest.fixture(scope="module")
def tokenizer():
    from polyrl.training.model_loading import load_tokenizer

    return load_tokenizer(job().model.path)


def _rows(tokenizer, split: str, n: int | None = None):
    from polyrl.builtin import resolve
    from polyrl.data import read_rows
    from polyrl.data.dataset import PromptSample

    out = []
    for i, r in enumerate(read_rows(resolve(f"builtin:calculator_{split}"))[:n]):
        text = tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
        out.append(PromptSample(i, r["data_source"], tokenizer(text, add_special_tokens=False)["input_ids"], text,
                                r["prompt"], r["reward_model"]["ground_truth"], r["extra_info"]))
    return out


def test_config_fits_the_bundled_model_and_data(tokenizer):
    from polyrl.agents.calculator import trace
    from polyrl.agents.chat import ChatDelta
    from polyrl.builtin import resolve

    cfg = job()
    assert cfg.agent.enabled and cfg.agent.default_environment == "tools"
    assert Path(resolve(cfg.model.path), "model.safetensors").is_file()
    assert all(Path(resolve(f)).is_file() for f in cfg.data.train_files + cfg.data.val_files)
    assert max(len(r.prompt_ids) for r in _rows(tokenizer, "train") + _rows(tokenizer, "val")) <= \
        cfg.data.max_prompt_length
    # the longest trajectory (largest operands and product) fits every limit of the config
    call, result, answer = (m["content"] for m in trace(9999, 9999)["messages"][1:])
    call_ids = tokenizer(call, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    delta = ChatDelta(tokenizer).delta_ids([{"role": "tool", "content": result}], tokenizer.eos_token_id)
    assert max(len(call_ids), len(answer_ids)) <= cfg.rollout.response_length
    assert len(call_ids) + len(delta) + len(answer_ids) <= cfg.agent.max_response_tokens
    assert cfg.data.max_prompt_length + cfg.agent.max_response_tokens <= 256  # the model's positions
    assert not job("agent.tools=[]").agent.enabled  # the no-tools comparison is single-turn


def test_warm_start_calls_sometimes_and_copies_the_result(tokenizer):
    """Sampled at T=1 like training: some trajectories call the calculator and then answer with its
    result, most answer from memory (wrong) - the starting point GRPO improves from."""
    from polyrl.agents import AgentConfig, run_trajectories_sync
    from polyrl.builtin import resolve
    from polyrl.rewards.arithmetic import arithmetic_score
    from polyrl.rollout.base import SamplingParams
    from polyrl.rollout.native.engine import NativeEngine

    cfg = job()
    rows = _rows(tokenizer, "val", 48)
    agent = AgentConfig(**cfg.agent.model_dump())
    sampling = SamplingParams(n=1, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=cfg.rollout.response_length)
    out = run_trajectories_sync(NativeEngine(resolve(cfg.model.path)), tokenizer, rows, sampling, agent,
                                seeds=list(range(len(rows))))
    called = [s.tool_calls > 0 for s in out.stats]
    right = [arithmetic_score(t, r.ground_truth, finished_with_eos=bool(e))
             for t, r, e in zip(out.batch.texts, rows, out.batch.finished_with_eos.tolist())]
    assert 0.05 <= sum(called) / len(rows) <= 0.6, sum(called)
    assert sum(r for r, c in zip(right, called) if c) >= 0.7 * sum(called)  # the result is copied
    assert not any(r for r, c in zip(right, called) if not c)  # it cannot multiply alone
    assert sum(right) / len(rows) < 0.5


@pytest.mark.slow
def test_one_step_of_the_recipe(ray_session, tmp_path):
    """configs/tools_calculator.yaml as written (one step, a few prompts): multi-turn rollouts with
    tool calls reach the trainer, and tool tokens are masked out of the loss."""
    from polyrl.trainer.loop import Trainer

    cfg = job("trainer.total_steps=1", "data.val_files=[]", "data.train_batch_size=4",
              "trainer.progress_bar=false", "logging.plot_at_end=false", f"trainer.output_dir={tmp_path}")
    summary = Trainer(cfg).fit()
    assert summary["steps"] == 1
    step = {}
    for line in (tmp_path / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["step"] == 1:
            step.update(record)
    assert step["agent/turns_mean"] >= 1.0 and "agent/tool_calls_mean" in step
    # the tool's tokens (and only they) are in the responses with loss_mask 0
    assert (step["agent/tool_calls_mean"] > 0) == (step["response/masked_token_frac"] > 0)
    assert 0.0 <= step["actor/grad_norm"] < float("inf")
