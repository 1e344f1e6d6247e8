"""The smallest environment: one turn, no tools, a built-in task's verifier as the reward.

It is also the template for writing an environment: hold the row in ``reset``, judge the turn
in ``step``.
"""

from __future__ import annotations

from typing import Any

from trident.agent.parsers import AssistantTurn
from trident.agent.tools import ToolResult, ToolSet
from trident.data.tasks import get_task
from trident.envs import Message, StepResult
from trident.models.load import prompt_messages


class TaskEnv:
    """Single turn: the row's prompt, scored by ``get_task(row["task"]).verify``."""

    def __init__(self, task: str = "") -> None:
        self.task = task
        self.tools = ToolSet()
        self.row: dict[str, Any] = {}

    async def reset(self, row: dict[str, Any]) -> list[Message]:
        self.row = row
        return prompt_messages(row["prompt"])

    async def step(self, turn: AssistantTurn, results: list[ToolResult]) -> StepResult:
        task = get_task(self.task or self.row["task"])
        return StepResult(reward=task.verify(turn.content, self.row), done=True)

    async def close(self) -> None:
        pass
