"""Spread requests over several servers by outstanding load; fan control calls out to all.

Sessions are sticky: every call with the same ``session_id`` goes to the server that took its
first request, so a multi-turn trajectory reuses that server's prefix cache.
"""

from __future__ import annotations

import asyncio

from trident.rollout.engine import Completion, SamplingParams, VLLMClient


class Router:
    """A ``RolloutEngine`` over several ``VLLMClient``s."""

    def __init__(self, clients: list[VLLMClient]) -> None:
        if not clients:
            raise ValueError("the router needs at least one server")
        self.clients = clients
        self._sessions: dict[str, VLLMClient] = {}

    @property
    def urls(self) -> list[str]:
        return [c.url for c in self.clients]

    def pick(self, session_id: str | None = None) -> VLLMClient:
        if session_id is not None and session_id in self._sessions:
            return self._sessions[session_id]
        client = min(self.clients, key=lambda c: c.outstanding)
        if session_id is not None:
            self._sessions[session_id] = client
        return client

    def end_session(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, session_id: str | None = None
    ) -> list[Completion]:
        return await self.pick(session_id).generate(prompt_ids, params, session_id)

    async def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        return await self.pick().prompt_logprobs(token_ids)

    async def pause(self) -> None:
        await asyncio.gather(*(c.pause() for c in self.clients))

    async def resume(self) -> None:
        await asyncio.gather(*(c.resume() for c in self.clients))

    async def abort(self) -> int:
        """Abort every in-flight request on every server; returns how many were aborted."""
        return sum(await asyncio.gather(*(c.abort() for c in self.clients)))

    async def reset_prefix_cache(self) -> bool:
        """Reset every server's prefix cache; True only if all of them did."""
        return all(await asyncio.gather(*(c.reset_prefix_cache() for c in self.clients)))

    async def healthy(self) -> bool:
        return all(await asyncio.gather(*(c.healthy() for c in self.clients)))

    async def aclose(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self.clients))
