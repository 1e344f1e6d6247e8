"""A terminal environment: a persistent bash session in the sandbox, scored by the final state.

Each trajectory opens one sandbox session (``trident.sandbox``): a bash shell whose working
directory, files and variables persist across the episode's tool calls. The row's ``setup``
script builds the task's files before the first turn; the model runs commands with the ``bash``
tool and ends the episode with a turn without tool calls; then the row's ``check`` script runs
**in the same session**, from the work directory, and scores what the model left behind:
reward 1.0 if it exits 0, else 0.0. A sandbox that fails (status ``error``) is the
infrastructure's: the sample is marked ``infra_error``, never scored zero.

The session has no network and sees no host file outside its work directory (bubblewrap, see
``trident.sandbox.bwrap``); its memory limit is ``memory_mb``, each command's wall clock
``timeout_s`` (a command that runs past it kills the session, and the check then fails), the
session's lifetime ``ttl_s``. A command's output reaches the model capped at
``max_output_chars``. ``sandbox=`` as for ``trident.envs.code_interpreter`` (a spec such as
``"http://a:8000,http://b:8000"`` spreads the sessions over several hosts).

``make_rows`` writes rows of three kinds (``kinds=`` picks among them):

- ``write``: put a given word into a given file (one command);
- ``find``: find which file under a ``docs<k>/`` holds a word, and write its path into a file;
- ``fix``: make ``bash <project>/test.sh`` pass (read the test, then fix the file it checks: two
  turns).

``write`` has 160 distinct prompts (about 80 per split), the others thousands; ask
``data.num_train`` accordingly when training on ``write`` alone.

Each row has a ``messages`` demonstration whose tool outputs are what the commands print.
"""

from __future__ import annotations

import random
import shlex
from collections.abc import Sequence
from typing import Any

from trident.data.tasks import generate_split
from trident.envs import Message, StepResult
from trident.models.load import prompt_messages
from trident.sandbox import EpisodeSandbox, InfraError, SandboxResult, SessionClosedError
from trident.tools.parsers import AssistantTurn
from trident.tools.toolset import ToolResult, ToolSet, format_exec_result, sandbox_tools

WORDS = (
    "apple", "birch", "cedar", "delta", "ember", "fjord", "grape", "heron", "ivory", "jolly",
    "koala", "lemon", "maple", "noble", "olive", "pearl", "quartz", "raven", "stone", "tulip",
)  # fmt: skip
FILES = ("answer.txt", "out.txt", "word.txt", "note.txt", "result.txt", "w.txt", "a.txt", "x.txt")
KINDS = ("write", "find", "fix")


class TerminalEnv:
    """Reach a file-system state with bash commands in a sandbox session."""

    def __init__(
        self,
        sandbox: Any = None,
        timeout_s: float = 10.0,
        memory_mb: int = 512,
        ttl_s: float = 600.0,
        max_output_chars: int = 2000,
    ) -> None:
        self.box = EpisodeSandbox(sandbox)
        self.timeout_s, self.memory_mb, self.ttl_s = timeout_s, memory_mb, ttl_s
        self.max_output_chars = max_output_chars
        self.session: Any = None
        self.tools = ToolSet()
        self.check = ""

    async def reset(self, row: dict[str, Any]) -> list[Message]:
        self.session = self.box.open(ttl_s=self.ttl_s, memory_mb=self.memory_mb)
        self.tools = ToolSet(
            sandbox_tools(self.session, ("bash",), self.timeout_s), self.max_output_chars
        )
        # The check runs from the work directory, wherever the model's commands left the shell.
        home = (await self._bash("pwd")).stdout.strip()
        self.check = f"cd {shlex.quote(home)} && {{\n{row['check']}\n}}"
        if row.get("setup"):
            result = await self._bash(row["setup"])
            if not result.passed:
                raise InfraError(f"the task's setup failed: {format_exec_result(result)}")
        return prompt_messages(row["prompt"])

    async def step(self, turn: AssistantTurn, results: list[ToolResult]) -> StepResult:
        if turn.tool_calls:
            return StepResult()
        try:
            result = await self._bash(self.check)
        except SessionClosedError:  # the model's command outlived its timeout: state unknown
            return StepResult(reward=0.0, done=True, metrics={"terminal/session_lost": 1.0})
        return StepResult(reward=float(result.passed), done=True)

    async def _bash(self, script: str) -> SandboxResult:
        result = await self.session.exec_async(script, kind="bash", timeout_s=self.timeout_s)
        if result.status == "error":
            raise InfraError(f"sandbox failed: {result.stderr.strip()}")
        return result

    async def close(self) -> None:
        await self.box.close()


# -- rows -----------------------------------------------------------------------------------------


def _call(command: str) -> Message:
    call = {"type": "function", "function": {"name": "bash", "arguments": {"code": command}}}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


def _result(stdout: str) -> Message:
    output = format_exec_result(SandboxResult("ok", 0, stdout, "", 0.0))
    return {"role": "tool", "name": "bash", "content": output}


class TerminalTask:
    """Rows for ``generate_split`` (a ``trident.data.tasks.RowMaker``); the env scores them."""

    name = "terminal"

    def __init__(self, kinds: Sequence[str] = KINDS) -> None:
        unknown = set(kinds) - set(KINDS)
        if unknown or not kinds:
            raise ValueError(f"terminal kinds are {', '.join(KINDS)}; got {list(kinds)}")
        self.kinds = tuple(kinds)

    def make_row(self, rng: random.Random, index: int) -> dict[str, Any]:
        kind = rng.choice(self.kinds)
        word = rng.choice(WORDS)
        if kind == "write":
            path = rng.choice(FILES)
            prompt = f"Write the word {word} into the file {path}."
            setup, steps = "", [(f"echo {word} > {path}", "")]
            check = f'[ "$(cat {path})" = {word} ]'
        elif kind == "find":
            docs, out = f"docs{rng.randint(1, 99)}", rng.choice(FILES)
            names = rng.sample("abcdefgh", 4)
            others = [w for w in WORDS if w != word]
            target = f"{docs}/{names[0]}.txt"
            files = {target: word, **{f"{docs}/{n}.txt": rng.choice(others) for n in names[1:]}}
            setup = f"mkdir -p {docs}\n" + "".join(
                f"echo {text} > {path}\n" for path, text in sorted(files.items())
            )
            prompt = f"Which file in {docs}/ contains the word {word}? Write its path into {out}."
            steps = [(f"grep -l {word} {docs}/* > {out}", "")]
            check = f'[ "$(cat {out})" = {target} ]'
        else:
            proj, name = f"{word}{rng.randint(1, 99)}", rng.choice(FILES)
            value, wrong = rng.randint(10, 99), rng.randint(100, 999)
            test = f'[ "$(cat {proj}/{name})" = {value} ] && echo PASS || {{ echo FAIL; exit 1; }}'
            setup = (
                f"mkdir -p {proj}\necho {wrong} > {proj}/{name}\n"
                f"echo {shlex.quote(test)} > {proj}/test.sh\n"
            )
            prompt = f"Make the test pass: bash {proj}/test.sh"
            steps = [(f"cat {proj}/test.sh", test + "\n"), (f"echo {value} > {proj}/{name}", "")]
            check = f"bash {proj}/test.sh"
        row: dict[str, Any] = {"prompt": prompt, "setup": setup, "check": check, "kind": kind}
        row["tools"] = ToolSet(sandbox_tools(None, ("bash",))).schemas()
        messages = prompt_messages(prompt)
        for command, stdout in steps:
            messages += [_call(command), _result(stdout)]
        row["messages"] = [*messages, {"role": "assistant", "content": "Done."}]
        return row


def make_rows(
    n: int, split: str = "train", seed: int = 0, kinds: Sequence[str] = KINDS
) -> list[dict[str, Any]]:
    """``n`` rows (prompt, setup, check, messages) of one split; train/test prompts disjoint."""
    return generate_split(TerminalTask(kinds), split, n, seed)
