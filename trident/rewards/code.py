"""Code-execution reward: run the response's program against tests in a sandbox.

``code_reward(response, tests=...)`` extracts the program (the last ```python fenced block, else
the last untagged block, else the raw response; an unclosed fence - a response cut off at the
length limit - counts from the fence to the end), then scores it:

- stdin/stdout cases ``[{"input": str, "output": str}, ...]``: each case is one fresh sandbox
  run of ``python3 main.py`` with ``input`` on stdin; it passes if the program exits 0 and its
  stdout equals ``output`` up to trailing whitespace (per line and at the end).
- assert tests (a string of Python): the program runs as ``__main__`` in a harness, then each
  top-level ``assert`` statement of the tests is one check (other statements - imports, helper
  definitions - run in order as setup). The harness prints ``<nonce> <passed> <total>`` last;
  a program that crashes, exits early or never finishes gets no marker and passes nothing.

Score: ``mode="fraction"`` = passed / total; ``mode="all"`` = 1.0 only if every check passes
(stdin cases stop at the first failure). Returns None when there are no tests (not applicable).

Whose fault: code that raises, exits non-zero, hangs (``timeout_s`` per run, then killed), runs
out of memory or prints the wrong thing scores 0 for that check - the model's fault. A sandbox
that fails (status ``error``: bwrap broken, the sandbox service down) raises
``trident.sandbox.InfraError``: the caller marks the sample ``infra_error``; it is never a zero.

Deliberate simplifications: Python only; exact output comparison (no float tolerance, no
special judges); the harness shares the process with the program, so a program that reads its
own harness could forge the marker - the nonce only defeats blind forgeries such as an early
``os._exit(0)``. Without a ``sandbox`` argument each call starts and closes its own backend,
``trident.sandbox.make_sandbox()`` - the one ``$TRIDENT_SANDBOX`` names (a SandboxFusion or e2b
service, a ``trident sandbox serve``), else a local ``SandboxPool`` (a thread and an event loop);
pass a shared one for throughput.
"""

from __future__ import annotations

import ast
import asyncio
import re
import secrets
from collections.abc import Awaitable, Sequence
from typing import Any, Literal

from trident.rewards import register
from trident.sandbox import InfraError, Sandbox, SandboxResult

_FENCE = re.compile(r"```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)```", re.DOTALL)
_OPEN_FENCE = re.compile(r"```[ \t]*(python3?|py)?[ \t]*\n", re.IGNORECASE)
_PYTHON_TAGS = ("python", "python3", "py")


def extract_program(response: str) -> str:
    """The program in a model response (see the module docstring for the rule)."""
    blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(response)]
    for wanted in (lambda t: t in _PYTHON_TAGS, lambda t: t == ""):
        chosen = [body for lang, body in blocks if wanted(lang)]
        if chosen:
            return chosen[-1]
    if blocks:  # only blocks in other languages
        return ""
    opened = list(_OPEN_FENCE.finditer(response))
    if opened:  # cut off inside a fence
        return response[opened[-1].end() :]
    return response.strip()


def _normalize(text: str) -> list[str]:
    return [line.rstrip() for line in text.replace("\r\n", "\n").rstrip().split("\n")]


def _check_result(result: SandboxResult) -> SandboxResult:
    if result.status == "error":
        raise InfraError(f"sandbox failed: {result.stderr}")
    return result


def _split_asserts(tests: str) -> list[tuple[bool, str]]:
    """Top-level statements of ``tests`` as (is_check, source)."""
    try:
        tree = ast.parse(tests)
    except SyntaxError as exc:
        raise ValueError(f"assert tests do not parse: {exc}") from exc
    return [(isinstance(node, ast.Assert), ast.unparse(node)) for node in tree.body]


_HARNESS = """\
import os as _os
_write = _os.write
_g = {{"__name__": "__main__", "__builtins__": __builtins__, "__file__": "solution.py"}}
with open("solution.py") as _f:
    exec(compile(_f.read(), "solution.py", "exec"), _g)
_passed = _total = 0
for _is_check, _src in {steps!r}:
    _total += _is_check
    try:
        exec(compile(_src, "<tests>", "exec"), _g)
        _passed += _is_check
    except BaseException:
        pass
_write(1, ("\\n{nonce} %d %d\\n" % (_passed, _total)).encode())
"""


async def _run_asserts(
    sandbox: Sandbox, program: str, tests: str, timeout_s: float, memory_mb: int
) -> tuple[int, int]:
    steps = _split_asserts(tests)
    total = sum(is_check for is_check, _ in steps)
    if total == 0:
        return 0, 0
    nonce = secrets.token_hex(16)
    files = {"solution.py": program, "main.py": _HARNESS.format(steps=steps, nonce=nonce)}
    result = _check_result(
        await sandbox.run_async(
            ["python3", "main.py"], files=files, timeout_s=timeout_s, memory_mb=memory_mb
        )
    )
    if not result.passed:
        return 0, total
    for line in reversed(result.stdout.splitlines()):
        parts = line.split()
        if len(parts) == 3 and parts[0] == nonce and int(parts[2]) == total:
            return min(int(parts[1]), total), total
    return 0, total


async def _run_case(
    sandbox: Sandbox, program: str, case: dict[str, Any], timeout_s: float, memory_mb: int
) -> bool:
    if "input" not in case or "output" not in case:
        raise ValueError(f"a stdin/stdout test needs 'input' and 'output' keys, got {sorted(case)}")
    result = _check_result(
        await sandbox.run_async(
            ["python3", "main.py"],
            stdin=str(case["input"]),
            files={"main.py": program},
            timeout_s=timeout_s,
            memory_mb=memory_mb,
        )
    )
    return result.passed and _normalize(result.stdout) == _normalize(str(case["output"]))


async def _score_cases(jobs: Sequence[Awaitable[bool]], stop_at_first_failure: bool) -> int:
    """Number of passing cases; cancels the rest once the answer is known (or on an error)."""
    tasks = [asyncio.ensure_future(job) for job in jobs]
    passed = 0
    try:
        for next_done in asyncio.as_completed(tasks):
            if await next_done:
                passed += 1
            elif stop_at_first_failure:
                break
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return passed


@register("code")
async def code_reward(
    response: str,
    *,
    tests: list[dict[str, Any]] | str | None = None,
    mode: Literal["fraction", "all"] = "fraction",
    timeout_s: float = 5.0,
    memory_mb: int = 1024,
    sandbox: Sandbox | None = None,
    **_: Any,
) -> float | None:
    """Score ``response``'s program on ``tests``; see the module docstring. Raises ``InfraError``."""
    if mode not in ("fraction", "all"):
        raise ValueError(f"mode must be 'fraction' or 'all', got {mode!r}")
    if not tests:
        return None
    program = extract_program(response)
    if not program.strip():
        return 0.0
    own = sandbox is None
    if sandbox is None:
        from trident.sandbox import make_sandbox

        sandbox = make_sandbox()  # $TRIDENT_SANDBOX names the backend; default: local bwrap
    try:
        if isinstance(tests, str):
            passed, total = await _run_asserts(sandbox, program, tests, timeout_s, memory_mb)
        else:
            cases = list(tests)
            jobs = [_run_case(sandbox, program, dict(c), timeout_s, memory_mb) for c in cases]
            passed, total = (
                await _score_cases(jobs, stop_at_first_failure=mode == "all"),
                len(cases),
            )
    finally:
        if own:
            await asyncio.get_running_loop().run_in_executor(None, sandbox.close)
    if total == 0:
        return None
    if mode == "all":
        return 1.0 if passed == total else 0.0
    return passed / total
