"""The smallest environment: one turn, no tools, the task's own reward (``task_reward``: its
verifier, or the reward it names, such as the sandbox's ``code``).

It is also the template for writing an environment: hold the row in ``reset``, judge the turn
in ``step``.
"""

from __future__ import annotations

from typing import Any

from trident.envs import Message, StepResult
from trident.models.load import prompt_messages
from trident.rewards import task_reward
from trident.tools.parsers import AssistantTurn
from trident.tools.toolset import ToolResult, ToolSet


class TaskEnv:
    """Single turn: the row's prompt, scored by the row's task (or ``task``)."""

    def __init__(self, task: str = "") -> None:
        self.task = task
        self.tools = ToolSet()
        self.row: dict[str, Any] = {}

    async def reset(self, row: dict[str, Any]) -> list[Message]:
        self.row = row
        return prompt_messages(row["prompt"])

    async def step(self, turn: AssistantTurn, results: list[ToolResult]) -> StepResult:
        fields = {k: v for k, v in self.row.items() if k not in ("prompt", "id", "task")}
        reward = await task_reward(turn.content, self.task or self.row["task"], **fields)
        return StepResult(reward=reward if reward is not None else 0.0, done=True)

    async def close(self) -> None:
        pass
