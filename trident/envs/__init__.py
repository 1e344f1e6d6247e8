"""Environments: the ``Env`` protocol and a registry of environments by name.

An environment is one episode's task. The agent loop (``trident.agent.loop``) calls::

    messages = await env.reset(row)          # the initial chat messages
    loop:  model writes a turn  ->  the loop runs the turn's tool calls with env.tools
           result = await env.step(turn, tool_results)
           # next prompt = tool results + result.observations; stop when result.done
    await env.close()

One ``Env`` object serves one trajectory (the registry builds a fresh one per trajectory), so
per-episode state (a sandbox session, a corpus) lives on the instance. Rewards are the sum of the
``StepResult.reward`` values of the episode.

Registry: ``register_env(name, "module:Class", data="module:function")``; the module is imported
only when the environment is made, so ``trident env list`` imports nothing heavy. ``data`` names
a generator ``fn(n, split, seed) -> rows`` whose rows hold the prompt fields the env reads, a
``messages`` demonstration usable by ``trident sft``, and ``tools`` (the JSON schemas the env
shows the model, so that SFT renders the same prompt as rollout).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from trident.registry import load_entry_point

if TYPE_CHECKING:
    from trident.tools.parsers import AssistantTurn
    from trident.tools.toolset import ToolResult, ToolSet

Message = dict[str, Any]


@dataclass
class StepResult:
    """What the environment says after one assistant turn."""

    observations: list[Message] = field(default_factory=list)
    reward: float | None = None
    done: bool = False
    metrics: dict[str, float] = field(default_factory=dict)


class Env(Protocol):
    tools: ToolSet
    """The tools the model may call in this episode (shown to it through the chat template)."""

    async def reset(self, row: dict[str, Any]) -> list[Message]:
        """Called once per trajectory, before the first turn: the initial chat messages."""
        ...

    async def step(self, turn: AssistantTurn, results: list[ToolResult]) -> StepResult:
        """Called after every assistant turn, once the loop has run the turn's tool calls
        (``results``, in call order, errors included). Extra observations (e.g. a user message)
        go after the tool results; ``done`` ends the episode."""
        ...

    async def close(self) -> None:
        """Called once when the trajectory ends, however it ends: release per-episode state."""


@dataclass(frozen=True)
class EnvSpec:
    name: str
    entry_point: str | Callable[..., Env]
    data: str | None = None
    description: str = ""
    corpus: bool = True  # its demonstrations go into the tiny tokenizer's training corpus


REGISTRY: dict[str, EnvSpec] = {}


def register_env(
    name: str,
    entry_point: str | Callable[..., Env],
    *,
    data: str | None = None,
    description: str = "",
    corpus: bool = True,
) -> None:
    """Register an environment: ``entry_point`` is ``"module:Class"`` or a factory;
    ``corpus=False`` keeps its demonstrations out of ``demonstration_texts``."""
    REGISTRY[name] = EnvSpec(name, entry_point, data, description, corpus)


def get_spec(name: str) -> EnvSpec:
    if name in REGISTRY:
        return REGISTRY[name]
    if ":" in name:
        return EnvSpec(name, name)
    raise KeyError(
        f"unknown environment {name!r}; registered: {', '.join(sorted(REGISTRY))}, "
        "or use module:Class"
    )


def make_env(name: str, **kwargs: Any) -> Env:
    """A fresh environment (one per trajectory) by registered name or ``"module:Class"``."""
    spec = get_spec(name)
    factory = (
        load_entry_point(spec.entry_point)
        if isinstance(spec.entry_point, str)
        else spec.entry_point
    )
    return factory(**kwargs)


def env_rows(
    name: str,
    n: int,
    split: str = "train",
    seed: int = 0,
    show_tools: bool = True,
    **options: Any,
) -> list[dict[str, Any]]:
    """Rows of a registered environment's data generator (prompts + SFT demonstrations);
    ``options`` go to the generator (e.g. an easier configuration). ``show_tools=False`` leaves
    the tool schemas out of the rows, so that SFT renders prompts without them, as rollout does
    with ``env.show_tools=false``."""
    spec = get_spec(name)
    if not spec.data:
        raise KeyError(f"environment {name!r} has no data generator")
    rows = load_entry_point(spec.data)(n, split, seed, **options)
    if not show_tools:
        rows = [{k: v for k, v in row.items() if k != "tools"} for row in rows]
    return rows


def demonstration_texts(n: int = 200, seed: int = 1234) -> list[str]:
    """Text pieces of every registered generator's demonstrations (tool schemas, calls, turns).

    For training a small tokenizer (``trident.models.factory``) whose merges cover the JSON of
    tool schemas and calls, so that tool-use prompts take fewer tokens.
    """
    texts: list[str] = []
    for spec in REGISTRY.values():
        if not spec.data or not spec.corpus:
            continue
        for row in env_rows(spec.name, n, "train", seed):
            texts += [json.dumps(schema) for schema in row.get("tools", [])]
            for message in row["messages"]:
                texts.append(message["content"])
                for call in message.get("tool_calls", []):
                    fn = call["function"]
                    texts.append(json.dumps({"name": fn["name"], "arguments": fn["arguments"]}))
    return texts


register_env(
    "task",
    "trident.envs.task:TaskEnv",
    description="Single turn: a built-in task's prompt, scored by its verifier (no tools).",
)
register_env(
    "calc_lookup",
    "trident.envs.calc_lookup:CalcLookupEnv",
    data="trident.envs.calc_lookup:make_rows",
    description="Multi-step tools: look values up in the row's corpus, combine them with a calculator.",
)
register_env(
    "code_interpreter",
    "trident.envs.code_interpreter:CodeEnv",
    data="trident.envs.code_interpreter:make_rows",
    description="Code interpreter: compute the answer by running Python in a sandbox session.",
)
register_env(
    "terminal",
    "trident.envs.terminal:TerminalEnv",
    data="trident.envs.terminal:make_rows",
    description="Terminal: reach a file-system state with bash in a sandbox session; a check script scores it.",
    corpus=False,  # the tiny tokenizer's corpus (and so every tiny checkpoint) stays as it was
)
register_env(
    "browser",
    "trident.envs.browser:BrowserEnv",
    data="trident.envs.browser:make_rows",
    description="Browser: goto/click/type/read on a local web app in headless Chromium; the final page is checked.",
    corpus=False,
)
AGENT_PROGRAM = "agent_program"
register_env(
    AGENT_PROGRAM,
    "trident.agent.program:rollout_program_group",  # not an Env: the rollout runs the program
    description="An unmodified agent program (env.kwargs.command) against a per-trajectory "
    "OpenAI-compatible proxy; its stdout is scored by `reward`.",
    corpus=False,
)
register_env(
    "verifiers",
    "trident.envs.adapters.verifiers_env:VerifiersEnv",
    data="trident.envs.adapters.verifiers_env:make_rows",
    description="A verifiers environment (env.kwargs.env=<id or module:function>); needs the `verifiers` extra.",
    corpus=False,
)
register_env(
    "openenv",
    "trident.envs.adapters.openenv_env:OpenEnvEnv",
    data="trident.envs.adapters.openenv_env:make_rows",
    description="An OpenEnv environment (env.kwargs.url=<server> or env=<module:Class>); needs the `openenv` extra.",
    corpus=False,
)
