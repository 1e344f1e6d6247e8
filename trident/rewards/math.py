"""The ``math`` reward: the response's final answer, checked against the reference with
``math-verify`` (LaTeX, fractions, decimals, sets, intervals, equations).

Extraction, first match wins: the last ``\\boxed{...}`` (nested braces balanced; ``\\fbox`` too),
else the text after the last ``####`` (GSM8K), else after the last ``Answer:``, else the last
number in the response. No candidate scores 0.0. Before parsing, a plain number followed by
words (``42 dollars``, ``18 cm``) or preceded by a currency sign keeps only the number; both sides
are then parsed as the content of a ``\\boxed{}``, so ``1,000``, ``\\frac{1}{2}`` and ``x^2+1``
read as math, and compared with ``verify``.

Timeouts: math-verify's own (``signal.alarm``) are disabled, because they fail off the main
thread and because a timed-out parse there returns "not equal", which would score the
infrastructure's failure 0.0. Instead the whole check runs in a ``trident.rewards.pool`` worker
process that is killed past ``reward.timeout_s`` of work (the wait for a free worker does not
count: ``call_reward``): a hung or crashing check is ``infra_error``, a wrong answer 0.0.

Deliberate simplification: a candidate much longer than the reference
(``> max(MAX_ANSWER_CHARS, 10 * len(reference))``) scores 0.0 without being parsed, so a model
cannot turn its wrong answers into unscored ``infra_error`` samples by making them huge.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from trident.data.tasks import extract_answer, last_boxed
from trident.rewards import register
from trident.rewards.pool import CHECKERS

TIMEOUT_S = 30.0
MAX_ANSWER_CHARS = 1000

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_NUMBER_WITH_UNITS = re.compile(
    r"^\s*(?:\\?\$|€|£)?\s*(-?\d[\d,]*(?:\.\d+)?)\s*(?:[A-Za-z]+\.?\s*){1,3}$"
)


def extract_math_answer(response: str) -> str | None:
    """The response's final answer (see the module docstring for the order); None if none."""
    boxed = last_boxed(response)
    if boxed:
        return boxed
    if "####" in response:
        tail = response.rsplit("####", 1)[1].strip()
        if tail:
            return tail.splitlines()[0].strip()
    answer = extract_answer(response)
    if answer:
        return answer
    tail = response[-2000:]  # the last number is near the end; never scan a huge response
    numbers = _NUMBER.findall(tail)
    return numbers[-1].rstrip(".,") if numbers else None


def _as_math(answer: str) -> str:
    m = _NUMBER_WITH_UNITS.match(answer)
    return m.group(1) if m else answer.strip().rstrip(".")


def math_equal(reference: str, candidate: str) -> bool:
    """Whether ``candidate`` is mathematically equal to ``reference`` (math-verify, no timeout:
    run it in a process that can be killed, as ``math_reward`` does)."""
    from math_verify import parse, verify

    # Its "timeout is disabled" warning is the point here: the process is the bound.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    # None disables math-verify's signal.alarm timeout (documented; its stub says int)
    gold = parse(f"\\boxed{{{_as_math(reference)}}}", parsing_timeout=None)  # pyright: ignore[reportArgumentType]
    if not gold:  # not math at all (a name, a word): compare as text
        return _as_math(reference) == _as_math(candidate)
    pred = parse(f"\\boxed{{{_as_math(candidate)}}}", parsing_timeout=None)  # pyright: ignore[reportArgumentType]
    return bool(verify(gold, pred, timeout_seconds=None))


def _score(reference: str, response: str) -> float:
    """Runs in the worker: extraction and equivalence together, both bounded by the process."""
    if "####" in reference or last_boxed(reference) is not None:  # a whole GSM8K / MATH solution
        reference = extract_math_answer(reference) or reference
    candidate = extract_math_answer(response)
    if candidate is None or len(candidate) > max(MAX_ANSWER_CHARS, 10 * len(reference)):
        return 0.0
    return float(math_equal(reference, candidate))


@register("math")
async def math_reward(
    response: str, answer: Any = None, timeout_s: float = TIMEOUT_S, **_: Any
) -> float | None:
    """1.0 if the response's final answer equals ``answer`` (math-verify), else 0.0; None when
    the row has no reference answer. Raises ``CheckerError`` on a hung or crashed check."""
    if answer is None or str(answer).strip() == "":
        return None
    return await CHECKERS.run(_score, str(answer), response, timeout_s=timeout_s)


# Bounded per check by the pool, not counting the wait for a free worker (see rewards.gym)
math_reward.timeout_s = None  # pyright: ignore[reportFunctionMemberAccess]
