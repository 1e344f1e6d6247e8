"""The code-execution reward on a real bubblewrap sandbox: what scores, what scores zero, and
what is the infrastructure's fault (``InfraError``, never a zero)."""

from __future__ import annotations

import asyncio
import shutil
import time

import pytest

from tests.test_sandbox import start_service
from tests.test_sandbox_security import SLACK_S
from trident.rewards import RewardSum, resolve
from trident.rewards.code import code_reward, extract_program
from trident.sandbox import InfraError
from trident.sandbox.bwrap import BwrapConfig, BwrapSandbox
from trident.sandbox.pool import SandboxPool

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")

DOUBLE = [
    {"input": "2\n", "output": "4\n"},
    {"input": "5", "output": "10"},
    {"input": "-1", "output": "-2"},
]
ADD_TESTS = "import math\nassert add(1, 2) == 3\nassert add(-1, 1) == 0\nassert math.isclose(add(0.1, 0.2), 0.3)"


def fenced(code: str) -> str:
    return f"Let me think.\n```python\n{code}\n```\nDone."


@pytest.fixture(scope="module")
def pool():
    pool = SandboxPool(max_concurrency=2)
    yield pool
    pool.close()


def score(pool, response: str, **kw) -> float | None:
    return asyncio.run(code_reward(response, sandbox=pool, **kw))


def test_extract_program():
    assert extract_program("```python\na = 1\n```") == "a = 1\n"
    two = "```py\nfirst()\n```\ntext\n```python\nsecond()\n```"
    assert extract_program(two) == "second()\n"
    assert extract_program("```\nuntagged()\n```") == "untagged()\n"
    assert extract_program("```cpp\nint main(){}\n```") == ""
    assert extract_program("print(1)\n") == "print(1)"
    assert extract_program("Sure:\n```python\nprint(1)\nprint(") == "print(1)\nprint("  # cut off


def test_correct_partial_and_all_or_nothing(pool):
    good = fenced("n = int(input())\nprint(n * 2, '  ')")  # trailing spaces are tolerated
    assert score(pool, good, tests=DOUBLE) == 1.0
    assert score(pool, good, tests=DOUBLE, mode="all") == 1.0
    partial = fenced("n = int(input())\nprint(n * 2 if n > 0 else 0)")
    assert score(pool, partial, tests=DOUBLE) == pytest.approx(2 / 3)
    assert score(pool, partial, tests=DOUBLE, mode="all") == 0.0


def test_assert_tests(pool):
    assert score(pool, fenced("def add(a, b):\n    return a + b"), tests=ADD_TESTS) == 1.0
    half = fenced("def add(a, b):\n    return int(a + b)")
    assert score(pool, half, tests=ADD_TESTS) == pytest.approx(2 / 3)
    assert score(pool, half, tests=ADD_TESTS, mode="all") == 0.0


def test_code_that_raises_scores_zero(pool):
    assert score(pool, fenced("raise RuntimeError('no')"), tests=DOUBLE) == 0.0
    # Right output, then a crash: a non-zero exit is never full credit.
    crash_after = fenced("print(int(input()) * 2)\nraise SystemExit(1)")
    assert score(pool, crash_after, tests=DOUBLE) == 0.0
    assert score(pool, fenced("def add(a, b):\n    return a + b\n1 / 0"), tests=ADD_TESTS) == 0.0
    assert score(pool, "```python\ndef add(a, b) return\n```", tests=ADD_TESTS) == 0.0  # syntax


def test_exiting_early_does_not_pass_asserts(pool):
    for escape in ("import os\nos._exit(0)", "import sys\nsys.exit(0)"):
        program = fenced(f"def add(a, b):\n    return 0\n{escape}")
        assert score(pool, program, tests=ADD_TESTS) == 0.0


def test_hung_code_scores_zero_within_its_timeout(pool):
    hung = fenced("def add(a, b):\n    return a + b\nwhile True:\n    pass")
    for tests in (DOUBLE[:1], ADD_TESTS):
        start = time.monotonic()
        assert score(pool, hung, tests=tests, timeout_s=0.5) == 0.0
        assert time.monotonic() - start < 0.5 + SLACK_S


def test_not_applicable_and_empty(pool):
    assert score(pool, fenced("print(1)"), tests=[]) is None
    assert score(pool, fenced("print(1)"), tests="x = 1") is None  # no asserts at all
    assert score(pool, "```cpp\nint main(){}\n```", tests=DOUBLE) == 0.0
    with pytest.raises(ValueError):
        score(pool, fenced("print(1)"), tests=DOUBLE, mode="most")


def test_default_sandbox():
    assert asyncio.run(code_reward(fenced("print(int(input()) * 2)"), tests=DOUBLE)) == 1.0


def test_broken_sandbox_raises_infra_error_never_zero():
    broken = BwrapSandbox(BwrapConfig(python_prefix="/nonexistent/python"))
    with pytest.raises(InfraError):
        asyncio.run(code_reward(fenced("print(1)"), tests=DOUBLE, sandbox=broken))
    with pytest.raises(InfraError):
        asyncio.run(code_reward(fenced("print(1)"), tests=ADD_TESTS, sandbox=broken))
    # Through the reward layer: the sample is marked infra_error, not scored.
    model = RewardSum([(resolve("code"), 1.0)], timeout_s=60)
    row = {"tests": DOUBLE, "sandbox": broken}
    assert asyncio.run(model.score(fenced("print(1)"), row)) == (None, "infra_error")


def test_killed_service_raises_infra_error():
    with start_service() as (remote, proc):
        good = fenced("print(int(input()) * 2)")
        assert asyncio.run(code_reward(good, tests=DOUBLE, sandbox=remote)) == 1.0
        proc.kill()
        proc.wait()
        with pytest.raises(InfraError):
            asyncio.run(code_reward(good, tests=DOUBLE, sandbox=remote))
