"""MCP tool servers as agent tools (`agent.mcp_servers`, `pip install 'polyrl[mcp]'`).

Each entry is a stdio command line (`"python server.py --flag"`, started as a subprocess that
speaks MCP on its stdin / stdout) or an `http(s)://` URL of a Streamable HTTP server. Their tools
join `agent.tools`: each becomes a `Tool` whose JSON schema is the server's `inputSchema` (so
the chat template renders it like a Python tool's) and whose call goes through the `mcp` SDK's
client.

Lifetime: one `McpHub` per process and server list, started the first time a rollout in that
process needs the tools and kept for every later rollout; it is closed at interpreter exit, and
a stdio server also ends when its rollout worker dies (its stdin closes). The hub runs its own
event loop on a daemon thread because the agent loop's event loop lives only for one rollout
call (polyrl/agents/runner.py `run_trajectories_sync`), while an MCP session must stay on the
loop it was opened on.

Failures: a server that cannot start is a `ValueError` of one line naming agent.mcp_servers
(the pre-flight, polyrl/agents/preflight.py, turns it into a config error before Ray starts). A
tool that answers `isError`, a server that died, or a call past `agent.tool_timeout_s` raises
in the tool call, which the executor (polyrl/agents/executor.py) returns to the model as an
`Error: ...` tool message, counted in agent/tool_errors or agent/tool_timeouts.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import inspect
import shlex
import threading
from typing import Any

from polyrl.agents.tools import Tool

PIP_INSTALL = "pip install 'polyrl[mcp]'"


class McpToolError(RuntimeError):
    """A tool answered with isError, or its server is not running."""


def is_url(spec: str) -> bool:
    return spec.startswith(("http://", "https://"))


def spec_problem(spec: str) -> str | None:
    """Why an `agent.mcp_servers` entry cannot be a server (one line), or None."""
    if is_url(spec):
        return None
    try:
        argv = shlex.split(spec)
    except ValueError as exc:
        return f"is not a command line ({exc})"
    return None if argv else "is empty; give a command line (python server.py) or an http(s):// URL"


class McpHub:
    """The sessions of a list of MCP servers, open on one background event loop."""

    def __init__(self, specs: list[str], call_timeout_s: float, start_timeout_s: float):
        self.specs, self.call_timeout_s, self.start_timeout_s = list(specs), call_timeout_s, start_timeout_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="polyrl-mcp", daemon=True)
        self._clients: list[Any] = [None] * len(self.specs)
        self._ended: list[BaseException | None] = [None] * len(self.specs)
        self._stop: asyncio.Event | None = None
        self._serving: list[concurrent.futures.Future] = []
        self.tools: dict[str, Tool] = {}

    def start(self) -> dict[str, Tool]:
        """Start every server and list its tools; raises ValueError (one line) on failure."""
        try:
            import mcp  # noqa: F401
        except ImportError:
            raise ValueError(f"agent.mcp_servers needs the mcp SDK: {PIP_INSTALL}") from None
        self._thread.start()
        self._stop = self._run(self._new_event(), 5.0)
        for i, spec in enumerate(self.specs):
            ready: concurrent.futures.Future = concurrent.futures.Future()
            self._serving.append(asyncio.run_coroutine_threadsafe(self._serve(i, ready), self._loop))
            try:
                listed = ready.result(timeout=self.start_timeout_s)
            except concurrent.futures.TimeoutError:
                self.close()
                raise ValueError(f"agent.mcp_servers: '{spec}' did not answer within "
                                 f"{self.start_timeout_s:g} s (agent.mcp_start_timeout_s)") from None
            except Exception as exc:  # noqa: BLE001 - anything the transport or the server raised
                self.close()
                raise ValueError(f"agent.mcp_servers: '{spec}' failed to start: {_describe(exc)}") from None
            for tool in listed:
                if tool.name in self.tools:
                    self.close()
                    raise ValueError(f"agent.mcp_servers: two servers offer a tool named '{tool.name}'")
                self.tools[tool.name] = self._tool(i, tool)
        return self.tools

    async def _new_event(self) -> asyncio.Event:
        return asyncio.Event()

    def _run(self, coro, timeout_s: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=timeout_s)

    async def _serve(self, i: int, ready: concurrent.futures.Future) -> None:
        """Hold server i's session open until close(); entered and left in this one task, as
        the SDK's cancel scopes require."""
        from mcp import Client

        try:
            async with Client(_target(self.specs[i])) as client:
                listed = await client.list_tools()
                self._clients[i] = client
                ready.set_result(list(listed.tools))
                await self._stop.wait()
        except BaseException as exc:  # noqa: BLE001 - recorded: later calls say the server ended
            self._ended[i] = exc
            if not ready.done():
                ready.set_exception(exc)
        finally:
            self._clients[i] = None
            if not ready.done():
                ready.set_exception(McpToolError("the server closed before listing its tools"))

    def _tool(self, i: int, listed: Any) -> Tool:
        schema = dict(listed.input_schema if hasattr(listed, "input_schema") else listed.inputSchema)
        schema.setdefault("type", "object")
        schema.setdefault("properties", {})
        schema.setdefault("required", [])
        name = listed.name

        def call(**arguments: Any) -> str:
            return self.call(i, name, arguments)

        return Tool(name, listed.description or name, schema, call, inspect.Signature())

    def call(self, i: int, name: str, arguments: dict[str, Any]) -> str:
        """Call a tool of server i from any thread; its text, or McpToolError."""
        if self._clients[i] is None:
            ended = self._ended[i]
            raise McpToolError(f"MCP server '{self.specs[i]}' is not running"
                               + (f" ({_describe(ended)})" if ended is not None else ""))
        future = asyncio.run_coroutine_threadsafe(self._clients[i].call_tool(name, arguments), self._loop)
        try:
            result = future.result(timeout=self.call_timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"MCP server '{self.specs[i]}' did not answer within {self.call_timeout_s:g} s") from None
        except Exception as exc:  # noqa: BLE001 - the transport's errors, e.g. a server that died
            raise McpToolError(f"MCP server '{self.specs[i]}': {_describe(exc)}") from None
        text = _text(result)
        # mcp 2.x names the flag is_error (isError is a deprecated alias there); 1.x only isError
        failed = getattr(result, "is_error", None)
        if failed is None:
            failed = getattr(result, "isError", False)
        if failed:
            raise McpToolError(text or "the tool reported an error")
        return text

    def close(self) -> None:
        """End every session (stdio servers exit) and the loop's thread."""
        if not self._thread.is_alive():
            return
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        for serving in self._serving:
            try:
                serving.result(timeout=10.0)
            except Exception:  # noqa: BLE001 - closing: a server that failed already said so
                pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10.0)


_HUBS: dict[tuple[str, ...], McpHub] = {}
_HUBS_LOCK = threading.Lock()


def server_tools(specs: list[str], call_timeout_s: float, start_timeout_s: float) -> dict[str, Tool]:
    """The tools of `specs`, from this process's hub for them (started on first use)."""
    key = tuple(specs)
    with _HUBS_LOCK:
        hub = _HUBS.get(key)
        if hub is None:
            hub = McpHub(list(specs), call_timeout_s, start_timeout_s)
            hub.start()
            _HUBS[key] = hub
            atexit.register(hub.close)
    return hub.tools


def check_servers(specs: list[str], start_timeout_s: float) -> list[str]:
    """Start each server, list its tools and stop it (the pre-flight); the tool names, or a
    ValueError of one line naming the server that failed."""
    for spec in specs:
        problem = spec_problem(spec)
        if problem:
            raise ValueError(f"agent.mcp_servers: '{spec}' {problem}")
    hub = McpHub(specs, call_timeout_s=start_timeout_s, start_timeout_s=start_timeout_s)
    try:
        return list(hub.start())
    finally:
        hub.close()


def _target(spec: str) -> Any:
    if is_url(spec):
        return spec
    from mcp import StdioServerParameters

    command, *args = shlex.split(spec)
    return StdioServerParameters(command=command, args=args)


def _text(result: Any) -> str:
    """A CallToolResult's content as the tool message: text blocks joined, other blocks as JSON."""
    parts = []
    for block in getattr(result, "content", None) or []:
        text = getattr(block, "text", None)
        parts.append(text if isinstance(text, str) else block.model_dump_json(exclude_none=True))
    if not parts:
        structured = getattr(result, "structured_content", None) or getattr(result, "structuredContent", None)
        if structured is not None:
            import json

            return json.dumps(structured)
    return "\n".join(parts)


def _describe(exc: BaseException) -> str:
    """One line for an exception; an exception group (anyio task groups) by its first leaf."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    text = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
