"""A black-box agent for the async training test, loaded by file path in the rollout replicas
(`agent.black_box=/path/to/calc_agent.py:solve`): the sync openai client, the calculator tool."""

from __future__ import annotations

import openai

from polyrl.agents import HermesParser
from polyrl.agents.calculator import calculator

ANSWER = "The answer is 5."


def solve(base_url, row, trajectory_id):
    """Ask; run the calculator calls the reply makes; ask again; reward 1 for the right answer."""
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0) as llm:
        messages = list(row.raw_prompt)
        for _ in range(3):
            reply = llm.chat.completions.create(model="policy", messages=messages)
            text = reply.choices[0].message.content
            messages.append({"role": "assistant", "content": text})
            calls = HermesParser().parse(text).calls
            if not calls:
                return 1.0 if text == ANSWER else 0.0
            messages += [{"role": "tool", "content": calculator(**c.arguments)} for c in calls]
    return 0.0
