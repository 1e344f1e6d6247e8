"""Run an OpenEnv environment as a trident environment (``pip install 'trident[openenv]'``).

OpenEnv (Meta's ``openenv`` package) environments are Gym-style: ``reset()`` and ``step(action)``
return an observation (a pydantic model of the environment's fields) with ``reward`` and
``done``; they usually run as servers (``create_app`` / ``create_fastapi_app``) that clients
drive through one WebSocket session per episode. ``OpenEnvEnv`` is one such session per
trajectory, either with a server (``url="http://host:port"``, through OpenEnv's
``GenericEnvClient``) or with an ``Environment`` class run in-process (``env="module:Class"``;
its action class is read from the class's ``Environment[Action, Observation, State]`` base, or
given as ``action="module:ActionClass"``).

The mapping to chat:

- ``reset(row)``: the environment is reset with ``reset_kwargs`` (the adapter's, updated by the
  row's ``reset_kwargs``: e.g. ``{"seed": 3}`` so that a group's trajectories play the same
  episode); the first messages are ``system_prompt`` (if any) and a user message with the row's
  ``prompt`` (instructions, if any) followed by the observation's text.
- Observation text: the ``observation_field`` of the observation if set, the only field if there
  is one, else the fields as JSON (``metadata``, ``reward`` and ``done`` are never shown).
- Actions, text mode (default): the assistant turn's text is the value of ``action_field`` of
  the action (``{"message": text}``); the next observation is a user message.
- Actions, tool mode (``tool="act"``): the model calls a tool of that name whose arguments are
  the action's fields (its JSON schema comes from the server's ``/schema`` or the action class);
  each call is one environment step, run in call order, and its result is the observation's
  text. A turn without tool calls ends the episode.
- Rewards: the sum of the step rewards of the turn (``None`` when the environment gave none);
  ``done`` ends the trajectory.

A server that cannot be reached or fails is an ``InfraError`` (the sample is marked
``infra_error``); an action the environment rejects in tool mode is a tool error the model reads.
Deliberate simplifications: text observations only (images and other media are shown as JSON);
the episode's ``state()`` is not read.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import typing
from collections.abc import Callable
from typing import Any

from trident.envs import Message, StepResult
from trident.envs.adapters import require
from trident.registry import load_entry_point
from trident.sandbox import InfraError
from trident.tools.parsers import AssistantTurn
from trident.tools.toolset import Tool, ToolError, ToolInfraError, ToolResult, ToolSet

Outcome = dict[str, Any]  # {"observation": {...}, "reward": float | None, "done": bool}
_NOT_SHOWN = {"metadata", "reward", "done"}  # observation fields that are not for the model


def _load(entry: str | Any) -> Any:
    if not isinstance(entry, str):
        return entry
    return load_entry_point(entry)


def make_rows(
    n: int,
    split: str = "train",
    seed: int = 0,
    prompt: str = "",
    reset_kwargs: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """``n`` rows, each one seeded episode (``reset_kwargs.seed``); train and test seeds are
    disjoint. ``messages`` is empty: there is no SFT demonstration."""
    start = seed * 1_000_003 % 1_000_000_000 + (0 if split == "train" else 1_000_000_000)
    rows = []
    for i in range(n):
        row: dict[str, Any] = {
            "reset_kwargs": {**(reset_kwargs or {}), "seed": start + i},
            "messages": [],
        }
        if prompt:
            row["prompt"] = prompt
        rows.append(row)
    return rows


class _RemoteSession:
    """One WebSocket session with an OpenEnv server."""

    def __init__(self, url: str, timeout_s: float) -> None:
        from openenv.core.generic_client import GenericEnvClient

        self.url, self.timeout_s = url.rstrip("/"), timeout_s
        self.client = GenericEnvClient(
            base_url=self.url, connect_timeout_s=timeout_s, message_timeout_s=timeout_s
        )

    async def reset(self, **kwargs: Any) -> Outcome:
        return self._outcome(await self.client.reset(**kwargs))

    async def step(self, action: dict[str, Any]) -> Outcome:
        return self._outcome(await self.client.step(action))

    async def action_schema(self) -> dict[str, Any]:
        import httpx

        async with httpx.AsyncClient(timeout=self.timeout_s) as http:
            response = await http.get(f"{self.url}/schema")
            response.raise_for_status()
            return response.json()["action"]

    async def close(self) -> None:
        with contextlib.suppress(Exception):  # the server may be gone already
            await asyncio.wait_for(self.client.close(), self.timeout_s)

    @staticmethod
    def _outcome(result: Any) -> Outcome:
        return {"observation": result.observation, "reward": result.reward, "done": result.done}


class _LocalSession:
    """An OpenEnv ``Environment`` object in this process, serialized like a server's replies."""

    def __init__(self, factory: Callable[[], Any], action: str | type | None) -> None:
        from openenv.core.env_server.serialization import serialize_observation

        self.serialize = serialize_observation
        self.env = factory()
        self.action_cls = _load(action) if action else _action_class(type(self.env))

    async def reset(self, **kwargs: Any) -> Outcome:
        return self.serialize(await self.env.reset_async(**kwargs))

    async def step(self, action: dict[str, Any]) -> Outcome:
        from pydantic import ValidationError

        try:
            parsed = self.action_cls.model_validate(action)
        except ValidationError as e:
            raise ToolError(f"invalid action: {e}") from e
        return self.serialize(await self.env.step_async(parsed))

    async def action_schema(self) -> dict[str, Any]:
        return self.action_cls.model_json_schema()

    async def close(self) -> None:
        self.env.close()


def _action_class(env_cls: type) -> type:
    """The ``Action`` type argument of an ``Environment[Action, Observation, State]`` subclass."""
    from openenv.core.env_server.types import Action

    for klass in env_cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            for arg in typing.get_args(base):
                if isinstance(arg, type) and issubclass(arg, Action):
                    return arg
    raise ValueError(f"cannot tell the action class of {env_cls.__name__}: pass action=")


class OpenEnvEnv:
    """An OpenEnv environment as a trident ``Env`` (one session per trajectory)."""

    def __init__(
        self,
        url: str = "",
        env: str | Callable[[], Any] = "",
        action: str | type | None = None,
        action_field: str = "message",
        tool: str = "",
        tool_description: str = "Act in the environment; returns what you observe.",
        observation_field: str = "",
        system_prompt: str = "",
        reset_kwargs: dict[str, Any] | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        if bool(url) == bool(env):
            raise ValueError("OpenEnvEnv needs exactly one of url= (a server) or env= (a class)")
        require("openenv.core", "openenv")
        self.url, self.env, self.action = url, _load(env) if env else None, action
        self.action_field, self.tool, self.tool_description = action_field, tool, tool_description
        self.observation_field, self.system_prompt = observation_field, system_prompt
        self.reset_kwargs, self.timeout_s = dict(reset_kwargs or {}), timeout_s
        self.tools = ToolSet()
        self.done = False
        self._session: _RemoteSession | _LocalSession | None = None
        self._rewards: list[float] = []  # rewards of the current turn's steps
        self._lock = asyncio.Lock()  # one step at a time, in call order

    async def reset(self, row: dict[str, Any]) -> list[Message]:
        self._session = (
            _LocalSession(self.env, self.action)
            if self.env is not None
            else _RemoteSession(self.url, self.timeout_s)
        )
        kwargs = {**self.reset_kwargs, **row.get("reset_kwargs", {})}
        first = await self._call(self._session.reset(**kwargs))
        self.done, self._rewards = bool(first["done"]), []
        if self.tool:
            schema = await self._call(self._session.action_schema())
            self.tools = ToolSet([self._action_tool(schema)])
        text = self.render(first["observation"])
        if row.get("prompt"):
            text = f"{row['prompt']}\n\n{text}"
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": text}]

    async def step(self, turn: AssistantTurn, results: list[ToolResult]) -> StepResult:
        if self.tool:  # the tool calls stepped the environment already
            rewards, self._rewards = self._rewards, []
            done = self.done or not turn.tool_calls
            return StepResult(reward=sum(rewards) if rewards else None, done=done)
        outcome = await self._act({self.action_field: turn.content.strip()})
        message = {"role": "user", "content": self.render(outcome["observation"])}
        reward = outcome["reward"]
        return StepResult(
            observations=[message],
            reward=None if reward is None else float(reward),
            done=bool(outcome["done"]),
        )

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    def render(self, observation: dict[str, Any]) -> str:
        """The text the model reads for an observation."""
        observation = {k: v for k, v in observation.items() if k not in _NOT_SHOWN}
        if self.observation_field:
            value = observation.get(self.observation_field, "")
        elif len(observation) == 1:
            (value,) = observation.values()
        else:
            value = observation
        return value if isinstance(value, str) else json.dumps(value, default=str)

    # -- stepping ----------------------------------------------------------------------------------

    async def _act(self, action: dict[str, Any]) -> Outcome:
        async with self._lock:
            if self._session is None:
                raise InfraError("OpenEnvEnv.step before reset")
            if self.done:
                raise ToolError("the episode is over")
            outcome = await self._call(self._session.step(action))
            self.done = bool(outcome["done"])
            return outcome

    async def _call(self, request: typing.Awaitable[Any]) -> Any:
        """Await a request to the environment: its failures are the infrastructure's, except an
        action it rejects (a tool error for the model)."""
        try:
            return await asyncio.wait_for(request, self.timeout_s)
        except (ToolError, InfraError):
            raise
        except Exception as e:
            if "VALIDATION_ERROR" in str(e):  # a server's reply to an invalid action
                raise ToolError(f"invalid action: {e}") from e
            where = self.url or getattr(self.env, "__name__", "the environment")
            raise InfraError(f"OpenEnv environment {where}: {type(e).__name__}: {e}") from e

    def _action_tool(self, schema: dict[str, Any]) -> Tool:
        properties = {k: v for k, v in schema.get("properties", {}).items() if k != "metadata"}
        parameters = {
            "type": "object",
            "properties": properties,
            "required": [k for k in schema.get("required", []) if k in properties],
        }
        if "$defs" in schema:  # nested models of the action
            parameters["$defs"] = schema["$defs"]

        async def act(**arguments: Any) -> str:
            try:
                outcome = await self._act(arguments)
            except InfraError as e:  # the loop marks the sample infra_error, not the model
                raise ToolInfraError(str(e)) from e
            if outcome["reward"] is not None:
                self._rewards.append(float(outcome["reward"]))
            return self.render(outcome["observation"])

        return Tool(self.tool, self.tool_description, parameters, act, self.timeout_s)
