"""Tool-call parsers: one decoded assistant turn in, its text content and tool calls out.

The default is the Hermes/Qwen format: every call is ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>``, several calls in one turn are parallel calls. A parser never drops a call
it cannot read: a block that is not valid JSON, lacks a name, has non-object arguments, is
unclosed or closes without opening becomes a ``ToolCall`` with ``error`` set, which the agent
loop answers with a tool-error message and counts (``tool_parse_error_rate``).

Parsers are pluggable: ``get_parser`` takes a registered name (``hermes``, ``qwen``) or a
``"module:Class"`` entry point of a class with a no-argument constructor and ``parse``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

from trident.registry import load_entry_point


@dataclass
class ToolCall:
    """One tool call as the model wrote it; ``error`` is set when it could not be parsed."""

    id: str
    name: str
    arguments: dict[str, Any]
    raw: str = ""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class AssistantTurn:
    """A parsed assistant turn: ``content`` is the text outside tool-call blocks."""

    text: str
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)

    @property
    def parse_errors(self) -> int:
        return sum(not c.ok for c in self.tool_calls)

    def message(self) -> dict[str, Any]:
        """The turn as an OpenAI-style chat message (what a chat template re-renders).

        A malformed call cannot be a structured ``tool_calls`` entry; its raw text stays in the
        content so that a re-rendering shows it (and the drift check reports the difference).
        """
        malformed = "".join(c.raw for c in self.tool_calls if not c.ok)
        message: dict[str, Any] = {"role": "assistant", "content": self.content + malformed}
        calls = [c for c in self.tool_calls if c.ok]
        if calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in calls
            ]
        return message


class ToolCallParser(Protocol):
    def parse(self, text: str) -> AssistantTurn:
        """Called by the agent loop on every assistant turn, decoded with special tokens kept
        and the end-of-turn token removed."""
        ...


class HermesParser:
    """``<tool_call>{json}</tool_call>`` blocks (Hermes, Qwen2/2.5/3)."""

    start, end = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> AssistantTurn:
        pattern = re.compile(f"{re.escape(self.start)}|{re.escape(self.end)}")
        calls: list[ToolCall] = []
        content: list[str] = []
        pos, open_at = 0, None
        for m in pattern.finditer(text):
            if m.group() == self.start:
                if open_at is not None:  # a second opening tag: the first block never closed
                    calls.append(self._broken(len(calls), text[open_at : m.start()], "unclosed"))
                else:
                    content.append(text[pos : m.start()])
                open_at = m.start()
            elif open_at is None:  # a closing tag with nothing open
                content.append(text[pos : m.start()])
                calls.append(self._broken(len(calls), m.group(), "stray"))
            else:
                calls.append(self._call(len(calls), text[open_at : m.end()]))
                open_at = None
            pos = m.end()
        if open_at is not None:
            calls.append(self._broken(len(calls), text[open_at:], "unclosed"))
        else:
            content.append(text[pos:])
        return AssistantTurn(text=text, content="".join(content), tool_calls=calls)

    def _broken(self, index: int, raw: str, kind: str) -> ToolCall:
        why = {
            "unclosed": f"{self.start} without {self.end}",
            "stray": f"{self.end} without {self.start}",
        }[kind]
        return ToolCall(id=f"call_{index}", name="", arguments={}, raw=raw, error=why)

    def _call(self, index: int, raw: str) -> ToolCall:
        body = raw[len(self.start) : -len(self.end)]
        call = ToolCall(id=f"call_{index}", name="", arguments={}, raw=raw)
        try:
            data = json.loads(body)
        except json.JSONDecodeError as e:
            call.error = f"not valid JSON ({e.msg} at char {e.pos})"
            return call
        if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
            call.error = 'expected {"name": "...", "arguments": {...}}'
            return call
        call.name = data["name"]
        arguments = data.get("arguments", {})
        if isinstance(arguments, str):  # OpenAI style: arguments as a JSON string
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as e:
                call.error = f"arguments are not valid JSON ({e.msg})"
                return call
        if not isinstance(arguments, dict):
            call.error = "arguments must be a JSON object"
            return call
        call.arguments = arguments
        return call


PARSERS: dict[str, str] = {
    "hermes": "trident.tools.parsers:HermesParser",
    "qwen": "trident.tools.parsers:HermesParser",
}


def get_parser(name: str) -> ToolCallParser:
    """A parser by registered name or ``"module:Class"``."""
    entry = PARSERS.get(name, name)
    if ":" not in entry:
        raise KeyError(
            f"unknown tool-call parser {name!r}; registered: {', '.join(PARSERS)}, "
            "or use module:Class"
        )
    return load_entry_point(entry)()
