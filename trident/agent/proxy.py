"""An OpenAI-compatible proxy that turns an unmodified agent program into training data.

The agent program uses the ``openai`` client with ``base_url = proxy.session_url(session_id)``
and does whatever it does (its own tool execution, its own loop). Each chat-completions call is
served from a ``RolloutEngine`` token-in/token-out, exactly as the agent loop does it:

- the first call's messages are rendered with the chat template (with the request's ``tools``);
- a later call must repeat the conversation so far (including the assistant replies the proxy
  returned); only its new messages (tool results, user turns) are rendered, as observation
  tokens, and appended after the tokens the engine produced;
- the engine's reply ids are appended as they are (trained, with their logprobs), and the reply
  is parsed into OpenAI ``tool_calls`` by the same parser as the agent loop.

When the episode is over, whoever judges it (the environment) calls
``proxy.collect(session_id, reward)`` and gets the Samples. An agent that rewrites its history
(drops or edits earlier messages) cannot be continued token-exactly: that call starts a new
segment, and ``collect`` returns one Sample per segment (``metadata["segment"]``).

Deliberate simplifications: ``n = 1``; no streaming; no trajectory budgets (the agent program
owns its loop; ``max_tokens`` per call is honoured); malformed tool calls cannot be expressed in
the OpenAI schema, so they reach the agent as text (and are counted as parse errors).
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from trident.agent.loop import Trajectory
from trident.envs import Message
from trident.rollout.engine import EngineError, RolloutEngine, SamplingParams
from trident.sample import Sample
from trident.tools.parsers import AssistantTurn, get_parser


def _normalized(message: dict[str, Any]) -> tuple:
    """What must match for a repeated message to count as the same one."""
    calls = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call)
        arguments = fn.get("arguments", {})
        if isinstance(arguments, str):
            with contextlib.suppress(json.JSONDecodeError):
                arguments = json.loads(arguments)
        calls.append((fn.get("name"), json.dumps(arguments, sort_keys=True)))
    return (message.get("role"), message.get("content") or "", tuple(calls))


@dataclass
class _Session:
    segments: list[Trajectory] = field(default_factory=list)


def _reply_message(turn: AssistantTurn) -> dict[str, Any]:
    """The OpenAI assistant message for a parsed turn (arguments as JSON strings)."""
    message = turn.message()
    calls = [
        {
            "id": c["id"],
            "type": "function",
            "function": {
                "name": c["function"]["name"],
                "arguments": json.dumps(c["function"]["arguments"]),
            },
        }
        for c in message.get("tool_calls", [])
    ]
    return {"role": "assistant", "content": message["content"] or None, "tool_calls": calls or None}


class AgentProxy:
    """``/s/<session>/v1/chat/completions`` in front of a ``RolloutEngine``; records trajectories."""

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: Any,
        params: SamplingParams,
        version: int,
        *,
        parser: str = "hermes",
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.engine, self.tokenizer, self.params, self.version = engine, tokenizer, params, version
        self.parser = get_parser(parser)
        self.host, self.port = host, port
        self.sessions: dict[str, _Session] = {}
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        """Serve on the running event loop; returns the base URL."""
        app = web.Application()
        app.router.add_post("/s/{session}/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # the bound port when port=0
        return f"http://{self.host}:{self.port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def session_url(self, session_id: str) -> str:
        """The ``base_url`` to give the agent program for one episode."""
        return f"http://{self.host}:{self.port}/s/{session_id}/v1"

    def collect(
        self,
        session_id: str,
        reward: float,
        row: dict[str, Any] | None = None,
        group_id: str | None = None,
    ) -> list[Sample]:
        """End the episode: one Sample per segment, each with ``reward``, in group ``group_id``
        (default: the session's own)."""
        session = self.sessions.pop(session_id, _Session())
        end_session = getattr(self.engine, "end_session", None)
        if end_session is not None:
            end_session(session_id)
        samples = []
        for k, traj in enumerate(session.segments):
            sample = traj.to_sample(f"{session_id}-{k}", group_id or session_id, reward, row or {})
            sample.metadata["segment"] = k
            samples.append(sample)
        return samples

    def _trajectory(self, session_id: str, messages: list[Message], tools: Any) -> Trajectory:
        """The segment this request continues (its new messages appended), or a new one."""
        session = self.sessions.setdefault(session_id, _Session())
        if session.segments:
            traj = session.segments[-1]
            known = traj.conversation
            same_tools = traj.tools == (tools or None)
            repeats = [_normalized(m) for m in messages[: len(known)]] == [
                _normalized(m) for m in known
            ]
            if same_tools and repeats and len(messages) > len(known):
                new = messages[len(known) :]
                traj.add_observations(traj.renderer.ids(new, traj.turn_closed))
                traj.conversation += new
                return traj
        traj = Trajectory(self.tokenizer, messages, tools or None)
        session.segments.append(traj)
        return traj

    async def _chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("n", 1) != 1 or body.get("stream"):
            return web.json_response(
                {"error": {"message": "only n=1 without streaming"}}, status=400
            )
        session_id = request.match_info["session"]
        traj = self._trajectory(session_id, body["messages"], body.get("tools"))
        params = SamplingParams(
            n=1,
            temperature=body.get("temperature", self.params.temperature),
            top_p=body.get("top_p", self.params.top_p),
            max_tokens=body.get("max_completion_tokens")
            or body.get("max_tokens")
            or self.params.max_tokens,
            stop=self.params.stop,
            seed=body.get("seed", self.params.seed),
        )
        try:
            completion = (await self.engine.generate(traj.ids, params, session_id=session_id))[0]
        except EngineError as e:
            traj.end("infra_error", None)
            traj.error = str(e)
            return web.json_response({"error": {"message": str(e)}}, status=502)
        turn = self.parser.parse(traj.add_turn(completion, self.version))
        traj.count_calls(turn, [])
        reply = _reply_message(turn)
        traj.conversation.append(turn.message())  # structured arguments, as the template wants
        finish = {"length": "length", "abort": "length"}.get(completion.finish_reason, "stop")
        if completion.finish_reason == "length":
            traj.end("truncated", "turn_tokens")
        if finish == "stop" and reply["tool_calls"]:
            finish = "tool_calls"
        prompt_tokens = len(traj.ids) - len(completion.token_ids)
        return web.json_response(
            {
                "id": f"chatcmpl-{uuid.uuid4().hex}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.get("model", "policy"),
                "choices": [{"index": 0, "message": reply, "finish_reason": finish}],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": len(completion.token_ids),
                    "total_tokens": len(traj.ids),
                },
            }
        )
