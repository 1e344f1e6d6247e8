"""Run a ``verifiers`` environment as a trident environment (``pip install 'trident[verifiers]'``).

Supported: the classic ``vf.Environment`` API of verifiers 0.2-0.3 (``SingleTurnEnv``,
``MultiTurnEnv``, ``ToolEnv`` and their subclasses, environments from ``vf.load_environment``).
verifiers 0.4 replaced it with a harness-based stack (``verifiers.v1``) that this adapter does not
drive.

A verifiers environment owns its rollout loop: ``env.rollout(input, client, model)`` asks a
client for every model turn, calls ``env_response`` between turns (a ``ToolEnv`` runs the tool
calls there), stops on its stop conditions (``max_turns``, ``no_tools_called``, ...), and its
rubric scores the finished rollout. ``VerifiersEnv`` runs that loop as a background task whose
client is trident: each request for a model turn hands the prompt to trident and waits for
trident's model turn. So:

- ``reset(row)``: ``row`` is a row of the environment's dataset (``prompt`` messages, ``answer``,
  ``info``, ...; ``make_rows`` writes them); returns the messages the environment first sends to
  the model.
- ``step(turn, results)``: the turn is the model's reply; the environment's next messages (the
  ``env_response``: tool results, a user reply) are the observations. When the rollout ends,
  the rubric's reward is the step reward and its metrics are the step metrics.
- ``tools``: the environment's tool definitions, shown to the model. The environment runs the
  calls itself (in ``env_response``), so this ``ToolSet`` runs nothing: the loop's tool counters
  count calls but not tool errors.

The environment is named by ``env``: a verifiers environment id (an installed environment
package, loaded with ``vf.load_environment(env, **env_args)``), a ``"module:function"`` factory
called with ``env_args``, or a ``vf.Environment`` object. Loaded environments are cached, so the
one adapter per trajectory shares one environment (verifiers environments serve concurrent
rollouts).

Deliberate simplifications: chat prompts only; a rubric's group reward functions see a group of
one trajectory; a trajectory that trident ends first (its turn or token budgets) is not scored
(reward 0), so set trident's ``env.max_turns`` above the environment's ``max_turns``; an
environment whose prompts do not extend the previous turn's conversation (one that overrides
``get_prompt_messages`` to rewrite history) is refused with an ``InfraError``; a verifiers
infrastructure error (``vf.InfraError``: sandbox, tunnel) marks the sample ``infra_error``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

from trident.envs import Message, StepResult
from trident.envs.adapters import require
from trident.registry import load_entry_point
from trident.sandbox import InfraError
from trident.tools.parsers import AssistantTurn, ToolCall
from trident.tools.toolset import ToolResult, ToolSet

_LOADED: dict[str, Any] = {}


def _verifiers() -> Any:
    vf = require("verifiers", "verifiers")
    if not hasattr(vf, "MultiTurnEnv"):
        raise ImportError(
            f"verifiers {getattr(vf, '__version__', '?')} has no classic vf.Environment API "
            "(removed in 0.4): pip install 'trident[verifiers]' installs a supported version"
        )
    return vf


def load_environment(env: Any, env_args: dict[str, Any] | None = None) -> Any:
    """The verifiers environment named by ``env`` (id, ``"module:function"`` or the object)."""
    if not isinstance(env, str):
        return env
    if not env:
        raise ValueError("VerifiersEnv needs env=<verifiers environment id or module:function>")
    key = json.dumps([env, env_args or {}], sort_keys=True, default=str)
    if key not in _LOADED:
        vf = _verifiers()
        if ":" in env:
            _LOADED[key] = load_entry_point(env)(**(env_args or {}))
        else:
            _LOADED[key] = vf.load_environment(env, **(env_args or {}))
    return _LOADED[key]


def make_rows(
    n: int,
    split: str = "train",
    seed: int = 0,
    env: str = "",
    env_args: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """``n`` rows of the environment's dataset (``split="test"``: its eval dataset), shuffled
    with ``seed``; no rows when no environment is named. The rows have no SFT demonstration."""
    if not env:
        return []
    vf_env = load_environment(env, env_args)
    data = vf_env.get_dataset(n, seed) if split == "train" else vf_env.get_eval_dataset(n, seed)
    rows = [dict(row) for row in data]
    for row in rows:  # without the None fields that Arrow adds to messages of mixed shapes
        if isinstance(row.get("prompt"), list):
            row["prompt"] = [{k: v for k, v in m.items() if v is not None} for m in row["prompt"]]
    return rows


class EnvironmentTools(ToolSet):
    """Tool schemas shown to the model whose calls the environment runs itself: ``run`` runs
    nothing and returns no results (the environment's replies come as observations)."""

    def __init__(self, schemas: Sequence[dict[str, Any]] = ()) -> None:
        super().__init__()
        self._schemas = list(schemas)

    def __len__(self) -> int:
        return len(self._schemas)

    def __contains__(self, name: str) -> bool:
        return any(s["function"]["name"] == name for s in self._schemas)

    def schemas(self) -> list[dict[str, Any]]:
        return list(self._schemas)

    async def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        return []


class VerifiersEnv:
    """A verifiers environment as a trident ``Env`` (one instance per trajectory)."""

    def __init__(
        self,
        env: Any = "",
        env_args: dict[str, Any] | None = None,
        model: str = "trident",
        sampling_args: dict[str, Any] | None = None,
    ) -> None:
        self.vf = _verifiers()
        self.vf_env = load_environment(env, env_args)
        self.model, self.sampling_args = model, sampling_args
        self.tools: ToolSet = EnvironmentTools()
        self.state: Any = None  # the verifiers rollout state, once the rollout has ended
        self._events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._turns: asyncio.Queue[AssistantTurn] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._seen = 0  # messages of the rollout's conversation that trident already has
        self._call_names: dict[str, str] = {}

    async def reset(self, row: dict[str, Any]) -> list[Message]:
        client = _client_class()(self._events, self._turns)
        rollout = self._rollout(self._rollout_input(row), client)
        self._task = asyncio.create_task(rollout)
        kind, payload = await self._events.get()
        if kind != "prompt":
            self._fail(kind, payload, "before the first model turn")
        prompt, state = payload
        self.tools = EnvironmentTools([_tool_schema(t) for t in state.get("tool_defs") or []])
        self._seen = len(prompt)
        return [_message(m) for m in prompt]

    async def step(self, turn: AssistantTurn, results: list[ToolResult]) -> StepResult:
        self._call_names = {c.id: c.name for c in turn.tool_calls if c.ok}
        await self._turns.put(turn)
        self._seen += 1  # the turn itself
        kind, payload = await self._events.get()
        if kind == "prompt":
            prompt, _ = payload
            if len(prompt) < self._seen or _message(prompt[self._seen - 1])["role"] != "assistant":
                raise InfraError(
                    "the verifiers environment's prompt does not extend the conversation "
                    "(get_prompt_messages rewrites history), which trident cannot train on"
                )
            new, self._seen = prompt[self._seen :], len(prompt)
            return StepResult(observations=[self._observation(m) for m in new])
        if kind != "done":
            self._fail(kind, payload, "during the rollout")
        self.state = state = payload
        error = state.get("error")
        if isinstance(error, self.vf.InfraError):
            raise InfraError(f"verifiers environment: {type(error).__name__}: {error}")
        final = state.get("final_env_response") or []
        metrics = {
            k: float(v)
            for k, v in (state.get("metrics") or {}).items()
            if isinstance(v, int | float)
        }
        return StepResult(
            observations=[self._observation(m) for m in final],
            reward=float(state.get("reward") or 0.0),
            done=True,
            metrics=metrics,
        )

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()  # the rollout's own cleanup handlers still run
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # -- the verifiers side ----------------------------------------------------------------------

    async def _rollout(self, rollout_input: dict[str, Any], client: Any) -> None:
        """The environment's own rollout, then its rubric; ends with a "done" or "error" event."""
        try:
            state = await self.vf_env.rollout(rollout_input, client, self.model, self.sampling_args)
            rubric = self.vf_env.rubric
            await rubric.score_group([state])  # a group of one: group reward functions work too
            await rubric.cleanup(state)
        except Exception as e:
            await self._events.put(("error", e))
            return
        await self._events.put(("done", state))

    def _rollout_input(self, row: dict[str, Any]) -> dict[str, Any]:
        """A dataset row as a verifiers rollout input; a row with a string ``prompt`` or only a
        ``question`` gets the environment's system prompt and few-shot messages."""
        rollout_input = dict(row)
        prompt = row.get("prompt", row.get("question"))
        if prompt is None:
            raise ValueError("a verifiers row needs a 'prompt' (messages) or a 'question'")
        if isinstance(prompt, str):
            system = getattr(self.vf_env, "system_prompt", None)
            messages = [{"role": "system", "content": system}] if system else []
            messages += list(getattr(self.vf_env, "few_shot", None) or [])
            prompt = [*messages, {"role": "user", "content": prompt}]
        rollout_input["prompt"] = prompt
        rollout_input.setdefault("example_id", 0)
        return rollout_input

    def _observation(self, message: Any) -> Message:
        out = _message(message)
        if out["role"] == "tool" and out.get("tool_call_id") in self._call_names:
            out["name"] = self._call_names[out["tool_call_id"]]
        return out

    def _fail(self, kind: str, payload: Any, when: str) -> None:
        if kind == "error":
            raise InfraError(
                f"verifiers environment failed {when}: {type(payload).__name__}: {payload}"
            ) from payload
        error = payload.get("error") if kind == "done" else None
        raise InfraError(f"the verifiers environment ended {when} (error: {error!r})")


def _tool_schema(tool: Any) -> dict[str, Any]:
    get = tool.get if isinstance(tool, dict) else lambda k, d=None: getattr(tool, k, d)
    return {
        "type": "function",
        "function": {
            "name": get("name"),
            "description": get("description", "") or "",
            "parameters": get("parameters") or {"type": "object", "properties": {}},
        },
    }


def _message(message: Any) -> Message:
    """A verifiers message (pydantic or dict) as a trident chat message."""
    raw = message if isinstance(message, dict) else message.model_dump(exclude_none=True)
    out = {k: v for k, v in raw.items() if v is not None}
    calls = out.pop("tool_calls", None)
    if calls:
        out["tool_calls"] = [_call(c) for c in calls]
    out.setdefault("content", "")
    return out


def _call(call: Any) -> dict[str, Any]:
    if not isinstance(call, dict):
        call = call.model_dump()
    if "function" in call:  # already OpenAI-style
        name, arguments = call["function"]["name"], call["function"]["arguments"]
    else:
        name, arguments = call["name"], call["arguments"]
    if isinstance(arguments, str):
        with contextlib.suppress(json.JSONDecodeError):  # unparsable: kept as the text
            arguments = json.loads(arguments) if arguments.strip() else {}
    return {
        "id": call.get("id", ""),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


_CLIENT: type | None = None


def _client_class() -> type:
    """A verifiers ``Client`` whose model is trident (defined on first use: verifiers is an
    optional dependency). ``get_response`` sends the prompt to the adapter as a "prompt" event
    and returns the next assistant turn the adapter receives."""
    global _CLIENT
    if _CLIENT is not None:
        return _CLIENT
    # verifiers 0.3 serves its v0 modules at these names through an import alias, which a
    # type checker cannot follow: import them by name
    Client = importlib.import_module("verifiers.clients").Client
    vf_types = importlib.import_module("verifiers.types")

    class TridentClient(Client):
        def __init__(self, events: asyncio.Queue, turns: asyncio.Queue) -> None:
            super().__init__(None)
            self.events, self.turns = events, turns

        async def get_response(self, prompt, model, sampling_args, tools=None, **kwargs):
            await self.events.put(("prompt", (list(prompt), kwargs.get("state") or {})))
            return self.response(await self.turns.get(), model)

        def response(self, turn: AssistantTurn, model: str) -> Any:
            message = turn.message()
            calls = [
                vf_types.ToolCall(
                    id=c["id"],
                    name=c["function"]["name"],
                    arguments=json.dumps(c["function"]["arguments"]),
                )
                for c in message.get("tool_calls", [])
            ]
            reply = vf_types.ResponseMessage(
                content=message["content"],
                tool_calls=calls or None,
                finish_reason="tool_calls" if calls else "stop",
                is_truncated=False,
            )
            return vf_types.Response(
                id=f"trident-{uuid.uuid4().hex[:12]}",
                created=int(time.time()),
                model=model,
                message=reply,
            )

        # The abstract provider hooks: unused, since get_response is answered directly.
        def setup_client(self, config):
            return None

        async def to_native_tool(self, tool):
            return tool

        async def to_native_prompt(self, messages):
            return messages, {}

        async def get_native_response(self, prompt, model, sampling_args, tools=None, **kw):
            raise NotImplementedError

        async def raise_from_native_response(self, response):
            return None

        async def from_native_response(self, response):
            return response

        async def close(self):
            return None

    _CLIENT = TridentClient
    return _CLIENT
