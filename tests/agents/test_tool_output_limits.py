"""A huge tool result is refused without tokenizing it in full: the trajectory ends on
agent.max_response_tokens as before, but the tokenizer reads a bounded number of characters
(counted, not timed). The checkpoint is the scripted one: it calls `add`, then answers."""

from __future__ import annotations

import pytest

from conftest import CALL, native
from polyrl.agents import Tool
from polyrl.agents.chat import ChatDelta
from test_tool_rollouts import assert_exact, run

HUGE = 5_000_000


class CountingTokenizer:
    """The real tokenizer; counts the characters it is asked to tokenize."""

    def __init__(self, tokenizer):
        self.tokenizer, self.chars = tokenizer, 0

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def __call__(self, text, **kw):
        self.chars += len(text)
        return self.tokenizer(text, **kw)


def huge(a: int, b: int) -> str:
    """Returns five million characters.

    Args:
        a: unused.
        b: unused.
    """
    return "7" * HUGE


def test_a_huge_tool_result_ends_the_trajectory_without_being_tokenized(tokenizer, scripted_dirs):
    counting = CountingTokenizer(tokenizer)
    engine = native(scripted_dirs[CALL], tokenizer)
    rollout = run(engine, counting, [Tool.from_function(huge, name="add")], max_response_tokens=48)
    assert_exact(engine, rollout)
    traj = rollout.trajectories[0]
    assert traj.stats.limit == "response_tokens" and traj.stats.turns == 1 and traj.stats.tool_calls == 1
    assert rollout.batch.loss_mask.row(0).tolist() == [1.0, 1.0]  # the call and its EOS; no tool turn
    print("tokenized chars", counting.chars, "max token chars", ChatDelta(tokenizer).max_token_chars)
    assert counting.chars < HUGE // 100  # (before: all 5 MB)


@pytest.mark.parametrize("length", [1, 10, 40, 200, 5_000])
def test_the_clipped_delta_decides_like_the_whole(tokenizer, length):
    """For tool results around the budget, delta_ids_within appends exactly what delta_ids would,
    and refuses (a delta over the budget) exactly what delta_ids would refuse."""
    chat = ChatDelta(tokenizer)
    for budget in (4, 16, 48):
        messages = [{"role": "tool", "content": ("12 ab" * length)[:length]}]
        whole = chat.delta_ids(messages, tokenizer.eos_token_id)
        within = chat.delta_ids_within(messages, tokenizer.eos_token_id, budget)
        if len(whole) <= budget:
            assert within == whole
        else:
            assert len(within) > budget
