"""Run one turn's tool calls concurrently, each with a timeout, results in call order.

A tool is a plain (blocking) Python function, so each call runs on its own daemon thread and the
event loop awaits its result with a timeout. A Python thread cannot be killed: a call that runs
past its timeout is abandoned (its result is dropped when it comes) and, being a daemon, never
blocks interpreter exit - unlike `loop.run_in_executor`, whose pool threads are joined at exit.
Every failure - unknown tool, bad arguments, an exception, a timeout - becomes an error result
whose text is shown to the model; nothing here raises because of what a model or a tool did.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass
from typing import Any

from polyrl.agents.parsers import ToolCall
from polyrl.agents.tools import Tool, ToolArgumentError

ERROR_KINDS = ("malformed", "unknown_tool", "bad_arguments", "raised", "timeout")


@dataclass
class ToolResult:
    name: str
    content: str
    """What the model reads in the tool turn."""
    error: str | None = None
    """None on success, else one of ERROR_KINDS."""
    seconds: float = 0.0


def render_result(value: Any) -> str:
    """A tool's return value as the text of its tool message (JSON for structured values)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


def error_result(name: str, kind: str, message: str, seconds: float = 0.0) -> ToolResult:
    return ToolResult(name, f"Error: {message}", kind, seconds)


async def _in_thread(fn, kwargs: dict[str, Any]) -> Any:
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def deliver(ok: bool, value: Any) -> None:
        if not fut.done():  # the caller may have timed out and gone
            fut.set_result(value) if ok else fut.set_exception(value)

    def work() -> None:
        try:
            value, ok = fn(**kwargs), True
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            value, ok = exc, False
        try:
            loop.call_soon_threadsafe(deliver, ok, value)
        except RuntimeError:  # the loop closed while an abandoned call was still running
            pass

    threading.Thread(target=work, name="polyrl-tool", daemon=True).start()
    return await fut


async def run_call(call: ToolCall, tools: dict[str, Tool], timeout_s: float) -> ToolResult:
    tool = tools.get(call.name)
    if tool is None:
        return error_result(call.name, "unknown_tool", f"unknown tool '{call.name}'; available tools: "
                            f"{', '.join(tools) or '(none)'}")
    try:
        kwargs = tool.bind(call.arguments)
    except ToolArgumentError as exc:
        return error_result(call.name, "bad_arguments", f"{call.name}: {exc}")
    start = time.monotonic()
    try:
        value = await asyncio.wait_for(_in_thread(tool.fn, kwargs), timeout=max(timeout_s, 1e-3))
    except asyncio.TimeoutError:
        return error_result(call.name, "timeout", f"{call.name} did not finish within {timeout_s:g} s",
                            time.monotonic() - start)
    except Exception as exc:  # noqa: BLE001 - the tool's failure is the model's observation
        return error_result(call.name, "raised", f"{call.name} raised {type(exc).__name__}: {exc}",
                            time.monotonic() - start)
    return ToolResult(call.name, render_result(value), None, time.monotonic() - start)


async def run_calls(calls: list[ToolCall], tools: dict[str, Tool], timeout_s: float,
                    limit: asyncio.Semaphore | None = None) -> list[ToolResult]:
    """All calls concurrently (at most `limit` at once across trajectories), in call order."""
    async def one(call: ToolCall) -> ToolResult:
        if limit is None:
            return await run_call(call, tools, timeout_s)
        async with limit:  # the timeout clock starts once the call has a slot, not when queued
            return await run_call(call, tools, timeout_s)

    return list(await asyncio.gather(*(one(c) for c in calls)))
