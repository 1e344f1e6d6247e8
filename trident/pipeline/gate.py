"""The weight version the servers serve, and the door every generation request goes through.

A weight update, in every mode (``WeightGate.update``):

1. close the gate: new requests (fresh or resumed) wait;
2. abort every in-flight request (``/abort_requests``) and wait until each has come back with its
   partial output; the abort is repeated until nothing of ours is in flight, because a request
   still on its way into the engine misses an abort;
3. push and verify the new weights (``WeightSender.push``) on the servers that are up (a
   server being restarted gets the served version when it rejoins: ``trident.pipeline.recovery``);
   a server that died since its last request is found by a health check first, and one that dies
   during the push or before its verification fails it, is taken out, and the push is repeated
   once without it (``WeightSync.push`` sends it only to servers that do not hold it yet);
4. reset every server's prefix cache (``/reset_prefix_cache``), so no request reuses KV blocks
   computed by the old weights (a prompt seen again in a later epoch would otherwise be served
   from the old policy's cache);
5. bump the served version and open the gate.

In ``sync`` and ``colocate_async`` nothing is in flight when a step installs its weights, so
steps 1-2 cost nothing; in ``separate_async`` they are what makes partial rollout exact. One
update or rejoin at a time (``exclusive``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

from trident.rollout.engine import Completion, EngineError, SamplingParams


class Server(Protocol):
    """One rollout server as the drivers use it (``trident.rollout.engine.VLLMClient``)."""

    url: str

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, session_id: str | None = None
    ) -> list[Completion]:
        """Called for every request (a whole group, or one sample's segment)."""
        ...


class ServerPool(Protocol):
    """The rollout servers as the drivers use them (``trident.rollout.router.Router``)."""

    @property
    def urls(self) -> list[str]: ...

    @property
    def up_urls(self) -> list[str]:
        """The servers a weight update goes to (the others are down, being restarted)."""
        ...

    def pick(self, session_id: str | None = None) -> Server:
        """Called for each request: the least-loaded server that is up (sticky per session)."""
        ...

    def end_session(self, session_id: str) -> None:
        """Called when a session's requests are done: its server is no longer kept for it."""
        ...

    async def available(self) -> None:
        """Called before each request: returns once a server is up (one may be restarting)."""
        ...

    async def failed(self, server: Server, error: BaseException) -> bool:
        """Called when a request fails: True if ``server`` is down (resubmit elsewhere)."""
        ...

    async def abort(self) -> int:
        """Called by a weight update: abort every in-flight request on every server."""
        ...

    async def reset_prefix_cache(self) -> bool:
        """Called by a weight update once nothing is in flight."""
        ...

    async def sleep(self, level: int) -> None:
        """Called by ``WeightGate.asleep`` with nothing in flight: free the engines' memory."""
        ...

    async def wake_up(self) -> None:
        """Called by ``WeightGate.asleep`` before the next install."""
        ...

    async def check(self, answer_within_s: float = 0.0) -> int:
        """Called by a weight update before it pushes (and after a push fails): take out the
        servers that do not answer (``answer_within_s``: or do not generate a token within that
        long); returns how many."""
        ...


class WeightGate:
    """See the module docstring for the update protocol."""

    def __init__(
        self,
        servers: ServerPool,
        version: int = 0,
        answer_within_s: float = 0.0,
        sleep_level: int = 0,
    ) -> None:
        """``answer_within_s``: after a failed push, a server that does not generate a token
        within that long is taken out (and restarted) like a dead one; ``sleep_level``: how
        deep the engines sleep in ``asleep`` (``rollout.sleep_level``; 0: they do not)."""
        self.servers, self.version = servers, version
        self.answer_within_s, self.sleep_level = answer_within_s, sleep_level
        self.inflight = 0
        self._open = asyncio.Event()
        self._open.set()
        self._drained = asyncio.Event()
        self._drained.set()
        self._lock = asyncio.Lock()  # one update (or a restarted server's rejoin) at a time

    def exclusive(self) -> asyncio.Lock:
        """Held by ``update``; a rejoining server holds it too (``async with gate.exclusive()``)."""
        return self._lock

    async def enter(self) -> int:
        """Called before each request segment; returns the version that will serve it."""
        while not self._open.is_set():
            await self._open.wait()
        self.inflight += 1
        self._drained.clear()
        return self.version

    def leave(self) -> None:
        """Called when a request segment has returned (finished or aborted)."""
        self.inflight -= 1
        if self.inflight == 0:
            self._drained.set()

    async def close_and_drain(self) -> int:
        """Stop new segments, abort the running ones and wait until all are back."""
        self._open.clear()
        aborted = 0
        while self.inflight:
            aborted += await self.servers.abort()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drained.wait(), timeout=0.05)
        return aborted

    def reopen(self) -> None:
        """Let requests through again after ``close_and_drain`` (e.g. once a checkpoint is
        written)."""
        self._open.set()

    @contextlib.asynccontextmanager
    async def asleep(self) -> AsyncIterator[None]:
        """Around ``sync`` mode's train stage: the gate closed, the engines asleep
        (``sleep_level``), their GPU memory lent to the trainer ranks on the same devices; awake
        again before the install that follows (which pushes the new weights, whole after a
        level-2 sleep). Nothing is in flight then, so nothing is aborted."""
        if not self.sleep_level:
            yield
            return
        async with self._lock:
            await self.close_and_drain()
            await self.servers.sleep(self.sleep_level)
        try:
            yield
        finally:
            async with self._lock:
                await self.servers.wake_up()
                self._open.set()

    async def _push(self, push: Callable[[list[str]], Awaitable[dict[str, float]]]) -> dict:
        await self.servers.check()
        urls = self.servers.up_urls
        try:
            return await push(urls)
        except Exception:
            # A server that froze during the sync (its engine core stopped) fails the sync's
            # calls by timeout while its /health still answers: a token is asked of each.
            await self.servers.check(self.answer_within_s)
            # Every server pushed to is still up: the push itself failed. (A server taken out
            # meanwhile, by this check or by a failed request, is left out of the retry.)
            if set(urls) <= set(self.servers.up_urls):
                raise
        return await push(self.servers.up_urls)

    async def update(
        self, version: int, push: Callable[[list[str]], Awaitable[dict[str, float]]]
    ) -> dict[str, float]:
        """Install ``version`` with ``push(urls)`` (the servers up) while nothing generates;
        reopen afterwards."""
        async with self._lock:
            try:
                aborted = await self.close_and_drain()
                metrics = await self._push(push)
                if not await self.servers.reset_prefix_cache():
                    raise EngineError("a server refused /reset_prefix_cache with nothing in flight")
                self.version = version
            finally:
                self._open.set()
        return {**metrics, "aborted_requests": float(aborted)}
