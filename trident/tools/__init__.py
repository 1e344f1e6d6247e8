"""Tool calling, below both the environments and the agent loop (``envs`` → ``tools``,
``agent`` → ``envs``, ``tools``):

- ``trident.tools.parsers``: Hermes/Qwen ``<tool_call>`` parsing; malformed calls kept as errors.
- ``trident.tools.toolset``: Python-function tools with JSON schemas from type hints, sandbox
  ``python``/``bash`` tools, MCP servers over stdio and HTTP.
"""

from trident.tools.parsers import AssistantTurn, ToolCall, get_parser
from trident.tools.toolset import MCPClient, Tool, ToolInfraError, ToolResult, ToolSet, tool

__all__ = [
    "AssistantTurn",
    "MCPClient",
    "Tool",
    "ToolCall",
    "ToolInfraError",
    "ToolResult",
    "ToolSet",
    "get_parser",
    "tool",
]
