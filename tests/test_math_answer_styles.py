"""The ``math`` reward on the ways models write a final answer, each with the score a careful
grader gives it. Most rows have no ``\\boxed{}`` / ``####`` / ``Answer:`` marker, so they test the
inline step of the extraction order (math-verify's own LaTeX and expression patterns, then the
last number: see ``trident.rewards.math``); each correct style has a wrong twin that scores 0.

Percentages, decided: ``25%`` is the number 0.25, so it matches a reference ``0.25``; it also
matches ``25``, the GSM8K way of writing the answer to "what percent" (the sign dropped). A bare
``0.25`` against a reference ``25`` is a different number: 0.
"""

import asyncio

import pytest

from trident.rewards.math import math_reward


def row(response: str, reference: str, score: float, name: str, why: str = ""):
    """One answer style. ``why`` marks a row math-verify reads differently from the grader: an
    expected failure, kept so the table says what the reward cannot do yet."""
    marks = [pytest.mark.xfail(strict=True, reason=why)] if why else []
    return pytest.param(response, reference, score, id=name, marks=marks)


STYLES = [
    # inline LaTeX: $...$, \(...\), \[...\]
    row("The answer is $\\frac{1}{2}$.", "0.5", 1.0, "dollar-frac"),
    row("The answer is $\\frac{1}{3}$.", "0.5", 0.0, "dollar-frac-wrong"),
    row("Solving, we get \\(x = 5\\).", "5", 1.0, "paren-equation"),
    row("Solving, we get \\(x = 6\\).", "5", 0.0, "paren-equation-wrong"),
    row("So the probability is\n\\[\n\\dfrac{3}{4}.\n\\]", "3/4", 1.0, "display-dfrac"),
    row("So the probability is\n\\[\n\\dfrac{4}{3}.\n\\]", "3/4", 0.0, "display-dfrac-wrong"),
    row("The final answer is $6$. I hope it is correct.", "6", 1.0, "minerva"),
    row("The final answer is $7$. I hope it is correct.", "6", 0.0, "minerva-wrong"),
    # "the answer is", "so x = 5"
    row("After simplifying, the answer is 42.", "42", 1.0, "answer-is"),
    row("After simplifying, the answer is 24.", "42", 0.0, "answer-is-wrong"),
    row("The final answer is **42**.", "42", 1.0, "answer-bold"),
    row("6 * 7 = 42\n\n**Answer: 42**", "42", 1.0, "marker-bold"),
    row("**Final Answer:** $\\frac{1}{2}$", "0.5", 1.0, "marker-bold-latex"),
    row("Subtracting 3 from both sides gives 2x = 10, so x = 5.", "5", 1.0, "so-x-equals"),
    row("Subtracting 3 from both sides gives 2x = 10, so x = 20.", "5", 0.0, "so-x-equals-wrong"),
    row("First $a = 3$ and $b = 4$, so $c = \\sqrt{a^2 + b^2} = 5$.", "5", 1.0, "chain-of-equals"),
    # units and currency
    row("The perimeter of the rectangle is 12 cm.", "12", 1.0, "units-cm"),
    row("The perimeter of the rectangle is 14 cm.", "12", 0.0, "units-cm-wrong"),
    row("The area is $18\\text{ cm}^2$.", "18", 1.0, "latex-units"),
    row("The angle is $90^\\circ$.", "90", 1.0, "degrees"),
    row("She spends $5 on apples, so she has $15 left.", "15", 1.0, "currency"),
    row("She spends $5 on apples, so she has $10 left.", "15", 0.0, "currency-wrong"),
    row("Each pen costs $2.50.", "2.5", 1.0, "currency-cents"),
    # percentages (see the module docstring)
    row("The discount is 25%.", "25", 1.0, "percent-vs-25"),
    row("The discount is 25%.", "0.25", 1.0, "percent-vs-0.25"),
    row("The answer is $25\\%$.", "25\\%", 1.0, "latex-percent"),
    row("The discount is 20%.", "25", 0.0, "percent-wrong"),
    row("The probability is 0.25.", "25", 0.0, "fraction-vs-percent-number"),
    # negative numbers
    row("The temperature at midnight is -7 degrees.", "-7", 1.0, "negative"),
    row("The temperature at midnight is 7 degrees.", "-7", 0.0, "negative-sign-lost"),
    row("Hence the slope is $-\\dfrac{3}{4}$.", "-0.75", 1.0, "negative-dfrac"),
    # fractions and mixed numbers
    row("The probability is 3/4.", "\\frac{3}{4}", 1.0, "slash-fraction"),
    row("The probability is 4/3.", "\\frac{3}{4}", 0.0, "slash-fraction-wrong"),
    row("She needs $1\\frac{1}{2}$ cups of flour.", "3/2", 1.0, "mixed-latex"),
    row("She needs $2\\frac{1}{2}$ cups of flour.", "3/2", 0.0, "mixed-latex-wrong"),
    row(
        "She needs 1 1/2 cups of flour.",
        "3/2",
        1.0,
        "mixed-plain",
        why="math-verify reads the plain-text mixed number '1 1/2' as 1",
    ),
    # decimals and thousands separators
    row("The average is 2.50.", "2.5", 1.0, "trailing-zeros"),
    row("The average is 2.05.", "2.5", 0.0, "trailing-zeros-wrong"),
    row("So $x = 0.5000$.", "\\frac{1}{2}", 1.0, "latex-trailing-zeros"),
    row("The town has 1,000 people.", "1000", 1.0, "thousands"),
    row("The town has 10,000 people.", "1000", 0.0, "thousands-wrong"),
    row("The total comes to 1,234.50 dollars.", "1234.5", 1.0, "thousands-and-cents"),
    # sets, intervals, tuples
    row("The solutions are $\\{1, 2\\}$.", "\\{2, 1\\}", 1.0, "set"),
    row("The solutions are $\\{1, 3\\}$.", "\\{2, 1\\}", 0.0, "set-wrong"),
    row("The roots are $x = -2$ and $x = 3$.", "-2, 3", 1.0, "roots-with-and"),
    row("The solution set is $[0, 1)$.", "[0, 1)", 1.0, "interval"),
    row("The solution set is $[0, 1]$.", "[0, 1)", 0.0, "interval-closed-wrong"),
    row("The point is $(2, -3)$.", "(2, -3)", 1.0, "tuple"),
    row("The point is $(-3, 2)$.", "(2, -3)", 0.0, "tuple-order-wrong"),
    row(
        "So the answer is (2, -3).",
        "(2, -3)",
        1.0,
        "tuple-plain",
        why="math-verify reads a plain-text tuple as its last number",
    ),
    # radicals, pi, scientific notation
    row("The diagonal has length $2\\sqrt{3}$.", "\\sqrt{12}", 1.0, "sqrt"),
    row("The diagonal has length $3\\sqrt{2}$.", "\\sqrt{12}", 0.0, "sqrt-wrong"),
    row("The area is $4\\pi$ square units.", "4\\pi", 1.0, "pi"),
    row("The area is $2\\pi$ square units.", "4\\pi", 0.0, "pi-wrong"),
    row("The angle is $\\pi/2$ radians.", "\\frac{\\pi}{2}", 1.0, "pi-slash"),
    row("Light travels about $3 \\times 10^{8}$ m/s.", "300000000", 1.0, "scientific-latex"),
    row("Light travels about $3 \\times 10^{6}$ m/s.", "300000000", 0.0, "scientific-wrong"),
    row(
        "Light travels about 3 × 10^8 m/s.",
        "300000000",
        1.0,
        "scientific-plain",
        why="math-verify's expression pattern has no unicode ×: it reads 10",
    ),
    # trailing prose after the answer
    row("The answer is $\\frac{1}{2}$. Let me know if you have questions!", "1/2", 1.0, "prose"),
    row("So the answer is 42. This took 3 steps.", "42", 1.0, "prose-with-a-number"),
    row("So the answer is 41. This took 3 steps.", "42", 0.0, "prose-with-a-number-wrong"),
    row("Answer: 12\n\nExplanation: 3 boxes of 4 eggs each.", "12", 1.0, "answer-not-last-line"),
    row("Answer: 13\n\nExplanation: 3 boxes of 4 eggs each.", "12", 0.0, "answer-not-last-wrong"),
    row(
        "So $x = \\frac{1}{2}$. Check: $2 \\cdot \\frac{1}{2} = 1$, as required.",
        "\\frac{1}{2}",
        1.0,
        "check-after-answer",
        why="math-verify takes the last unanchored expression: the check's '= 1'",
    ),
]


@pytest.mark.parametrize(("response", "reference", "score"), STYLES)
def test_answer_style(response, reference, score):
    assert asyncio.run(math_reward(response, answer=reference)) == score
