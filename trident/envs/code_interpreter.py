"""A code-interpreter environment: compute the answer by running Python in a sandbox session.

Each episode opens one sandbox session (``trident.sandbox``): a Python REPL (and, if asked, a
bash shell) whose state persists across the episode's tool calls. The questions need exact
big-number arithmetic (``What is 37**21 mod 97?``) that a small model cannot do in its head;
the model runs code, reads the output, and answers ``Answer: <value>``. Reward: 1.0 for the
right answer in the turn that ends the episode, else 0.0.

Sandbox ownership: pass ``sandbox=`` (a ``SandboxPool`` or ``RemoteSandbox`` shared by all
trajectories, or a ``make_sandbox`` spec such as ``"local"`` or ``"http://a:8000,http://b:8000"``
for one process-wide backend: ``env.kwargs.sandbox``); without one the env starts a private pool
for its episode and closes it after.
``make_rows`` writes rows with a ``messages`` demonstration for ``trident sft``; the tool
outputs in it are formatted by the same function the live tool uses.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from trident.data.tasks import extract_answer, generate_split
from trident.envs import Message, StepResult
from trident.models.load import prompt_messages
from trident.sandbox import EpisodeSandbox, SandboxResult
from trident.tools.parsers import AssistantTurn
from trident.tools.toolset import ToolResult, ToolSet, format_exec_result, sandbox_tools


class CodeEnv:
    """Solve a computation by running Python in a sandbox session."""

    def __init__(
        self,
        sandbox: Any = None,
        kinds: Sequence[str] = ("python",),
        timeout_s: float = 10.0,
        memory_mb: int = 512,
    ) -> None:
        self.box = EpisodeSandbox(sandbox)
        self.kinds, self.timeout_s, self.memory_mb = tuple(kinds), timeout_s, memory_mb
        self.session: Any = None
        self.tools = ToolSet()
        self.answer = ""

    async def reset(self, row: dict[str, Any]) -> list[Message]:
        self.answer = str(row["answer"])
        # A session lives at most as long as an episode may idle between two tool calls.
        self.session = self.box.open(ttl_s=600.0, memory_mb=self.memory_mb)
        self.tools = ToolSet(sandbox_tools(self.session, self.kinds, self.timeout_s))
        return prompt_messages(row["prompt"])

    async def step(self, turn: AssistantTurn, results: list[ToolResult]) -> StepResult:
        if turn.tool_calls:
            return StepResult()
        got = extract_answer(turn.content)
        return StepResult(reward=float(got is not None and got.strip() == self.answer), done=True)

    async def close(self) -> None:
        await self.box.close()


def _question(rng: random.Random) -> tuple[str, str, str]:
    """(question, code that answers it, answer)."""
    kind = rng.choice(("powmod", "digitsum", "product"))
    if kind == "powmod":
        a, b, m = rng.randint(2, 99), rng.randint(10, 40), rng.randint(11, 97)
        return f"What is {a}**{b} mod {m}?", f"pow({a}, {b}, {m})", str(pow(a, b, m))
    if kind == "digitsum":
        a, b = rng.randint(2, 99), rng.randint(10, 40)
        value = sum(map(int, str(a**b)))
        return f"What is the digit sum of {a}**{b}?", f"sum(map(int, str({a}**{b})))", str(value)
    a, b, c = (rng.randint(100, 999) for _ in range(3))
    return f"What is {a}*{b}*{c}?", f"{a}*{b}*{c}", str(a * b * c)


class CodeTask:
    """Row generator in the shape of ``trident.data.tasks.Task`` (reuses ``generate_split``)."""

    name = "code_interpreter"
    reward = ""  # scored by ``verify``

    def make_row(self, rng: random.Random, index: int) -> dict[str, Any]:
        question, code, answer = _question(rng)
        row: dict[str, Any] = {"prompt": question, "answer": answer}
        row["tools"] = ToolSet(sandbox_tools(None, ("python",))).schemas()
        # The REPL prints the repr of the last expression; an int's repr is its digits.
        output = format_exec_result(SandboxResult("ok", 0, answer + "\n", "", 0.0))
        row["messages"] = [
            *prompt_messages(question),
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {"name": "python", "arguments": {"code": code}},
                    }
                ],
            },
            {"role": "tool", "name": "python", "content": output},
            {"role": "assistant", "content": self.solution(row)},
        ]
        return row

    def solution(self, row: dict[str, Any]) -> str:
        return f"Answer: {row['answer']}"

    def verify(self, response: str, row: dict[str, Any]) -> float:
        got = extract_answer(response)
        return float(got is not None and got.strip() == str(row["answer"]))


def make_rows(n: int, split: str = "train", seed: int = 0) -> list[dict[str, Any]]:
    """``n`` rows (prompt, answer, messages) of one split; train/test prompts disjoint."""
    return generate_split(CodeTask(), split, n, seed)
