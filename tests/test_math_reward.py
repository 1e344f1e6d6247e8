"""The ``math`` reward with the real math-verify: answer extraction, equivalence, and its timeout
off the main thread (a hung or crashed check is ``infra_error``, a wrong answer 0.0); then a few
GRPO steps through the real CLI rewarded by it."""

import asyncio
import os
import threading
import time

import pytest

from tests.conftest import run_cli
from trident.rewards import RewardSum, resolve
from trident.rewards.math import extract_math_answer, math_reward
from trident.rewards.pool import CheckerError, CheckerPool
from trident.telemetry.metrics import read_metrics


def score_in_thread(model: RewardSum, response: str, row: dict) -> tuple:
    """``model.score`` on an event loop in a worker thread: where rewards run in training."""
    out = []
    thread = threading.Thread(target=lambda: out.append(asyncio.run(model.score(response, row))))
    thread.start()
    thread.join()
    return out[0]


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        (
            "so \\boxed{\\frac{1}{2}} and later \\boxed{\\frac{\\sqrt{3}}{2}}",
            "\\frac{\\sqrt{3}}{2}",
        ),
        ("\\boxed{\\left\\{1, \\{2\\}\\right\\}}", "\\left\\{1, \\{2\\}\\right\\}"),
        ("\\boxed{5} then \\boxed{unclosed", "5"),
        ("She pays 3 * 4 = 12.\n#### 12", "12"),
        ("2+2 is\nAnswer: 4", "4"),
        ("It costs 7 dollars, so 21 dollars in total.", "21"),
        ("no digits at all", None),
    ],
)
def test_answer_extraction(response, expected):
    assert extract_math_answer(response) == expected


@pytest.mark.parametrize(
    ("response", "answer", "score"),
    [
        ("\\boxed{42}", "42", 1.0),
        ("\\boxed{41}", "42", 0.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\frac{2}{4}}", "1/2", 1.0),
        ("\\boxed{\\dfrac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", 1.0),
        ("\\boxed{1+x^2}", "x^2+1", 1.0),
        ("\\boxed{x^2-1}", "x^2+1", 0.0),
        ("#### 1,000", "1000", 1.0),
        ("The total is 1,000,000.", "1000000", 1.0),
        ("#### 1,000", "100", 0.0),
        ("Answer: 18 dollars", "18", 1.0),
        ("Answer: $18", "18", 1.0),
        ("\\boxed{18\\text{ cm}}", "18", 1.0),
        ("\\boxed{\\{1, 2\\}}", "\\{2, 1\\}", 1.0),
        ("\\boxed{(1, 3)}", "(1, 3)", 1.0),
        ("I do not know.", "42", 0.0),
        # A whole GSM8K / MATH solution as the reference: its final answer is used.
        ("\\boxed{72}", "48 + 24 = 72 clips.\n#### 72", 1.0),
    ],
)
def test_math_verify_equivalence(response, answer, score):
    assert asyncio.run(math_reward(response, answer=answer)) == score


def test_no_reference_is_not_applicable():
    assert asyncio.run(math_reward("\\boxed{1}")) is None
    assert asyncio.run(math_reward("\\boxed{1}", answer="")) is None


def test_scored_off_the_main_thread():
    """The issue's reproduction: from a worker thread's event loop, as training calls it (it was
    ``(None, 'infra_error')`` for every sample while math-verify used ``signal.alarm``)."""
    model = RewardSum([(resolve("math"), 1.0)], 5.0)
    assert score_in_thread(model, "The answer is \\boxed{42}", {"answer": "42"}) == (1.0, "ok")
    assert score_in_thread(model, "The answer is \\boxed{41}", {"answer": "42"}) == (0.0, "ok")


def test_adversarial_responses_are_scored_within_the_timeout():
    model = RewardSum([(resolve("math"), 1.0)], timeout_s=10.0)
    megabyte = "blah " * 200_000
    assert score_in_thread(model, megabyte + "\\boxed{42}", {"answer": "42"}) == (1.0, "ok")
    assert score_in_thread(model, megabyte + " 41", {"answer": "42"}) == (0.0, "ok")
    # 150k unclosed boxes: quadratic for a naive brace matcher, linear here.
    assert score_in_thread(model, "\\boxed{" * 150_000, {"answer": "42"}) == (0.0, "ok")
    # A 20,000-character answer is not parsed (it cannot equal "42"): the model's zero.
    assert score_in_thread(model, "\\boxed{" + "9" * 20_000 + "}", {"answer": "42"}) == (0.0, "ok")


def test_a_pathological_expression_is_an_infra_error_and_the_pool_recovers():
    """10^(10^10) makes sympy build a 10-billion-digit integer, in C: no signal stops it. The
    worker process is killed at the reward timeout; the sample is infra_error, not 0.0."""
    model = RewardSum([(resolve("math"), 1.0)], timeout_s=3.0)
    row = {"answer": "42"}
    assert score_in_thread(model, "\\boxed{10^{10^{10}}}", row) == (None, "infra_error")
    assert score_in_thread(model, "\\boxed{42}", row) == (1.0, "ok")  # a fresh worker


def _hang(seconds: float) -> None:
    time.sleep(seconds)


def test_pool_kills_a_hung_check_and_reports_a_crash():
    """Failure injection with a fake checker: one that hangs, one whose process dies."""
    pool = CheckerPool(size=1)
    try:
        # warm first: a fresh worker's first call gets STARTUP_S more than its timeout
        assert asyncio.run(pool.run(divmod, 7, 2)) == (3, 1)
        t0 = time.monotonic()
        with pytest.raises(CheckerError, match="did not finish in 1.0 s"):
            asyncio.run(pool.run(_hang, 3600, timeout_s=1.0))
        assert time.monotonic() - t0 < 30  # the timeout, not the start-up allowance
        with pytest.raises(CheckerError, match="died"):
            asyncio.run(pool.run(os._exit, 3))
        with pytest.raises(CheckerError, match="ZeroDivisionError"):
            asyncio.run(pool.run(divmod, 1, 0))
        assert asyncio.run(pool.run(divmod, 7, 2)) == (3, 1)  # still usable afterwards
        worker = pool._idle[0]
    finally:
        pool.close()
    assert worker.process.poll() is not None  # closed: no process left behind


def test_cancellation_by_the_reward_timeout_kills_the_worker():
    pool = CheckerPool(size=1)

    async def hanging_reward(response, **_):
        return await pool.run(_hang, 3600)

    try:
        model = RewardSum([(hanging_reward, 1.0)], timeout_s=1.0)
        assert score_in_thread(model, "x", {}) == (None, "infra_error")
        assert not pool._idle and pool._busy == 0  # the hung worker was killed, not kept
        assert asyncio.run(pool.run(divmod, 7, 2)) == (3, 1)
    finally:
        pool.close()


def test_grpo_with_the_math_reward_through_the_cli(demo_sft_model, demo_server, tmp_path):
    """Three GRPO steps from the demo warm-up, scored only by ``math``: every sample scored (no
    infra_error) and the arithmetic the warm-up learned earns reward."""
    r = run_cli(
        "train",
        f"model.path={demo_sft_model}",
        f"run.dir={tmp_path}",
        "run.name=math",
        f"rollout.server_urls=[{demo_server}]",
        "reward.fns=[{name: math}]",
        "pipeline.steps=3",
        "pipeline.prompts_per_step=4",
        "rollout.n=4",
        "rollout.max_tokens=12",
        "trainer.cpu_threads=1",
        "eval.before_after=false",
        "telemetry.progress=false",
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = read_metrics(tmp_path / "math")
    assert [m["version"] for m in metrics] == [1, 2, 3]
    assert all(m["infra_errors"] == 0 for m in metrics), [m["infra_errors"] for m in metrics]
    assert sum(m["reward_mean"] for m in metrics) / 3 > 0.2, [m["reward_mean"] for m in metrics]
