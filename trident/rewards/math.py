"""The ``math`` reward: the response's final answer, checked against the reference with
``math-verify`` (LaTeX, fractions, decimals, sets, intervals, equations).

Extraction, first match wins:

1. a marker: the last ``\\boxed{...}`` (nested braces balanced; ``\\fbox`` too), else the text
   after the last ``####`` (GSM8K), else after ``Answer:`` on the last line;
2. else math-verify's own reading of the response's last ``max(MAX_ANSWER_CHARS,
   10 * len(reference))`` characters (``inline_answer``): its LaTeX (``$...$``, ``\\(...\\)``,
   ``\\[...\\]``, a bare ``\\frac``) and plain-expression patterns (``3/4``, ``1,000``, ``25%``,
   ``$5``), tried by anchor, "final answer is" before "answer" before none, and at each anchor
   the rightmost match first (``math_verify.parser.extract_target_from_pred``); so
   ``The answer is $\\frac{1}{2}$. I hope it helps`` reads ``1/2``. Punctuation closing a math
   span (``\\[ \\frac{3}{4}. \\]``) is dropped first: its LaTeX parser rejects it;
3. else the last number in the response. No candidate scores 0.0.

A marked answer or last number is parsed as the content of a ``\\boxed{}`` (so ``1,000``,
``\\frac{1}{2}`` and ``x^2+1`` read as math), after a plain number followed by words (``42
dollars``, ``18 cm``) or preceded by a currency sign keeps only the number and markdown bold
(``**42**``) goes. The reference is read the same way; both are compared with ``verify``. A
percentage is its value (``25%`` equals ``0.25``) and, as math-verify compares it, also equals
``25`` (GSM8K writes the answer to "what percent" without the sign). Step 2 runs only when the
reference parses as math: a text reference (a name) is compared as text, with a marked answer.

Timeouts: math-verify's own (``signal.alarm``) are disabled. They raise off the main thread
(rewards run on event loops in worker threads); in the pool's workers, which run checks on their
main thread, they work, but a timed-out parse reads "no answer" and a timed-out ``verify`` "not
equal", which would score the infrastructure's failure 0.0. Instead the whole check runs in a
``trident.rewards.pool`` worker process that is killed past ``reward.timeout_s`` of work (the wait
for a free worker does not count: ``call_reward``): a hung or crashing check is ``infra_error``, a
wrong answer 0.0.

Deliberate simplifications: a candidate much longer than the reference
(``> max(MAX_ANSWER_CHARS, 10 * len(reference))``) scores 0.0 without being parsed, and step 2
reads no further back than that, so a model cannot turn its wrong answers into unscored
``infra_error`` samples by making them huge. Step 2 trusts math-verify's order: a check written
after the answer (``so $x = \\frac{1}{2}$. Check: $2 \\cdot \\frac{1}{2} = 1$``) is read as
the answer, and plain-text tuples, mixed numbers (``1 1/2``) and ``3 × 10^8`` are misread
(``tests/test_math_answer_styles.py`` lists these).
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
# Math typeset as part of a sentence ends in its punctuation, ``\[ \frac{3}{4}. \]``, which
# math-verify's LaTeX parser rejects; so punctuation just before ``\]``, ``\)`` or ``$`` goes.
_PUNCTUATION_BEFORE_CLOSE = re.compile(r"[.,;]\s*(?=\\\]|\\\)|\$)")

# Its "timeout is disabled" warning is the point here: the process is the bound.
logging.getLogger("math_verify").setLevel(logging.ERROR)


def marked_answer(response: str) -> str | None:
    """The text of the response's marked final answer: the last ``\\boxed{}``, else after the
    last ``####``, else after ``Answer:`` on the last line; None if it marks none."""
    boxed = last_boxed(response)
    if boxed:
        return boxed
    if "####" in response:
        tail = response.rsplit("####", 1)[1].strip()
        if tail:
            return tail.splitlines()[0].strip()
    return extract_answer(response)


def extract_math_answer(response: str) -> str | None:
    """The marked answer's text, else the last number; None if neither: steps 1 and 3 of the
    module docstring's order, the text form (what a whole reference solution yields)."""
    answer = marked_answer(response)
    if answer:
        return answer
    tail = response[-2000:]  # the last number is near the end; never scan a huge response
    numbers = _NUMBER.findall(tail)
    return numbers[-1].rstrip(".,") if numbers else None


def inline_answer(response: str, tail_chars: int = MAX_ANSWER_CHARS) -> list[Any]:
    """math-verify's own reading of the response's last ``tail_chars``: its LaTeX and expression
    patterns, "final answer is" over "answer" over a bare one, the rightmost first at each level
    (``math_verify.parser.extract_target_from_pred``); [] if nothing there parses."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    targets = [LatexExtractionConfig(), ExprExtractionConfig()]
    tail = _PUNCTUATION_BEFORE_CLOSE.sub("", response[-tail_chars:])
    # None disables math-verify's signal.alarm timeout (documented; its stub says int)
    return parse(tail, targets, "no_fallback", parsing_timeout=None)  # pyright: ignore[reportArgumentType]


def _as_math(answer: str) -> str:
    answer = answer.strip().strip("*")  # markdown bold around the answer: **42**
    m = _NUMBER_WITH_UNITS.match(answer)
    return m.group(1) if m else answer.strip().rstrip(".")


def _parse_boxed(answer: str) -> list[Any]:
    from math_verify import parse

    # None disables math-verify's signal.alarm timeout (documented; its stub says int)
    return parse(f"\\boxed{{{_as_math(answer)}}}", parsing_timeout=None)  # pyright: ignore[reportArgumentType]


def math_equal(reference: str, candidate: str) -> bool:
    """Whether ``candidate`` is mathematically equal to ``reference`` (math-verify, no timeout:
    run it in a process that can be killed, as ``math_reward`` does)."""
    from math_verify import verify

    gold = _parse_boxed(reference)
    if not gold:  # not math at all (a name, a word): compare as text
        return _as_math(reference) == _as_math(candidate)
    return bool(verify(gold, _parse_boxed(candidate), timeout_seconds=None))


def _score(reference: str, response: str) -> float:
    """Runs in the worker: extraction and equivalence together, both bounded by the process."""
    from math_verify import verify

    if "####" in reference or last_boxed(reference) is not None:  # a whole GSM8K / MATH solution
        reference = extract_math_answer(reference) or reference
    bound = max(MAX_ANSWER_CHARS, 10 * len(reference))
    candidate = marked_answer(response)
    if not candidate:
        gold = _parse_boxed(reference)
        inline = inline_answer(response, bound) if gold else []
        if inline:
            return float(verify(gold, inline, timeout_seconds=None))
        candidate = extract_math_answer(response)  # the last number
    if candidate is None or len(candidate) > bound:
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
