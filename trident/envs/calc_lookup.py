"""A multi-step tool environment where success requires the tools.

Each row carries a small corpus of random values (``{"K7": "41", "M2": "27", ...}``) and asks
``What is K7 times M2?``. The values exist only in the corpus, so the model must ``lookup`` both
keys (in parallel or one per turn), then ``calc`` the result (a tiny model cannot multiply two
two-digit numbers reliably) and finish with ``Answer: <value>``. Reward: 1.0 for the right
answer in the turn that ends the episode (a turn without tool calls), else 0.0, minus
``tool_error_penalty`` (a constructor option, 0 by default) for every tool call that failed
(malformed, unknown tool, bad arguments, a key not in the corpus).

``make_rows`` writes rows with the prompt fields the env reads, the tool schemas (``tools``) and
a ``messages`` demonstration (a correct tool-using conversation, tool outputs produced by the
same tool functions) that teaches the model the tool-call format with ``trident sft``.
Deliberate simplification: a row's corpus is tiny (four entries, two of them distractors).

``make_rows`` takes options (``trident train`` passes ``env.data_kwargs``) that make the task
easier or the demonstrations more varied: ``distractors``, the value range ``low``..``high``,
``operations``, ``parallel_fraction`` (demonstrations that look both keys up in one turn),
``answer_formats`` (final-answer templates, one picked per row; only ``Answer: {answer}`` earns
reward, so a warm-up on several styles leaves RL something to learn, as in ``configs/demo.yaml``)
and ``shortcut_fraction``: demonstrations of a broken strategy, as a weaker agent's transcripts
have, that hand the key names to the calculator (``calc("F3+G6")``), read its refusal and give
up (``I cannot tell.``, reward 0). A warm-up on both strategies makes failed tool calls and
lost rewards that RL can remove (``configs/agent_demo.yaml``).
"""

from __future__ import annotations

import random
import string
from collections.abc import Sequence
from typing import Any

from trident.data.tasks import extract_answer, generate_split, safe_eval_expression
from trident.envs import Message, StepResult
from trident.models.load import prompt_messages
from trident.tools.parsers import AssistantTurn
from trident.tools.toolset import Tool, ToolResult, ToolSet, tool

OPERATIONS = {"plus": "+", "minus": "-", "times": "*"}
KEYS = [f"{letter}{digit}" for letter in string.ascii_uppercase for digit in range(1, 10)]


def calc(expression: str) -> str:
    """Evaluate integer arithmetic with + - * and parentheses."""
    result = safe_eval_expression(expression)
    if result is None:
        raise ValueError("only integers, + - * and parentheses are allowed")
    return str(result[0])


def lookup_tool(corpus: dict[str, str]) -> Tool:
    def lookup(key: str) -> str:
        """Look up the value of a key in the corpus."""
        if key not in corpus:
            raise ValueError(f"no entry {key}")
        return corpus[key]

    return tool(lookup)


class CalcLookupEnv:
    """Look two values up in the row's corpus, combine them with the calculator."""

    def __init__(self, tools: Sequence[Tool] = (), tool_error_penalty: float = 0.0) -> None:
        self.extra_tools = list(tools)  # replace built-ins by name (e.g. an MCP lookup)
        self.tool_error_penalty = tool_error_penalty
        self.tools = ToolSet()
        self.answer = ""

    async def reset(self, row: dict[str, Any]) -> list[Message]:
        self.answer = str(row["answer"])
        self.tools = ToolSet([lookup_tool(row["corpus"]), tool(calc), *self.extra_tools])
        return prompt_messages(row["prompt"])

    async def step(self, turn: AssistantTurn, results: list[ToolResult]) -> StepResult:
        if turn.tool_calls:
            failed = sum(r.error for r in results)
            penalty = self.tool_error_penalty * failed
            return StepResult(reward=-penalty if penalty else None)
        got = extract_answer(turn.content)
        return StepResult(reward=float(got is not None and got.strip() == self.answer), done=True)

    async def close(self) -> None:
        pass


def _call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _tool_message(name: str, content: str) -> Message:
    return {"role": "tool", "name": name, "content": content}


class CalcLookupTask:
    """Row generator in the shape of ``trident.data.tasks.Task`` (reuses ``generate_split``)."""

    name = "calc_lookup"
    reward = ""  # scored by ``verify``

    def __init__(
        self,
        distractors: int = 2,
        low: int = 10,
        high: int = 99,
        operations: Sequence[str] = tuple(OPERATIONS),
        parallel_fraction: float = 0.5,
        answer_formats: Sequence[str] = ("Answer: {answer}",),
        shortcut_fraction: float = 0.0,
    ) -> None:
        unknown = set(operations) - set(OPERATIONS)
        if unknown or not operations:
            raise ValueError(f"operations must be a non-empty subset of {list(OPERATIONS)}")
        if not 0 <= low <= high or distractors < 0 or not answer_formats:
            raise ValueError("need 0 <= low <= high, distractors >= 0 and an answer format")
        self.distractors, self.low, self.high = distractors, low, high
        self.operations, self.parallel_fraction = list(operations), parallel_fraction
        self.answer_formats = list(answer_formats)
        self.shortcut_fraction = shortcut_fraction

    def make_row(self, rng: random.Random, index: int) -> dict[str, Any]:
        keys = rng.sample(KEYS, 2 + self.distractors)
        corpus = {k: str(rng.randint(self.low, self.high)) for k in keys}
        a, b = keys[:2]
        word = rng.choice(self.operations)
        expression = f"{corpus[a]}{OPERATIONS[word]}{corpus[b]}"
        answer = calc(expression)
        row = {"prompt": f"What is {a} {word} {b}?", "answer": answer, "corpus": corpus}
        row["tools"] = ToolSet([lookup_tool(corpus), tool(calc)]).schemas()
        parallel = rng.random() < self.parallel_fraction
        final = self.answer_formats[0]
        if len(self.answer_formats) > 1:
            final = rng.choice(self.answer_formats)
        if self.shortcut_fraction and rng.random() < self.shortcut_fraction:
            row["messages"] = self.shortcut(row, f"{a}{OPERATIONS[word]}{b}")
        else:
            row["messages"] = self.demonstration(row, a, b, expression, parallel, final)
        return row

    def shortcut(self, row: dict[str, Any], expression: str) -> list[Message]:
        """The broken strategy: the calculator on the key names, its refusal, giving up. The
        error text is what ``ToolSet`` reports for the live tool."""
        try:
            calc(expression)
        except ValueError as e:
            error = f"Error: calc raised ValueError: {e}"
        else:
            raise AssertionError(f"calc accepted key names: {expression}")
        return [
            *prompt_messages(row["prompt"]),
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [_call("calc", {"expression": expression})],
            },
            _tool_message("calc", error),
            {"role": "assistant", "content": "I cannot tell."},
        ]

    def demonstration(
        self,
        row: dict[str, Any],
        a: str,
        b: str,
        expression: str,
        parallel: bool,
        final: str = "Answer: {answer}",
    ) -> list[Message]:
        corpus = row["corpus"]
        messages = prompt_messages(row["prompt"])
        lookups = [_call("lookup", {"key": k}) for k in (a, b)]
        results = [_tool_message("lookup", corpus[k]) for k in (a, b)]
        if parallel:
            messages += [{"role": "assistant", "content": "", "tool_calls": lookups}, *results]
        else:
            for call, result in zip(lookups, results, strict=True):
                messages += [{"role": "assistant", "content": "", "tool_calls": [call]}, result]
        messages += [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [_call("calc", {"expression": expression})],
            },
            _tool_message("calc", calc(expression)),
            {"role": "assistant", "content": final.format(**row)},
        ]
        return messages

    def solution(self, row: dict[str, Any]) -> str:
        return f"Answer: {row['answer']}"

    def verify(self, response: str, row: dict[str, Any]) -> float:
        got = extract_answer(response)
        return float(got is not None and got.strip() == str(row["answer"]))


def make_rows(n: int, split: str = "train", seed: int = 0, **options: Any) -> list[dict[str, Any]]:
    """``n`` rows (prompt, answer, corpus, messages) of one split; train/test prompts disjoint.
    ``options``: ``CalcLookupTask``'s (see the module docstring)."""
    return generate_split(CalcLookupTask(**options), split, n, seed)
