"""Tools the policy can call: Python functions, sandbox sessions and MCP servers.

A ``Tool`` is a name, a JSON schema of its arguments (what the chat template shows the model)
and an async callable returning text. ``tool(fn)`` builds one from a plain function: the schema
comes from the type hints (str, int, float, bool, list[...], dict, Literal[...], X | None) and
the docstring (first paragraph = description, ``Args:`` lines = parameter descriptions).

``ToolSet.run`` executes one turn's calls concurrently (parallel tool calls) and turns every
failure the model caused into an error result the model reads: an unparsable call, an unknown
tool, arguments that do not match the schema, an exception inside the tool, a timeout. Only a
``ToolInfraError`` (the sandbox or an MCP server is down) propagates: that is the
infrastructure's failure, and the trajectory is marked ``infra_error`` instead of the model
being blamed.

``sandbox_tools(session)`` exposes a sandbox session's Python REPL and bash shell;
``MCPClient`` connects to an MCP server over stdio (a command) or streamable HTTP (a URL) with
the ``mcp`` SDK and exposes its tools.

Deliberate simplifications: argument checking covers required/unknown names and top-level JSON
types, not full JSON Schema; tool output is text (MCP images and resources are summarised).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import re
import types
import typing
from collections.abc import Awaitable, Callable, Iterable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any, Literal, overload

from trident.tools.parsers import ToolCall

ToolFn = Callable[..., Awaitable[str]]


class ToolInfraError(RuntimeError):
    """A tool could not run for reasons that are not the model's (sandbox or MCP server down)."""


class ToolError(RuntimeError):
    """Raised by a tool to report an error the model should read, message as is."""


@dataclass
class Tool:
    """One callable tool: ``fn(**arguments)`` returns the text the model reads."""

    name: str
    description: str
    parameters: dict[str, Any]
    fn: ToolFn
    timeout_s: float = 30.0

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style function schema passed to the chat template as ``tools``."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


@dataclass
class ToolResult:
    """What one call returned; ``error`` marks results the model caused to fail."""

    call: ToolCall
    content: str
    error: bool = False

    def message(self) -> dict[str, Any]:
        return {
            "role": "tool",
            "tool_call_id": self.call.id,
            "name": self.call.name,
            "content": self.content,
        }


# -- schemas from type hints ---------------------------------------------------------------------

_JSON_TYPES: dict[Any, str] = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    dict: "object",
    list: "array",
}


def _type_schema(hint: Any) -> dict[str, Any]:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        values = list(args)
        return {"type": _JSON_TYPES.get(type(values[0]), "string"), "enum": values}
    if origin in (typing.Union, types.UnionType):
        kinds = [a for a in args if a is not type(None)]
        if len(kinds) == 1:
            return _type_schema(kinds[0])
        return {"anyOf": [_type_schema(a) for a in kinds]}
    if origin in (list, Sequence, tuple):
        return {"type": "array", "items": _type_schema(args[0])} if args else {"type": "array"}
    if origin is dict:
        return {"type": "object"}
    if hint in _JSON_TYPES:
        return {"type": _JSON_TYPES[hint]}
    raise TypeError(f"no JSON schema for parameter type {hint!r}")


def _docstring_parts(fn: Callable) -> tuple[str, dict[str, str]]:
    doc = inspect.getdoc(fn) or ""
    description = doc.split("\n\n", 1)[0].replace("\n", " ").strip()
    params: dict[str, str] = {}
    m = re.search(r"^(?:Args|Arguments|Parameters):\s*$(.*?)(?:^\S|\Z)", doc, re.M | re.S)
    if m:
        for line in m.group(1).splitlines():
            pm = re.match(r"\s+(\w+)(?:\s*\([^)]*\))?:\s*(.+)", line)
            if pm:
                params[pm.group(1)] = pm.group(2).strip()
    return description, params


def function_schema(fn: Callable) -> tuple[str, dict[str, Any]]:
    """(description, JSON schema of the parameters) of a function, from hints and docstring."""
    description, docs = _docstring_parts(fn)
    hints = typing.get_type_hints(fn)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for name, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if name not in hints:
            raise TypeError(f"{fn.__name__}: parameter {name!r} needs a type hint")
        prop = _type_schema(hints[name])
        if name in docs:
            prop["description"] = docs[name]
        properties[name] = prop
        if param.default is param.empty:
            required.append(name)
    return description, {"type": "object", "properties": properties, "required": required}


@overload
def tool(
    fn: Callable,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout_s: float = 30.0,
) -> Tool: ...
@overload
def tool(
    fn: None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout_s: float = 30.0,
) -> Callable[[Callable], Tool]: ...
def tool(
    fn: Callable | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout_s: float = 30.0,
) -> Tool | Callable[[Callable], Tool]:
    """A ``Tool`` from a (sync or async) function returning text; usable as a decorator
    (``@tool`` or ``@tool(timeout_s=5)``). Non-string results are sent as JSON."""

    def build(f: Callable) -> Tool:
        doc, parameters = function_schema(f)
        if inspect.iscoroutinefunction(f):
            call = f
        else:

            async def call(**kwargs: Any) -> Any:
                return await asyncio.to_thread(f, **kwargs)

        async def as_text(**kwargs: Any) -> str:
            out = await call(**kwargs)
            return out if isinstance(out, str) else json.dumps(out)

        return Tool(name or f.__name__, description or doc, parameters, as_text, timeout_s)

    return build(fn) if fn is not None else build


def check_arguments(parameters: dict[str, Any], arguments: dict[str, Any]) -> str | None:
    """Why ``arguments`` do not fit the schema (names and top-level types), or None."""
    props = parameters.get("properties", {})
    missing = [p for p in parameters.get("required", []) if p not in arguments]
    if missing:
        return f"missing argument(s): {', '.join(missing)}"
    if props and parameters.get("additionalProperties", False) is False:
        unknown = [a for a in arguments if a not in props]
        if unknown:
            return f"unknown argument(s): {', '.join(unknown)}; expected: {', '.join(props)}"
    python_types = {
        "string": str,
        "integer": int,
        "number": (int, float),
        "boolean": bool,
        "object": dict,
        "array": list,
    }
    for key, value in arguments.items():
        kind = props.get(key, {}).get("type")
        if not isinstance(kind, str) or kind not in python_types:
            continue
        bad_bool = isinstance(value, bool) and kind in ("integer", "number")
        if bad_bool or not isinstance(value, python_types[kind]):
            return f"argument {key!r} must be of type {kind}"
    return None


# -- running a turn's calls ---------------------------------------------------------------------


class ToolSet:
    """The tools available in one episode, by name."""

    def __init__(self, tools: Iterable[Tool] = (), max_output_chars: int = 2000) -> None:
        self.tools: dict[str, Tool] = {}
        self.max_output_chars = max_output_chars
        for t in tools:
            self.add(t)

    def add(self, t: Tool) -> None:
        """Add ``t``, replacing a tool of the same name."""
        self.tools[t.name] = t

    def __len__(self) -> int:
        return len(self.tools)

    def __contains__(self, name: str) -> bool:
        return name in self.tools

    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema() for t in self.tools.values()]

    async def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """Run one turn's calls concurrently; results in call order."""
        return list(await asyncio.gather(*(self.run_one(c) for c in calls)))

    async def run_one(self, call: ToolCall) -> ToolResult:
        if not call.ok:
            return ToolResult(call, f"Error: could not parse the tool call: {call.error}.", True)
        t = self.tools.get(call.name)
        if t is None:
            known = ", ".join(self.tools) or "none"
            return ToolResult(call, f"Error: unknown tool {call.name!r}; tools: {known}.", True)
        problem = check_arguments(t.parameters, call.arguments)
        if problem:
            return ToolResult(call, f"Error: {call.name}: {problem}.", True)
        try:
            out = await asyncio.wait_for(t.fn(**call.arguments), t.timeout_s)
        except ToolInfraError:
            raise
        except TimeoutError:
            return ToolResult(call, f"Error: {call.name} timed out after {t.timeout_s:g} s.", True)
        except ToolError as e:
            return ToolResult(call, f"Error: {call.name}: {e}", True)
        except Exception as e:
            return ToolResult(call, f"Error: {call.name} raised {type(e).__name__}: {e}", True)
        return ToolResult(call, self._cap(out))

    def _cap(self, text: str) -> str:
        if len(text) <= self.max_output_chars:
            return text
        cut = len(text) - self.max_output_chars
        return text[: self.max_output_chars] + f"...[{cut} more characters]"


# -- sandbox sessions ----------------------------------------------------------------------------


def format_exec_result(result: Any) -> str:
    """The text a model reads for one sandbox call (``SandboxResult``): stdout, then stderr,
    then the exit code or status when the code did not simply succeed."""
    parts = [result.stdout]
    if result.stderr:
        parts.append(result.stderr)
    if result.status != "ok":
        parts.append(f"[{result.status}]")
    elif result.exit_code:
        parts.append(f"[exit code {result.exit_code}]")
    if result.truncated:
        parts.append("[output truncated]")
    return "\n".join(p.rstrip("\n") for p in parts if p) or "[no output]"


def sandbox_tools(
    session: Any, kinds: Sequence[str] = ("python", "bash"), timeout_s: float = 10.0
) -> list[Tool]:
    """``python`` and/or ``bash`` tools over one ``trident.sandbox.Session`` (shared state)."""
    from trident.sandbox import SessionClosedError

    def make(kind: str, description: str) -> Tool:
        async def run(code: str) -> str:
            try:
                result = await session.exec_async(code, kind=kind, timeout_s=timeout_s)
            except SessionClosedError as e:  # killed by an earlier timeout of the model's code
                return f"[session closed: {e}]"
            if result.status == "error":
                raise ToolInfraError(f"sandbox failed: {result.stderr.strip()}")
            return format_exec_result(result)

        params = {
            "type": "object",
            "properties": {"code": {"type": "string"}},
            "required": ["code"],
        }
        # The session's own timeout kills the sandbox; the tool's outer one only backs it up.
        return Tool(kind, description, params, run, timeout_s + 5.0)

    described = {
        "python": "Run Python; prints the last expression.",
        "bash": "Run a bash command.",
    }
    return [make(k, described[k]) for k in kinds]


# -- MCP servers ---------------------------------------------------------------------------------


def _attr(obj: Any, *names: str, default: Any = None) -> Any:
    # mcp 1.x exposes camelCase attributes (inputSchema, isError); 2.x snake_case.
    for n in names:
        if hasattr(obj, n):
            return getattr(obj, n)
    return default


class MCPClient:
    """Tools of one MCP server, over stdio (``server`` = a command) or streamable HTTP (a URL).

    Use as ``async with MCPClient([...]) as mcp: tools = mcp.tools()``; the connection lives
    until the ``async with`` block ends (enter and exit it in the same task). Calls from other
    tasks are fine, so one client can serve many concurrent trajectories.
    """

    def __init__(
        self,
        server: str | Sequence[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        self.server, self.env, self.cwd, self.timeout_s = server, env, cwd, timeout_s
        self._stack: AsyncExitStack | None = None
        self._session: Any = None
        self._tools: list[Tool] = []

    async def __aenter__(self) -> MCPClient:
        from mcp import ClientSession

        stack = AsyncExitStack()
        try:
            read, write = await self._open_transport(stack)
            session = await stack.enter_async_context(ClientSession(read, write))
            await asyncio.wait_for(session.initialize(), self.timeout_s)
            listed = await asyncio.wait_for(session.list_tools(), self.timeout_s)
        except Exception as e:  # the server's fault (a bad command, a crash, no answer)
            with contextlib.suppress(Exception):
                await stack.aclose()
            raise ToolInfraError(f"MCP server {self.server!r} did not start: {e!r}") from e
        except BaseException:
            await stack.aclose()
            raise
        self._stack, self._session = stack, session
        self._tools = [self._wrap(t) for t in listed.tools]
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._stack is not None:
            stack, self._stack, self._session = self._stack, None, None
            await stack.aclose()

    def tools(self) -> list[Tool]:
        return list(self._tools)

    async def _open_transport(self, stack: AsyncExitStack) -> tuple[Any, Any]:
        if isinstance(self.server, str):
            try:
                from mcp.client.streamable_http import streamable_http_client as http_client
            except ImportError:  # mcp 1.x (the type checker sees 2.x, which renamed it)
                from mcp.client.streamable_http import (
                    streamablehttp_client as http_client,  # pyright: ignore[reportAttributeAccessIssue]
                )
            streams = await stack.enter_async_context(http_client(self.server))
        else:
            from mcp import StdioServerParameters
            from mcp.client.stdio import stdio_client

            command, *args = self.server
            params = StdioServerParameters(command=command, args=args, env=self.env, cwd=self.cwd)
            streams = await stack.enter_async_context(stdio_client(params))
        return streams[0], streams[1]  # 1.x's HTTP client yields a third item (session id)

    def _wrap(self, mcp_tool: Any) -> Tool:
        name = mcp_tool.name

        async def call(**arguments: Any) -> str:
            if self._session is None:
                raise ToolInfraError(f"MCP server {self.server!r} is not connected")
            try:
                result = await self._session.call_tool(name, arguments)
            except Exception as e:  # transport or protocol failure: the server's, not the model's
                raise ToolInfraError(f"MCP tool {name}: {type(e).__name__}: {e}") from e
            text = _mcp_text(result)
            if _attr(result, "is_error", "isError", default=False):
                raise ToolError(text)  # a tool-level error the model should read
            return text

        schema = _attr(mcp_tool, "input_schema", "inputSchema", default=None) or {
            "type": "object",
            "properties": {},
        }
        return Tool(name, mcp_tool.description or "", dict(schema), call, self.timeout_s)


def _mcp_text(result: Any) -> str:
    parts = []
    for block in result.content:
        if getattr(block, "type", None) == "text":
            parts.append(block.text)
        else:
            parts.append(f"[{getattr(block, 'type', 'content')}]")
    if not parts:
        structured = _attr(result, "structured_content", "structuredContent")
        if structured is not None:
            parts.append(json.dumps(structured))
    return "\n".join(parts)
