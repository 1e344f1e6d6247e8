"""Agentic rollout: the multi-turn agent loop, tool-call parsing and tools.

- ``trident.agent.loop``: ``run_trajectory`` / ``rollout_env_group`` (token-in/token-out
  trajectories of an ``Env`` through a ``RolloutEngine``), budgets, the drift check.
- ``trident.agent.parsers``: Hermes/Qwen ``<tool_call>`` parsing; malformed calls kept as errors.
- ``trident.agent.tools``: Python-function tools with JSON schemas from type hints, sandbox
  ``python``/``bash`` tools, MCP servers over stdio and HTTP.
"""

from trident.agent.loop import AgentConfig, agent_metrics, rollout_env_group, run_trajectory
from trident.agent.parsers import AssistantTurn, ToolCall, get_parser
from trident.agent.tools import MCPClient, Tool, ToolInfraError, ToolResult, ToolSet, tool

__all__ = [
    "AgentConfig",
    "AssistantTurn",
    "MCPClient",
    "Tool",
    "ToolCall",
    "ToolInfraError",
    "ToolResult",
    "ToolSet",
    "agent_metrics",
    "get_parser",
    "rollout_env_group",
    "run_trajectory",
    "tool",
]
