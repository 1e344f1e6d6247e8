"""Spread requests over the servers that are up, by outstanding load; fan control calls out to
them; take a dead server out at once.

Sessions are sticky: every call with the same ``session_id`` goes to the server that took its
first request, so a multi-turn trajectory reuses that server's prefix cache (a session whose
server went down moves to another one).

A server is taken out (``failed``) when a request to it fails and its ``/health`` does not
answer, or when the periodic health check finds it down; ``on_down(i)`` is then called (the run's
``ServerRecovery`` restarts it) and ``bring_in(i, client)`` puts it back once it holds the served
weights. While fewer than ``min_up`` servers are up, ``available()`` waits; it raises ``fatal``
once recovery has given up.

The fleet is elastic (``trident.rollout.membership``): ``add`` routes to a server that joined
(once it holds the served weights) and ``retire`` stops sending new requests to one that leaves,
whose requests in flight finish where they are.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from trident.rollout.engine import Completion, EngineError, SamplingParams, VLLMClient


class NoServerUp(EngineError):
    """Every rollout server is out (being restarted); ``Router.available()`` waits for one."""


class Router:
    """A ``RolloutEngine`` over several ``VLLMClient``s."""

    def __init__(self, clients: list[VLLMClient]) -> None:
        if not clients:
            raise ValueError("the router needs at least one server")
        self.clients = clients
        self.up = [True] * len(clients)
        self.retired: set[int] = set()  # servers that left: never routed to again
        self.min_up = 1  # available() waits for this many servers up (rollout.min_servers)
        self.on_down: Callable[[int], None] | None = None
        self.fatal: BaseException | None = None  # set when a server cannot be brought back
        self._sessions: dict[str, VLLMClient] = {}
        self._changed: asyncio.Event | None = None  # made in the event loop that waits on it

    @property
    def urls(self) -> list[str]:
        """Every server's url, up or not (trace lanes, the trainer's sync targets)."""
        return [c.url for c in self.clients]

    @property
    def up_urls(self) -> list[str]:
        return [c.url for c, up in zip(self.clients, self.up, strict=True) if up]

    def _up_clients(self) -> list[VLLMClient]:
        return [c for c, up in zip(self.clients, self.up, strict=True) if up]

    def pick(self, session_id: str | None = None) -> VLLMClient:
        """The least-loaded server that is up (sticky per session); ``NoServerUp`` if none is."""
        if self.fatal is not None:
            raise self.fatal
        client = self._sessions.get(session_id) if session_id is not None else None
        if client is None or not self.up[self.clients.index(client)]:
            up = self._up_clients()
            if not up:
                raise NoServerUp("every rollout server is down (being restarted)")
            client = min(up, key=lambda c: c.outstanding)
            if session_id is not None:
                self._sessions[session_id] = client
        return client

    def end_session(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    async def available(self) -> None:
        """Return once a server is up; raise ``fatal`` once recovery has given up."""
        while True:
            if self.fatal is not None:
                raise self.fatal
            if sum(self.up) >= self.min_up:
                return
            if self._changed is None:
                self._changed = asyncio.Event()
            self._changed.clear()
            await self._changed.wait()

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()

    async def failed(self, server: object, error: BaseException) -> bool:
        """Called after a request to ``server`` (a client ``pick`` gave) raised ``error``: True
        if the server is down (it is taken out; resubmit the request elsewhere), False if it
        still answers ``/health`` (the error is the request's own; raise it)."""
        if isinstance(error, NoServerUp):
            return True
        i = next(i for i, c in enumerate(self.clients) if c is server)
        if not self.up[i]:
            return True
        if await self.clients[i].healthy():
            return False
        self.take_out(i)
        return True

    async def check(self, answer_within_s: float = 0.0) -> int:
        """Ask every up server's ``/health``; take out those that do not answer; how many.
        ``answer_within_s``: each must also generate a token within that long (after a failed
        weight sync: a frozen engine answers ``/health``, not the sync)."""
        up = [i for i, u in enumerate(self.up) if u]
        if answer_within_s > 0:
            answers = await asyncio.gather(
                *(self.clients[i].responsive(answer_within_s) for i in up)
            )
        else:
            answers = await asyncio.gather(*(self.clients[i].healthy() for i in up))
        dead = [i for i, ok in zip(up, answers, strict=True) if not ok]
        for i in dead:
            self.take_out(i)
        return len(dead)

    def take_out(self, i: int) -> None:
        """Stop sending to server ``i`` at once and tell ``on_down``."""
        if not self.up[i]:
            return
        gone = self._stop_routing(i)
        if self.on_down is not None:
            self.on_down(i)
        else:  # nothing restarts servers here: a dead one ends what depends on it
            self.give_up(EngineError(f"rollout server {i} ({gone.url}) is down"))
        self._notify()

    def add(self, client: VLLMClient) -> int:
        """Route to ``client`` (a server that joined, holding the served weights); its index."""
        self.clients.append(client)
        self.up.append(True)
        self._notify()
        return len(self.clients) - 1

    def retire(self, i: int) -> None:
        """Send server ``i`` nothing new, for good (it leaves); what it has in flight goes on."""
        self.retired.add(i)
        self._stop_routing(i)
        self._notify()

    def _stop_routing(self, i: int) -> VLLMClient:
        """Server ``i`` gets no new request; the sessions pinned to it move on their next one."""
        self.up[i] = False
        gone = self.clients[i]
        self._sessions = {k: c for k, c in self._sessions.items() if c is not gone}
        return gone

    def bring_in(self, i: int, client: VLLMClient) -> None:
        """Server ``i`` is back (``client``), holding the served weights."""
        self.clients[i] = client
        self.up[i] = True
        self._notify()

    def give_up(self, error: BaseException) -> None:
        """Recovery failed: every waiting and later request raises ``error``."""
        self.fatal = error
        self._notify()

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, session_id: str | None = None
    ) -> list[Completion]:
        """One request on a server that is up; resubmitted whole to another (or the restarted
        one) if its server dies under it."""
        while True:
            await self.available()
            client = self.pick(session_id)
            try:
                return await client.generate(prompt_ids, params, session_id)
            except EngineError as e:
                if not await self.failed(client, e):
                    raise

    async def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        return await self.pick().prompt_logprobs(token_ids)

    async def pause(self) -> None:
        await asyncio.gather(*(c.pause() for c in self._up_clients()))

    async def resume(self) -> None:
        await asyncio.gather(*(c.resume() for c in self._up_clients()))

    async def abort(self) -> int:
        """Abort every in-flight request on every server that is up; returns how many (a server
        found dead meanwhile is taken out: its requests fail and are resubmitted)."""
        return sum(await self._each_up(lambda c: c.abort(), 0))

    async def reset_prefix_cache(self) -> bool:
        """Reset every up server's prefix cache; True only if all of them did."""
        return all(await self._each_up(lambda c: c.reset_prefix_cache(), True))

    async def sleep(self, level: int) -> None:
        """Put every up server to sleep (``VLLMClient.sleep``)."""
        await self._each_up(lambda c: c.sleep(level), None)

    async def wake_up(self) -> None:
        """Wake every up server (``VLLMClient.wake_up``)."""
        await self._each_up(lambda c: c.wake_up(), None)

    async def _each_up(
        self, call: Callable[[VLLMClient], Awaitable[Any]], if_down: Any
    ) -> list[Any]:
        """``call`` on every up server at once; a server that fails it and is down counts as
        ``if_down`` (and is taken out), one that fails it and answers raises."""
        clients = self._up_clients()
        results = await asyncio.gather(*(call(c) for c in clients), return_exceptions=True)
        out = []
        for client, result in zip(clients, results, strict=True):
            if isinstance(result, BaseException):
                if not isinstance(result, EngineError) or not await self.failed(client, result):
                    raise result
                result = if_down
            out.append(result)
        return out

    async def aclose(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self.clients))
