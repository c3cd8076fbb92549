"""Tool-call parsers: the text of one assistant turn -> the calls it makes, and what was malformed.

The default is the Hermes format that Qwen2.5 / Qwen3 (and many other instruct models) are
trained on: each call is a JSON object inside tags,

    <tool_call>
    {"name": "multiply", "arguments": {"a": 1234, "b": 567}}
    </tool_call>

Parsers are looked up by name (`agent.tool_parser`); a new format registers a class with
`TOOL_PARSERS.register("name", MyParser)`. A parser never raises on model output: whatever it
cannot read becomes an entry of `errors`, which the runner reports back to the model as a tool
message and counts in `agent/tool_errors`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

from polyrl.registry import Registry


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass
class ParsedTurn:
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    """One line per malformed call (bad JSON, no name, arguments not an object, unclosed tag)."""
    content: str = ""
    """The turn's text outside the calls (what the model said to the user)."""

    @property
    def has_calls(self) -> bool:
        """The model tried to call a tool (well-formed or not): the trajectory goes on."""
        return bool(self.calls or self.errors)


class ToolCallParser(Protocol):
    def parse(self, text: str) -> ParsedTurn: ...

    def format(self, calls: list[ToolCall]) -> str:
        """The text a model writes for `calls` (synthetic traces for warm-start SFT)."""
        ...


class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number per turn."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str) -> ParsedTurn:
        out = ParsedTurn()
        rest = self._CALL.sub("\0", text)
        for body in self._CALL.findall(text):
            call, error = self._read(body)
            if error:
                out.errors.append(error)
            else:
                out.calls.append(call)
        if self.OPEN in rest:  # a call the model never closed (stopped, or hit a limit, inside it)
            out.errors.append(f"a {self.OPEN} is not closed by {self.CLOSE}")
            rest = rest[: rest.index(self.OPEN)]
        out.content = rest.replace("\0", "").strip()
        return out

    @staticmethod
    def _read(body: str) -> tuple[ToolCall | None, str | None]:
        obj, error = _json(body)
        if error:
            return None, f"tool call is not valid JSON ({error}): {body.strip()[:200]}"
        if not isinstance(obj, dict):
            return None, f"tool call must be a JSON object with name and arguments, got {type(obj).__name__}"
        name, arguments = obj.get("name"), obj.get("arguments", {})
        if not isinstance(name, str) or not name:
            return None, "tool call has no \"name\" string"
        if isinstance(arguments, str):  # some models write the arguments object as a JSON string
            arguments, error = _json(arguments)
            if error:
                return None, f"tool call {name}: \"arguments\" is a string that is not a JSON object"
        if not isinstance(arguments, dict):
            return None, f"tool call {name}: \"arguments\" must be a JSON object, got {type(arguments).__name__}"
        return ToolCall(name, arguments), None

    def format(self, calls: list[ToolCall]) -> str:
        return "\n".join(f"{self.OPEN}\n{json.dumps({'name': c.name, 'arguments': c.arguments})}\n{self.CLOSE}"
                         for c in calls)


def _json(text: str) -> tuple[Any, str | None]:
    """(value, None), or (None, why) for text that is not JSON - also for what `json.loads`
    raises besides JSONDecodeError on model output: RecursionError on ~1000 nested brackets,
    ValueError on an integer of more than 4300 digits (Python's int conversion limit)."""
    try:
        return json.loads(text), None
    except json.JSONDecodeError as exc:
        return None, f"{exc.msg} at char {exc.pos}"
    except RecursionError:
        return None, "nested too deeply"
    except ValueError as exc:
        return None, str(exc).split(";")[0]


def parse_safely(parser: ToolCallParser, text: str) -> ParsedTurn:
    """`parser.parse(text)`, with a parser that raises (a registered third-party one) reported
    as one malformed call instead of ending the rollout."""
    try:
        return parser.parse(text)
    except Exception as exc:  # noqa: BLE001 - the model's text must never crash the run
        return ParsedTurn(errors=[f"the tool calls could not be read ({type(exc).__name__})"])


TOOL_PARSERS: Registry[type] = Registry("tool-call parser")
TOOL_PARSERS.register("hermes", HermesParser)
TOOL_PARSERS.register("qwen", HermesParser)  # Qwen2.5 / Qwen3 use the Hermes format


def get_parser(name: str) -> ToolCallParser:
    return TOOL_PARSERS.get(name)()
