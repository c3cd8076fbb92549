"""Run tool calls (and environment methods) on threads, each with a timeout, never raising.

A tool is a plain (blocking) Python function, so each call runs on a daemon thread of its own and
the event loop awaits its result with a timeout. A Python thread cannot be killed: a call that
runs past its timeout is abandoned (its result is dropped when it comes) and, being a daemon,
never blocks interpreter exit - unlike `loop.run_in_executor`, whose pool threads are joined at
exit.

Threads are bounded. Calls running at once are bounded by `agent.max_parallel_tools` (the
runner's semaphore); abandoned calls still running are counted process-wide, and once
`stuck_limit` of them are (4 x max_parallel_tools, the ratio the reward pool uses,
polyrl/rewards/executor.py) no new thread is started: further calls come back at once as
timeouts ("not run") until a stuck call returns. Calls running at that moment may still time out
and join them, so a tool that hangs forever costs at most stuck_limit + max_parallel_tools threads,
however many waves of calls hit it.

Every failure - unknown tool, bad arguments, an exception (`SystemExit` from argparse and
`KeyboardInterrupt` included: they are the tool's own, a real Ctrl-C reaches the main thread),
a return value whose rendering raises, a timeout - becomes an error result whose text is shown
to the model; nothing here raises because of what a model or a tool did.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from polyrl.agents.parsers import ToolCall
from polyrl.agents.tools import Tool, ToolArgumentError

ERROR_KINDS = ("malformed", "unknown_tool", "bad_arguments", "raised", "timeout")
STUCK_PER_PARALLEL_CALL = 4
"""Abandoned calls allowed to keep their threads, per call slot (`agent.max_parallel_tools`)."""


@dataclass
class ToolResult:
    name: str
    content: str
    """What the model reads in the tool turn."""
    error: str | None = None
    """None on success, else one of ERROR_KINDS."""
    seconds: float = 0.0


@dataclass
class Outcome:
    """How one call on a thread ended: `value` when `error` is None, else `error` is "raised"
    (`exception` holds what it raised), "timeout" or "not_run" (too many calls are stuck)."""
    value: Any = None
    error: str | None = None
    exception: BaseException | None = None
    seconds: float = 0.0


class _StuckCalls:
    """Process-wide count of abandoned calls whose threads still run (calls from every runner
    and every rollout share the process's threads)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0

    def change(self, by: int) -> None:
        with self.lock:
            self.count += by


STUCK = _StuckCalls()


async def call_in_thread(fn: Callable[[], Any], timeout_s: float, stuck_limit: int) -> Outcome:
    """`fn()` on a daemon thread, awaited for at most `timeout_s`; never raises for what `fn`
    does (only a cancellation of the awaiting task propagates)."""
    if STUCK.count >= stuck_limit:
        return Outcome(error="not_run")
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()
    state = {"abandoned": False, "returned": False}
    guard = threading.Lock()

    def deliver(value: Any, exc: BaseException | None) -> None:
        if not fut.done():
            fut.set_result((value, exc))  # an exception travels as data: never raised in the loop

    def work() -> None:
        try:
            value, exc = fn(), None
        except BaseException as caught:  # noqa: BLE001 - SystemExit / KeyboardInterrupt too
            value, exc = None, caught
        with guard:
            state["returned"] = True
            abandoned = state["abandoned"]
        if abandoned:
            STUCK.change(-1)  # its place is free again
            return
        try:
            loop.call_soon_threadsafe(deliver, value, exc)
        except RuntimeError:  # the loop closed meanwhile
            pass

    def abandon() -> None:
        with guard:
            if not state["returned"]:
                state["abandoned"] = True
                STUCK.change(1)

    start = time.monotonic()
    threading.Thread(target=work, name="polyrl-tool", daemon=True).start()
    try:
        value, exc = await asyncio.wait_for(fut, timeout=max(timeout_s, 1e-3))
    except asyncio.TimeoutError:
        abandon()
        return Outcome(error="timeout", seconds=time.monotonic() - start)
    except BaseException:  # cancelled: the call is abandoned like a timed-out one
        abandon()
        raise
    seconds = time.monotonic() - start
    if exc is not None:
        return Outcome(error="raised", exception=exc, seconds=seconds)
    return Outcome(value=value, seconds=seconds)


async def _in_thread(fn: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    """`fn(**kwargs)` on a daemon thread of its own, without a timeout of its own (the caller
    wraps it in one); what it raises is raised here, except that its `SystemExit` /
    `KeyboardInterrupt` arrive as a RuntimeError (they must not end the rollout). Black-box agent
    runs use it (black_box.py), with their own timeout; their threads are not counted in STUCK."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def deliver(ok: bool, value: Any) -> None:
        if not fut.done():  # the caller may have timed out and gone
            fut.set_result(value) if ok else fut.set_exception(value)

    def work() -> None:
        try:
            value, ok = fn(**kwargs), True
        except (SystemExit, KeyboardInterrupt) as exc:
            value, ok = RuntimeError(f"raised {describe(exc)}"), False
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            value, ok = exc, False
        try:
            loop.call_soon_threadsafe(deliver, ok, value)
        except RuntimeError:  # the loop closed while an abandoned call was still running
            pass

    threading.Thread(target=work, name="polyrl-agent", daemon=True).start()
    return await fut


def describe(exc: BaseException) -> str:
    """"Type: message" of an exception whose own `str()` may raise."""
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001 - a broken __str__ must not end the rollout
        text = "(its message cannot be printed)"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def render_result(value: Any) -> str:
    """A tool's return value as the text of its tool message (JSON for structured values)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        return str(value)


def error_result(name: str, kind: str, message: str, seconds: float = 0.0) -> ToolResult:
    return ToolResult(name, f"Error: {message}", kind, seconds)


async def run_call(call: ToolCall, tools: dict[str, Tool], timeout_s: float,
                   stuck_limit: int) -> ToolResult:
    tool = tools.get(call.name)
    if tool is None:
        return error_result(call.name, "unknown_tool", f"unknown tool '{call.name}'; available tools: "
                            f"{', '.join(tools) or '(none)'}")
    try:
        kwargs = tool.bind(call.arguments)
    except ToolArgumentError as exc:
        return error_result(call.name, "bad_arguments", f"{call.name}: {exc}")
    # rendered on the call's thread: a slow or raising __str__ is the tool's failure, in its timeout
    out = await call_in_thread(lambda: render_result(tool.fn(**kwargs)), timeout_s, stuck_limit)
    if out.error == "timeout":
        return error_result(call.name, "timeout", f"{call.name} did not finish within {timeout_s:g} s",
                            out.seconds)
    if out.error == "not_run":
        return error_result(call.name, "timeout", f"{call.name} was not run: {STUCK.count} earlier tool "
                            "calls are still running past their timeout")
    if out.error == "raised":
        return error_result(call.name, "raised", f"{call.name} raised {describe(out.exception)}", out.seconds)
    return ToolResult(call.name, out.value, None, out.seconds)


async def run_calls(calls: list[ToolCall], tools: dict[str, Tool], timeout_s: float,
                    limit: asyncio.Semaphore | None = None,
                    stuck_limit: int = STUCK_PER_PARALLEL_CALL * 16) -> list[ToolResult]:
    """All calls concurrently (at most `limit` at once across trajectories), in call order;
    no new thread while `stuck_limit` abandoned calls still run."""
    async def one(call: ToolCall) -> ToolResult:
        if limit is None:
            return await run_call(call, tools, timeout_s, stuck_limit)
        async with limit:  # the timeout clock starts once the call has a slot, not when queued
            return await run_call(call, tools, timeout_s, stuck_limit)

    return list(await asyncio.gather(*(one(c) for c in calls)))
