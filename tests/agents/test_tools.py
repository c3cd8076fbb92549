"""Tool schemas from signatures and docstrings, argument checks, and the Hermes parser."""

from __future__ import annotations

import asyncio
import threading
from typing import Literal, Optional

import pytest

from polyrl.agents import HermesParser, Tool, ToolCall, load_tools
from polyrl.agents.executor import run_calls
from polyrl.agents.tools import ToolArgumentError


def search(query: str, k: int = 3, mode: Literal["fast", "exact"] = "fast", tags: Optional[list[str]] = None,
           weight: float = 1.0) -> list[str]:
    """Search the notes.

    Longer explanation that is not part of the description.

    Args:
        query: what to look for,
            continued on a second line.
        k (int): how many results.
        mode: the matching mode.

    Returns:
        matching notes.
    """
    return [query] * k


def test_schema_from_signature_and_docstring():
    schema = Tool.from_function(search).schema
    fn = schema["function"]
    assert fn["name"] == "search" and fn["description"] == "Search the notes."
    props = fn["parameters"]["properties"]
    assert props["query"] == {"type": "string", "description": "what to look for, continued on a second line."}
    assert props["k"] == {"type": "integer", "description": "how many results."}
    assert props["mode"]["enum"] == ["fast", "exact"]
    assert props["tags"] == {"type": "array", "items": {"type": "string"}, "nullable": True}
    assert fn["parameters"]["required"] == ["query"]


@pytest.mark.parametrize("arguments, error", [
    ({"query": "x", "k": "3"}, "argument k must be integer, got string"),
    ({"k": 3}, "missing required argument(s) query"),
    ({"query": "x", "limit": 1}, "unknown argument(s) limit"),
    ({"query": "x", "mode": "slow"}, "must be one of ['fast', 'exact']"),
    (["x"], "arguments must be a JSON object"),
])
def test_arguments_are_checked_against_the_signature(arguments, error):
    with pytest.raises(ToolArgumentError, match=error.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        Tool.from_function(search).bind(arguments)


def test_ints_pass_for_floats_and_none_for_optionals():
    tool = Tool.from_function(search)
    assert tool.bind({"query": "x", "weight": 2, "tags": None}) == {"query": "x", "weight": 2, "tags": None}


def test_load_tools_from_dotted_paths():
    tools = load_tools(["polyrl.agents.calculator:calculator"])
    assert list(tools) == ["calculator"]
    with pytest.raises(ValueError, match="must look like"):
        load_tools(["nocolon"])
    with pytest.raises(ValueError, match="two tools are named"):
        load_tools([search, search])


def test_hermes_parser_reads_calls_and_reports_what_it_cannot():
    parser = HermesParser()
    text = ('Let me compute.\n<tool_call>\n{"name": "mul", "arguments": {"a": 12, "b": 3}}\n</tool_call>\n'
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>'
            '<tool_call>{"name": "x", "arguments": {</tool_call><tool_call>[1]</tool_call>'
            '<tool_call>{"arguments": {}}</tool_call><tool_call>{"name": "y"')
    turn = parser.parse(text)
    assert turn.calls == [ToolCall("mul", {"a": 12, "b": 3}), ToolCall("add", {"a": 1})]
    assert len(turn.errors) == 4 and turn.content == "Let me compute."
    assert "not valid JSON" in turn.errors[0] and "JSON object" in turn.errors[1]
    assert "no \"name\"" in turn.errors[2] and "not closed" in turn.errors[3]
    assert not parser.parse("just an answer: 42").has_calls
    assert parser.parse(parser.format(turn.calls)).calls == turn.calls


def test_calls_run_concurrently_in_order():
    """Two calls that each wait for the other to start: only concurrent execution finishes both."""
    started = [threading.Event(), threading.Event()]

    def first() -> str:
        """First."""
        started[0].set()
        return "one" if started[1].wait(10) else "alone"

    def second() -> str:
        """Second."""
        started[1].set()
        return "two" if started[0].wait(10) else "alone"

    tools = load_tools([first, second])
    results = asyncio.run(run_calls([ToolCall("first", {}), ToolCall("second", {})], tools, timeout_s=30))
    assert [(r.content, r.error) for r in results] == [("one", None), ("two", None)]


def test_calculator_tool_is_exact_and_refuses_code():
    from polyrl.agents.calculator import calculator

    assert calculator("1234*567") == "699678" and calculator("(7+3)/4") == "2.5" and calculator("2**10") == "1024"
    for bad in ("__import__('os')", "9**9**9", "1+"):
        with pytest.raises(ValueError):
            calculator(bad)


def test_calculator_task_splits_are_disjoint_and_reproducible(tmp_path):
    import json

    from polyrl.agents.calculator import write_calculator_task
    from polyrl.data import read_rows

    a = write_calculator_task(tmp_path / "a", n_train=50, n_val=20, n_sft=30, seed=3)
    b = write_calculator_task(tmp_path / "b", n_train=50, n_val=20, n_sft=30, seed=3)
    assert a["train"].read_bytes() == b["train"].read_bytes() and a["sft"].read_text() == b["sft"].read_text()
    pairs = lambda rows: {tuple(sorted(map(int, r["prompt"][0]["content"][:-1].split("*")))) for r in rows}  # noqa: E731
    train, val = read_rows(str(a["train"])), read_rows(str(a["val"]))
    traces = [json.loads(line) for line in a["sft"].read_text().splitlines()]
    sft = {tuple(sorted(map(int, t["messages"][0]["content"][:-1].split("*")))) for t in traces}
    assert len(pairs(train)) == 50 and not pairs(train) & pairs(val) and not sft & pairs(val)
    first = traces[0]["messages"]
    assert HermesParser().parse(first[1]["content"]).calls[0].name == "calculator"
    assert first[2]["content"] == first[3]["content"] == str(eval(first[0]["content"][:-1]))
    assert all(r["reward_model"]["ground_truth"] == str(eval(r["prompt"][0]["content"][:-1])) for r in val)
