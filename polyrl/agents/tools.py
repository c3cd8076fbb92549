"""Tools as typed Python functions: the JSON schema comes from the signature and the docstring.

    def multiply(a: int, b: int) -> int:
        '''Multiply two integers.

        Args:
            a: the first factor.
            b: the second factor.
        '''
        return a * b

    tool = Tool.from_function(multiply)
    tool.schema  # {"type": "function", "function": {"name": "multiply", "parameters": {...}}}

The schema is the OpenAI / Hugging Face "function" shape that chat templates render into the
system prompt (`apply_chat_template(..., tools=[tool.schema])`). Arguments a model sends are
checked against the signature before the call, so a wrong argument becomes an error message the
model can read, not a TypeError deep inside the tool.

`agent.tools` names each tool by import path ("package.module:function" or
"/path/to/file.py:function"), or by the name a package gives it in the `polyrl.tools`
entry-point group (`TOOLS`; docs/plugins.md).
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Literal

from polyrl.registry import PluginLoadError, Registry, RegistryError, defined_callables, load_plugin

ENTRY_POINT_GROUP = "polyrl.tools"
TOOLS: Registry[Callable[..., Any]] = Registry("tool", entry_point_group=ENTRY_POINT_GROUP)
"""Tools by name: those packages register in the `polyrl.tools` entry-point group (or in code)."""

_JSON_TYPES: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean",
                               list: "array", tuple: "array", dict: "object", type(None): "null"}


class ToolArgumentError(ValueError):
    """The model's arguments do not fit the tool's signature (reported back to the model)."""


def type_schema(annotation: Any) -> dict[str, Any]:
    """JSON schema of a type hint: str/int/float/bool, list[X], dict[str, X], Literal, Optional."""
    if annotation is inspect.Parameter.empty or annotation is Any:
        return {}
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return {"type": _JSON_TYPES.get(type(args[0]), "string"), "enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        inner = type_schema(options[0]) if len(options) == 1 else {"anyOf": [type_schema(a) for a in options]}
        return {**inner, "nullable": True} if len(options) < len(args) else inner
    if origin in (list, tuple, set, frozenset) or annotation in (list, tuple):
        return {"type": "array", **({"items": type_schema(args[0])} if args else {})}
    if origin is dict or annotation is dict:
        return {"type": "object", **({"additionalProperties": type_schema(args[1])} if len(args) == 2 else {})}
    if annotation in _JSON_TYPES:
        return {"type": _JSON_TYPES[annotation]}
    raise TypeError(f"type hint {annotation!r} has no JSON schema; use str, int, float, bool, "
                    "list[...], dict[str, ...], Literal[...] or Optional[...]")


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """(description, {arg: description}) from a Google-style docstring: the description is the
    first paragraph; each "name: text" (or "name (type): text") line of the Args: section starts
    an argument, more-indented lines continue it."""
    description: list[str] = []
    params: dict[str, str] = {}
    section, current, arg_indent = None, None, None
    for line in inspect.cleandoc(doc or "").splitlines():
        text, indent = line.strip(), len(line) - len(line.lstrip())
        if indent == 0 and re.fullmatch(r"[A-Z][A-Za-z ]*:", text):
            section, current = text[:-1], None
            continue
        if section is None:
            description.append(text)
        elif section in ("Args", "Arguments", "Parameters") and text:
            m = re.match(r"\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$", text)
            if m and (arg_indent is None or indent <= arg_indent):
                arg_indent, current = indent, m.group(1)
                params[current] = m.group(2)
            elif current is not None:
                params[current] = f"{params[current]} {text}".strip()
    first = description[: description.index("")] if "" in description else description
    return " ".join(first).strip(), params


@dataclass
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    """JSON schema of the arguments object."""
    fn: Callable[..., Any]
    signature: inspect.Signature

    @classmethod
    def from_function(cls, fn: Callable[..., Any], name: str | None = None) -> "Tool":
        signature = inspect.signature(fn)
        hints = typing.get_type_hints(fn)
        description, docs = parse_docstring(fn.__doc__)
        properties, required = {}, []
        for pname, param in signature.parameters.items():
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                raise TypeError(f"tool {fn.__name__}: *args / **kwargs have no schema; name every argument")
            try:
                prop = type_schema(hints.get(pname, param.annotation))
            except TypeError as exc:
                raise TypeError(f"tool {fn.__name__}, argument {pname}: {exc}") from None
            if pname in docs:
                prop["description"] = docs[pname]
            properties[pname] = prop
            if param.default is inspect.Parameter.empty:
                required.append(pname)
        parameters = {"type": "object", "properties": properties, "required": required}
        return cls(name or fn.__name__, description or fn.__name__, parameters, fn, signature)

    @property
    def schema(self) -> dict[str, Any]:
        """The OpenAI function-tool shape chat templates render into the system prompt."""
        return {"type": "function", "function": {
            "name": self.name, "description": self.description, "parameters": self.parameters}}

    def bind(self, arguments: Any) -> dict[str, Any]:
        """Check the model's arguments against the signature; ints pass where floats are asked."""
        if not isinstance(arguments, dict):
            raise ToolArgumentError(f"arguments must be a JSON object, got {type(arguments).__name__}")
        unknown = sorted(set(arguments) - set(self.parameters["properties"]))
        if unknown:
            raise ToolArgumentError(f"unknown argument(s) {', '.join(unknown)}; "
                                    f"{self.name} takes {', '.join(self.parameters['properties']) or 'none'}")
        missing = [p for p in self.parameters["required"] if p not in arguments]
        if missing:
            raise ToolArgumentError(f"missing required argument(s) {', '.join(missing)}")
        for key, value in arguments.items():
            prop = self.parameters["properties"][key]
            if value is None and prop.get("nullable"):
                continue
            expected = prop.get("type")
            if expected and not _matches(value, expected):
                raise ToolArgumentError(f"argument {key} must be {expected}, got {json_type(value)}")
            if "enum" in prop and value not in prop["enum"]:
                raise ToolArgumentError(f"argument {key} must be one of {prop['enum']}, got {value!r}")
        return arguments

    def __call__(self, **arguments: Any) -> Any:
        return self.fn(**arguments)


def json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    return _JSON_TYPES.get(type(value), type(value).__name__)


def _matches(value: Any, expected: str) -> bool:
    actual = json_type(value)
    return actual == expected or (expected == "number" and actual == "integer")


def load_tool(spec: str | Callable[..., Any] | Tool) -> Tool:
    """A Tool from "package.module:function", "/path/to/file.py:function", a function, or a Tool
    (returned as is), loaded by the one plugin loader (`polyrl.registry.load_plugin`). Every
    failure is a ValueError of one line naming agent.tools and the spec."""
    if isinstance(spec, Tool):
        return spec
    if callable(spec):
        return Tool.from_function(spec)
    target, _, attr = str(spec).rpartition(":")  # rpartition: a Windows path may hold "C:"
    if not target and attr and ":" not in str(spec):  # a bare name: a registered tool
        try:
            fn = TOOLS.get(attr)
        except RegistryError:
            raise ValueError(f"agent.tools: '{spec}' must look like package.module:function or "
                             "/path/to/file.py:function, or name a tool registered in the polyrl.tools "
                             f"entry-point group (registered: {', '.join(TOOLS.names()) or 'none'})") from None
        except Exception as exc:  # noqa: BLE001 - the entry point's module raised while imported
            raise ValueError(f"agent.tools: '{spec}': loading the registered tool raised "
                             f"{type(exc).__name__}: {_one_line(exc)}") from None
        return load_tool(fn)
    if not target or not attr:
        raise ValueError(f"agent.tools: '{spec}' must look like package.module:function or /path/to/file.py:function")
    try:
        fn = load_plugin(str(spec), "polyrl_user_tool_", callable_only=True)
    except PluginLoadError as exc:
        raise ValueError(_load_error(spec, exc)) from None
    try:
        return Tool.from_function(fn)
    except (TypeError, ValueError, NameError) as exc:  # a hint with no JSON schema, an unresolvable hint
        raise ValueError(f"agent.tools: '{spec}': {_one_line(exc)}") from None


def _load_error(spec: str, exc: PluginLoadError) -> str:
    """The one line naming agent.tools for what `load_plugin` could not do."""
    if exc.stage == "raised":  # where in the user's module, and what to do
        return (f"agent.tools: '{spec}': importing it raised {type(exc.cause).__name__}: "
                f"{_one_line(exc.cause)}{_where(exc.cause)}; fix the module")  # type: ignore[arg-type]
    if exc.stage == "attribute":
        return (f"agent.tools: '{spec}': '{exc.target}' has no function '{exc.attr}'; "
                f"functions there: {', '.join(defined_callables(exc.module)) or '(none)'}")  # type: ignore[arg-type]
    return f"agent.tools: {exc}"  # the loader's own line: a missing file, a module that cannot be imported


def _one_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0]


def _where(exc: BaseException) -> str:
    """" (at FILE, line N)": the innermost frame of what the user's module raised."""
    if isinstance(exc, SyntaxError):  # its message already holds "(file, line N)"
        return ""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return f" (at {tb.tb_frame.f_code.co_filename}, line {tb.tb_lineno})" if tb is not None else ""


def load_tools(specs: list[Any]) -> dict[str, Tool]:
    """name -> Tool for a config's `tools:` list; two tools of one name are an error."""
    tools: dict[str, Tool] = {}
    for spec in specs:
        tool = load_tool(spec)
        if tool.name in tools:
            raise ValueError(f"two tools are named '{tool.name}'")
        tools[tool.name] = tool
    return tools


def load_agent_tools(cfg: Any) -> dict[str, Tool]:
    """name -> Tool for an `AgentConfig`: `agent.tools`, then the tools of `agent.mcp_servers`
    (this process's MCP sessions, started on first use: polyrl/agents/mcp_tools.py)."""
    tools = load_tools(cfg.tools)
    if cfg.mcp_servers:
        from polyrl.agents.mcp_tools import server_tools

        for name, tool in server_tools(cfg.mcp_servers, cfg.tool_timeout_s, cfg.mcp_start_timeout_s).items():
            if name in tools:
                raise ValueError(f"agent.mcp_servers: a server offers the tool '{name}', which agent.tools "
                                 "already names; drop one of them")
            tools[name] = tool
    return tools
