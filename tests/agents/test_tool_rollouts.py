"""Tool-calling trajectories on the real native engine, with a byte-level and a SentencePiece-style
tokenizer: sampled ids == trained ids across turns, tool turns masked, malformed calls, raising,
unknown and hanging tools as counted error messages, and every limit counted when it ends a
trajectory. The checkpoint is a hand-set script (tests/agents/agent_models.py): it calls `add`,
then answers once a tool result is in its context."""

from __future__ import annotations

import threading

import pytest
import torch

from conftest import ANSWER, BAD_CALL, CALL, USER, native
from polyrl.agents import AgentConfig, Tool, run_trajectories_sync
from polyrl.data import PromptSample
from polyrl.rollout.base import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, n=1)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first summand.
        b: the second summand.
    """
    return a + b


def rows(tokenizer, count=1):
    from polyrl.agents.chat import ChatDelta

    ids = ChatDelta(tokenizer).prompt_ids(USER)
    return [PromptSample(i, "arithmetic", ids, "", USER, "5", {}) for i in range(count)]


def run(engine, tokenizer, tools, count=1, **cfg):
    cfg = AgentConfig(**{"environment": "tools", **cfg})
    return run_trajectories_sync(engine, tokenizer, rows(tokenizer, count), GREEDY, cfg,
                                 tools={t.name: t for t in tools})


def assert_exact(engine, rollout):
    """Every assistant turn's ids are what the engine sampled from exactly the ids before them;
    every other response id is masked; log-probs travel with the sampled ids."""
    batch = rollout.batch
    served = {(tuple(p), tuple(o.token_ids)): o for p, o in engine.calls}
    assert len(engine.calls) == sum(t.stats.turns for t in rollout.trajectories)
    for i, traj in enumerate(rollout.trajectories):
        response, mask = batch.response_ids.row(i).tolist(), batch.loss_mask.row(i).tolist()
        assert batch.prompt_ids.row(i).tolist() == traj.prompt_ids
        sampled = [0.0] * len(response)
        for start, end in traj.turn_spans:
            out = served[(tuple(traj.prompt_ids + response[:start]), tuple(response[start:end]))]
            assert batch.rollout_logprobs.row(i)[start:end].tolist() == pytest.approx(out.logprobs)
            sampled[start:end] = [1.0] * (end - start)
        assert mask == sampled


def test_a_tool_turn_is_token_exact_and_masked(tokenizer, scripted_dirs):
    engine = native(scripted_dirs[CALL], tokenizer)
    rollout = run(engine, tokenizer, [Tool.from_function(add)], count=2)
    assert_exact(engine, rollout)
    batch, traj = rollout.batch, rollout.trajectories[0]
    assert [m["role"] for m in traj.messages] == ["assistant", "tool", "assistant"]
    assert traj.messages[1]["content"] == "5" and batch.texts == [ANSWER, ANSWER]
    assert batch.finished_with_eos.tolist() == [True, True]
    # the whole trajectory is what the template renders for the conversation, token for token
    # (the script's pieces are single added tokens, so this re-encode is canonical)
    schema = [Tool.from_function(add).schema]
    convo = USER + [{"role": "assistant", "content": CALL}, {"role": "tool", "content": "5"},
                    {"role": "assistant", "content": ANSWER}]
    text = tokenizer.apply_chat_template(convo, tools=schema, tokenize=False)
    rendered = tokenizer(text, add_special_tokens=False)["input_ids"]
    full = batch.prompt_ids.row(0).tolist() + batch.response_ids.row(0).tolist()
    assert full == rendered[: len(full)] and tokenizer.decode(rendered[len(full):]) == "\n"
    # masked tokens are the tool turn; sampled ones the call + EOS and the answer + EOS
    mask = batch.loss_mask.row(0)
    assert int(mask.sum()) == 4 and 0 < (1 - mask.mean()).item() < 1
    m = rollout.metrics()
    assert (m["agent/turns_mean"], m["agent/tool_calls_mean"], m["agent/tool_errors"]) == (2.0, 1.0, 0.0)


def test_a_malformed_call_becomes_an_error_message(tokenizer, scripted_dirs):
    engine = native(scripted_dirs[BAD_CALL], tokenizer)
    rollout = run(engine, tokenizer, [Tool.from_function(add)])
    assert_exact(engine, rollout)
    traj = rollout.trajectories[0]
    assert traj.messages[1]["content"].startswith("Error: tool call is not valid JSON")
    assert traj.stats.errors_by_kind == {"malformed": 1} and rollout.metrics()["agent/tool_errors"] == 1.0
    assert rollout.batch.texts == [ANSWER]  # the model read the error and went on


def _raises(a: int, b: int) -> int:
    """Always fails.

    Args:
        a: unused.
        b: unused.
    """
    raise ZeroDivisionError("no")


@pytest.mark.parametrize("tool, kind, says", [
    (Tool.from_function(_raises, name="add"), "raised", "Error: add raised ZeroDivisionError: no"),
    (Tool.from_function(add, name="sum"), "unknown_tool", "Error: unknown tool 'add'; available tools: sum"),
    # a tool taking no arguments: the model's a and b are unknown to it
    (Tool.from_function(lambda: 0, name="add"), "bad_arguments", "Error: add: unknown argument(s) a, b; add takes none"),
])
def test_failing_tools_are_counted_error_messages(tokenizer, scripted_dirs, tool, kind, says):
    rollout = run(native(scripted_dirs[CALL], tokenizer), tokenizer, [tool])
    traj = rollout.trajectories[0]
    assert traj.messages[1]["content"] == says
    assert traj.stats.errors_by_kind == {kind: 1} and traj.stats.tool_errors == 1
    assert rollout.batch.texts == [ANSWER]


@pytest.fixture
def release():
    """Frees tools that block on it at teardown (no thread is left waiting)."""
    event = threading.Event()
    yield event
    event.set()


def test_a_hanging_tool_times_out_as_an_error(tokenizer, scripted_dirs, release):
    def add(a: int, b: int) -> int:  # noqa: F811 - the model calls "add"
        """Blocks until the test ends."""
        release.wait()
        return a + b

    rollout = run(native(scripted_dirs[CALL], tokenizer), tokenizer, [Tool.from_function(add)],
                  tool_timeout_s=0.05)
    traj = rollout.trajectories[0]
    assert traj.messages[1]["content"] == "Error: add did not finish within 0.05 s"
    assert traj.stats.tool_timeouts == 1 and rollout.metrics()["agent/tool_timeouts"] == 1.0
    assert traj.stats.tool_seconds > 0 and rollout.batch.texts == [ANSWER]


def test_tool_time_budget_ends_the_trajectory(tokenizer, scripted_dirs, release):
    def add(a: int, b: int) -> int:  # noqa: F811
        """Blocks until the test ends."""
        release.wait()
        return a + b

    rollout = run(native(scripted_dirs[CALL], tokenizer), tokenizer, [Tool.from_function(add)],
                  tool_timeout_s=10.0, max_tool_seconds=0.05)
    traj = rollout.trajectories[0]
    assert traj.stats.limit == "tool_seconds" and traj.stats.turns == 1
    assert rollout.metrics()["agent/limit_tool_seconds"] == 1.0


def test_turn_limit_is_counted_and_skips_unread_tool_calls(tokenizer, scripted_dirs):
    calls = []

    def add(a: int, b: int) -> int:  # noqa: F811
        """Records its calls."""
        calls.append((a, b))
        return a + b

    rollout = run(native(scripted_dirs[CALL], tokenizer), tokenizer, [Tool.from_function(add)], max_turns=1)
    traj = rollout.trajectories[0]
    assert traj.stats.limit == "turns" and calls == [] and rollout.metrics()["agent/limit_turns"] == 1.0
    assert rollout.batch.loss_mask.row(0).tolist() == [1.0, 1.0]  # the call and its EOS only


def test_response_token_limit_is_counted(tokenizer, scripted_dirs):
    engine = native(scripted_dirs[CALL], tokenizer)
    rollout = run(engine, tokenizer, [Tool.from_function(add)], max_response_tokens=8)
    traj = rollout.trajectories[0]
    assert traj.stats.limit == "response_tokens" and len(rollout.batch.response_ids.row(0)) <= 8
    assert rollout.metrics()["agent/limit_response_tokens"] == 1.0
    assert_exact(engine, rollout)


def test_tools_are_rendered_into_the_prompt(tokenizer, scripted_dirs):
    rollout = run(native(scripted_dirs[CALL], tokenizer), tokenizer, [Tool.from_function(add)])
    prompt = tokenizer.decode(rollout.batch.prompt_ids.row(0).tolist())
    assert '"name": "add"' in prompt and "the first summand" in prompt
    off = run(native(scripted_dirs[CALL], tokenizer), tokenizer, [Tool.from_function(add)], tools_in_prompt=False)
    assert off.batch.prompt_ids.row(0).tolist() == rows(tokenizer)[0].prompt_ids
    assert isinstance(off.batch.loss_mask.values, torch.Tensor)
