"""Tool failures that must come back to the model as `Error: ...` results (and be counted), never
end the rollout: SystemExit (argparse), KeyboardInterrupt, a result whose rendering raises, model
output the parser cannot read however it is nested; and hung calls cost a bounded number of
threads, however many waves of calls hit them."""

from __future__ import annotations

import argparse
import asyncio
import threading

import pytest

from polyrl.agents import HermesParser, Tool, ToolCall, load_tools
from polyrl.agents.executor import STUCK, run_calls


def parse_flags(flags: str) -> str:
    """Parse command-line flags the way a CLI-wrapping tool does.

    Args:
        flags: the flags, e.g. "--n 3".
    """
    parser = argparse.ArgumentParser(prog="tool", add_help=False)
    parser.add_argument("--n", type=int, required=True)
    return str(parser.parse_args(flags.split()).n)  # exits (SystemExit 2) on bad flags


def interrupted() -> str:
    """Raises KeyboardInterrupt (a tool's own, e.g. a library mapping SIGINT-like failures)."""
    raise KeyboardInterrupt("stop")


class Unprintable:
    def __str__(self) -> str:
        raise RuntimeError("no text for this value")

    __repr__ = __str__


def unprintable() -> object:
    """Returns a value that neither JSON nor str() can render."""
    return Unprintable()


class BrokenError(Exception):
    def __str__(self) -> str:
        raise ValueError("broken message")


def raises_unprintable() -> str:
    """Raises an exception whose message cannot be printed."""
    raise BrokenError()


def run(calls, tools, **kw):
    return asyncio.run(run_calls(calls, tools, timeout_s=kw.pop("timeout_s", 10.0), **kw))


@pytest.mark.parametrize("call, says", [
    (ToolCall("parse_flags", {"flags": "--n x"}), "Error: parse_flags raised SystemExit: 2"),
    (ToolCall("interrupted", {}), "Error: interrupted raised KeyboardInterrupt: stop"),
    (ToolCall("unprintable", {}), "Error: unprintable raised RuntimeError: no text for this value"),
    (ToolCall("raises_unprintable", {}), "Error: raises_unprintable raised BrokenError: (its message cannot be printed)"),
])
def test_escaping_failures_become_error_results(call, says):
    tools = load_tools([parse_flags, interrupted, unprintable, raises_unprintable])
    ok, failed = run([ToolCall("parse_flags", {"flags": "--n 3"}), call], tools)
    assert (ok.content, ok.error) == ("3", None)  # the other call of the turn is unaffected
    assert (failed.content, failed.error) == (says, "raised")


def test_the_hermes_parser_never_raises_on_model_output():
    parser = HermesParser()
    texts = ["<tool_call>" + "[" * 5000 + "</tool_call>",
             '<tool_call>{"name": "f", "arguments": ' + '{"a": ' * 3000 + "1" + "}" * 3000 + "}</tool_call>",
             '<tool_call>{"name": "f", "arguments": "' + "[" * 5000 + '"}</tool_call>',
             '<tool_call>{"name": "f", "arguments": {"a": ' + "9" * 5000 + "}}</tool_call>",
             "<tool_call>\ud800</tool_call>", "<tool_call>" * 1000]
    for text in texts:
        turn = parser.parse(text)
        assert turn.has_calls and not turn.calls and turn.errors, text[:40]
    assert "nested too deeply" in parser.parse(texts[0]).errors[0]


@pytest.fixture
def release():
    event = threading.Event()
    yield event
    event.set()
    for thread in threading.enumerate():  # the hung calls return now: wait until their threads end
        if thread.name == "polyrl-tool":
            thread.join()


def test_hung_calls_cost_a_bounded_number_of_threads(release):
    started = []

    def hang() -> str:
        """Never returns while the test runs."""
        started.append(1)
        release.wait()
        return "late"

    tools = load_tools([hang])
    before = threading.active_count()
    stuck_limit, parallel, wave = 8, 4, 20
    kinds = []
    for _ in range(5):
        results = run([ToolCall("hang", {})] * wave, tools, timeout_s=0.02,
                      limit=asyncio.Semaphore(parallel), stuck_limit=stuck_limit)
        kinds += [r.error for r in results]
        # calls still running when the limit was reached may time out after it: at most `parallel` more
        assert threading.active_count() <= before + stuck_limit + parallel
    assert kinds == ["timeout"] * (5 * wave)  # every call came back, as a counted timeout
    assert stuck_limit <= len(started) == STUCK.count < stuck_limit + parallel
    late = run([ToolCall("hang", {})], tools, timeout_s=0.02, stuck_limit=stuck_limit)[0]
    assert late.content.startswith(f"Error: hang was not run: {len(started)} earlier tool calls are still running")


def test_a_black_box_agent_exiting_is_an_ordinary_error():
    """Black-box agent runs (black_box.py) use `_in_thread`: an agent's sys.exit() arrives as a
    RuntimeError (counted in agent/env_errors there), not as a SystemExit that ends the rank."""
    import sys

    from polyrl.agents.executor import _in_thread

    with pytest.raises(RuntimeError, match="raised SystemExit: 3"):
        asyncio.run(_in_thread(lambda: sys.exit(3), {}))
