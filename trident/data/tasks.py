"""Built-in verifiable tasks, generated deterministically from a seed.

A task turns a seed into rows (``{"id", "prompt", "answer", ...}``), knows a correct response for
each row (the SFT target) and scores a response with a verifier. Responses must end in the
required format ``Answer: <value>``; anything else scores 0. Train and test splits are
disjoint by a hash of the prompt.

- ``arithmetic``: ``a+b`` (or ``a-b``, ``a*b``) on numbers of ``digits`` digits.
- ``countdown``: reach a target with given numbers, each used at most once, with + - * and
  parentheses (the search-style task of TinyZero); the verifier evaluates the expression safely.
- ``code``: write a tiny program, scored by the ``code`` reward (unit tests in the sandbox).
- ``reasoning_gym:NAME``: any reasoning-gym dataset (``trident.data.gym``), scored by its own
  ``score_answer`` through the ``reasoning_gym`` reward.

A task whose check needs infrastructure (a sandbox, a worker process) names the reward function
that scores it (``reward``) instead of implementing ``verify``: this package never imports
``trident.rewards``, and nothing here runs an event loop.
"""

from __future__ import annotations

import ast
import difflib
import random
import re
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from trident.data.gym import GymTask

ANSWER_RE = re.compile(r"Answer:\s*(.+?)\s*$")


def extract_answer(response: str) -> str | None:
    """The text after the last ``Answer:`` on the response's last non-empty line."""
    lines = [line for line in response.strip().splitlines() if line.strip()]
    if not lines:
        return None
    m = ANSWER_RE.search(lines[-1])
    return m.group(1) if m else None


_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox``) in ``text``, nested braces
    balanced; None if there is none (or it is never closed)."""
    end = len(text)
    # A box left open stays open to the end; so an earlier box can only close before the next
    # one starts: each character is scanned once (a flood of unclosed boxes is linear, not n^2).
    for match in reversed(list(_BOXED.finditer(text))):
        depth, start = 1, match.end()
        for i in range(start, end):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i].strip()
        end = match.start()
    return None


class RowMaker(Protocol):
    """What ``generate_split`` needs: a name and rows (an environment's generator is one)."""

    name: str

    def make_row(self, rng: random.Random, index: int) -> dict[str, Any]:
        """One row: at least ``prompt`` (str) and ``answer``; called while generating a split."""
        ...


class Task(RowMaker, Protocol):
    name: str
    reward: str  # "" = scored by ``verify``; else the registered reward function that scores it

    def solution(self, row: dict[str, Any]) -> str:
        """A correct response for ``row``: the SFT target."""
        ...

    def verify(self, response: str, row: dict[str, Any]) -> float:
        """1.0 for a correct, well-formatted response, else 0.0 (tasks with ``reward == ""``)."""
        ...


@dataclass
class Arithmetic:
    name: str = "arithmetic"
    reward: str = ""
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
    reward: str = ""
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
        evaluated = safe_eval_expression(expr)
        assert evaluated is not None  # built from the allowed operators only
        target = evaluated[0]
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
    Python program (fenced or raw), scored by the ``code`` reward: run in the sandbox against
    the row's three stdin/stdout ``tests``, the fraction passed (a sandbox failure is
    ``infra_error``, never a zero)."""

    name: str = "code"
    reward: str = "code"

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
        raise TypeError(
            "the code task is scored by its reward, `code` (programs run in the sandbox)"
        )


TASKS: dict[str, Task] = {"arithmetic": Arithmetic(), "countdown": Countdown(), "code": Code()}


GYM_PREFIX = "reasoning_gym:"


def task_problem(name: str) -> str | None:
    """Why ``name`` is not a task (one line, with a did-you-mean), or None if it is one."""
    if name in TASKS:
        return None
    if name.startswith(GYM_PREFIX):
        from trident.data.gym import gym_problem

        return gym_problem(name.removeprefix(GYM_PREFIX))
    close = difflib.get_close_matches(name, list(TASKS), n=1, cutoff=0.5)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return (
        f"unknown task {name!r}; {hint}built-in tasks: {', '.join(sorted(TASKS))}, "
        f"or {GYM_PREFIX}NAME (`trident data list`)"
    )


def get_task(name: str, **kwargs: Any) -> Task | GymTask:
    """The task called ``name``; ``kwargs`` configure a reasoning-gym dataset (``data.task_kwargs``)."""
    if name.startswith(GYM_PREFIX):
        from trident.data.gym import GymTask

        return GymTask(name.removeprefix(GYM_PREFIX), kwargs)
    problem = task_problem(name)
    if problem:
        raise KeyError(problem)
    return TASKS[name]


def register_task(task: Task) -> None:
    TASKS[task.name] = task


def split_of(prompt: str) -> str:
    """Which split a prompt belongs to: a stable hash puts 1 in 8 prompts in test, so the splits
    are disjoint whatever their sizes."""
    return "test" if zlib.crc32(prompt.encode()) % 8 == 0 else "train"


def generate_split(task: RowMaker, split: str, n: int, seed: int = 0) -> list[dict[str, Any]]:
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
