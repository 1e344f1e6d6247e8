"""Built-in verifiable tasks, generated deterministically from a seed.

A task turns a seed into rows (``{"id", "prompt", "answer", ...}``), knows a correct response for
each row (the SFT target) and scores a response with a verifier. Responses must end in the
required format ``Answer: <value>``; anything else scores 0. Train and test splits are
disjoint by a hash of the prompt.

- ``arithmetic``: ``a+b`` (or ``a-b``, ``a*b``) on numbers of ``digits`` digits.
- ``countdown``: reach a target with given numbers, each used at most once, with + - * and
  parentheses (the search-style task of TinyZero); the verifier evaluates the expression safely.
- ``code``: write a tiny program; the verifier runs it against unit tests in the sandbox.
"""

from __future__ import annotations

import ast
import random
import re
import zlib
from dataclasses import dataclass
from typing import Any, Protocol

ANSWER_RE = re.compile(r"Answer:\s*(.+?)\s*$")


def extract_answer(response: str) -> str | None:
    """The text after the last ``Answer:`` on the response's last non-empty line."""
    lines = [line for line in response.strip().splitlines() if line.strip()]
    if not lines:
        return None
    m = ANSWER_RE.search(lines[-1])
    return m.group(1) if m else None


class Task(Protocol):
    name: str

    def make_row(self, rng: random.Random, index: int) -> dict[str, Any]:
        """One row: at least ``prompt`` (str) and ``answer``; called while generating a split."""

    def solution(self, row: dict[str, Any]) -> str:
        """A correct response for ``row``: the SFT target."""

    def verify(self, response: str, row: dict[str, Any]) -> float:
        """1.0 for a correct, well-formatted response, else 0.0."""


@dataclass
class Arithmetic:
    name: str = "arithmetic"
    digits: int = 2
    ops: str = "+"

    def make_row(self, rng: random.Random, index: int) -> dict[str, Any]:
        lo, hi = 10 ** (self.digits - 1), 10**self.digits - 1
        a, b, op = rng.randint(lo, hi), rng.randint(lo, hi), rng.choice(self.ops)
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        return {"prompt": f"{a}{op}{b}", "answer": str(value)}

    def solution(self, row: dict[str, Any]) -> str:
        return f"Answer: {row['answer']}"

    def verify(self, response: str, row: dict[str, Any]) -> float:
        got = extract_answer(response)
        return float(got is not None and got.strip() == str(row["answer"]))


_ALLOWED_NODES = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult)


def safe_eval_expression(expr: str) -> tuple[int, list[int]] | None:
    """Evaluate an integer expression of + - * and parentheses; returns (value, numbers used)."""
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        return None
    numbers: list[int] = []
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED_NODES):
            return None
        if isinstance(node, ast.Constant):
            if not isinstance(node.value, int) or isinstance(node.value, bool):
                return None
            numbers.append(node.value)
    if len(numbers) > 8:
        return None
    value = eval(compile(tree, "<expr>", "eval"), {"__builtins__": {}}, {})  # only + - * of ints
    return value, numbers


@dataclass
class Countdown:
    name: str = "countdown"
    num_numbers: int = 3
    max_number: int = 9

    def make_row(self, rng: random.Random, index: int) -> dict[str, Any]:
        nums = [rng.randint(1, self.max_number) for _ in range(self.num_numbers)]
        # Build the target from a random expression over all numbers, so a solution always exists.
        expr = str(nums[0])
        for n in nums[1:]:
            op = rng.choice("+-*")
            expr = (
                f"({expr}){op}{n}"
                if op == "*" and ("+" in expr or "-" in expr)
                else f"{expr}{op}{n}"
            )
        target = safe_eval_expression(expr)[0]
        return {
            "prompt": f"{' '.join(map(str, nums))} -> {target}",
            "answer": str(target),
            "numbers": nums,
            "solution": expr,
        }

    def solution(self, row: dict[str, Any]) -> str:
        return f"Answer: {row['solution']}"

    def verify(self, response: str, row: dict[str, Any]) -> float:
        got = extract_answer(response)
        result = safe_eval_expression(got) if got else None
        if result is None:
            return 0.0
        value, used = result
        available = list(row["numbers"])
        for n in used:
            if n not in available:
                return 0.0
            available.remove(n)
        return float(value == int(row["answer"]))


@dataclass
class Code:
    """Tiny programs: read an integer ``n`` from stdin and print ``a*n+b``. The response is a
    Python program (fenced or raw); it is run in the sandbox against three stdin/stdout cases
    and scores the fraction passed. A sandbox failure raises ``InfraError`` (never a zero)."""

    name: str = "code"

    def make_row(self, rng: random.Random, index: int) -> dict[str, Any]:
        a, b = rng.randint(2, 9), rng.randint(0, 999)
        inputs = rng.sample(range(-50, 100), 3)
        return {
            "prompt": f"read n, print {a}*n+{b}",
            "answer": f"{a}*n+{b}",
            "tests": [{"input": str(n), "output": str(a * n + b)} for n in inputs],
        }

    def solution(self, row: dict[str, Any]) -> str:
        return f"```python\nn = int(input())\nprint({row['answer']})\n```"

    def verify(self, response: str, row: dict[str, Any]) -> float:
        import asyncio

        from trident.rewards.code import code_reward

        # Called from a worker thread (rewards run off the event loop), so a private loop is fine.
        return asyncio.run(code_reward(response, tests=row["tests"], mode="fraction")) or 0.0


TASKS: dict[str, Task] = {"arithmetic": Arithmetic(), "countdown": Countdown(), "code": Code()}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; built-in tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name]


def register_task(task: Task) -> None:
    TASKS[task.name] = task


def split_of(prompt: str) -> str:
    """Which split a prompt belongs to: a stable hash puts 1 in 8 prompts in test, so the splits
    are disjoint whatever their sizes."""
    return "test" if zlib.crc32(prompt.encode()) % 8 == 0 else "train"


def generate_split(task: Task, split: str, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` distinct rows of one split, deterministic in (task, split, seed)."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', not {split!r}")
    rng = random.Random(f"{task.name}:{split}:{seed}")
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    for _ in range(200 * n):
        if len(rows) == n:
            break
        row = task.make_row(rng, len(rows))
        if row["prompt"] in seen or split_of(row["prompt"]) != split:
            continue
        seen.add(row["prompt"])
        rows.append({"id": f"{task.name}-{split}-{len(rows)}", **row})
    if len(rows) < n:
        raise ValueError(
            f"task {task.name!r} has only {len(rows)} distinct {split} prompts; asked for {n}"
        )
    return rows
