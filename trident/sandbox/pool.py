"""The local ``Sandbox``: bubblewrap runs under a concurrency limit, and stateful sessions.

``SandboxPool`` owns one event loop on a private thread. Every sandbox process it starts lives on
that loop, so synchronous callers (``run``, ``Session.exec``) and asyncio callers on any loop
(``run_async``, ``exec_async``) share one concurrency limit (an ``asyncio.Semaphore``) and one
set of sessions; calls hop onto the pool's loop with ``run_coroutine_threadsafe``.

- Runs: each ``run`` gets a fresh sandbox (empty work dir, new namespaces), started cold;
  at most ``max_concurrency`` runs and session calls execute at once, the rest wait their turn.
- Sessions: one sandbox per session holding a persistent Python REPL and a bash shell (the agent
  in ``trident.sandbox.bwrap``). ``warm_sessions`` agents are started ahead of demand: an agent
  is a Python interpreter to start on top of bwrap (open + first call ~90 ms cold, ~5 ms from the
  warm pool on the 2-core dev host; ``benchmarks/results/sandbox.md``).
- Cleanup is guaranteed three ways: ``close()``/``with`` kills the sandbox at once; a finaliser
  kills it when the handle is garbage-collected; a reaper task kills sessions idle for longer
  than their ``ttl_s``. A session call that times out (or whose code kills the agent) kills the
  session too: its state is no longer trustworthy. And since every sandbox dies with the process
  that started it (PDEATHSIG, see ``trident.sandbox.bwrap``), nothing outlives the pool's process.

Deliberate simplifications: the TTL is an idle timeout checked every ``reap_interval_s``; one
call at a time per session (concurrent calls queue on the session's lock); a session holds no
run slot while idle, only during a call; ``max_sessions`` bounds memory (an idle session is one
Python process plus, once used, one bash).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
import time
import uuid
import weakref
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from trident.sandbox.base import SandboxResult, SessionClosedError, SessionKind
from trident.sandbox.bwrap import AgentProcess, BwrapSandbox

_T = TypeVar("_T")


@dataclass
class _SessionState:
    ttl_s: float
    agent: asyncio.Future[AgentProcess]
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_used: float = field(default_factory=time.monotonic)
    busy: bool = False


class PoolSession:
    """Handle to one session of a ``SandboxPool`` (implements ``trident.sandbox.Session``)."""

    def __init__(self, pool: SandboxPool, session_id: str) -> None:
        self.id = session_id
        self._pool = pool
        self._finalizer = weakref.finalize(self, pool._discard_session, session_id)

    def exec(
        self, code: str, *, kind: SessionKind = "python", timeout_s: float = 30.0
    ) -> SandboxResult:
        return self._pool._call(self._pool._exec(self.id, code, kind, timeout_s))

    async def exec_async(
        self, code: str, *, kind: SessionKind = "python", timeout_s: float = 30.0
    ) -> SandboxResult:
        return await self._pool._call_async(self._pool._exec(self.id, code, kind, timeout_s))

    @property
    def pid(self) -> int | None:
        """Host pid of the session's bwrap process; None before it started or once it ended."""
        return self._pool._call(self._pool._session_pid(self.id))

    def close(self) -> None:
        if self._finalizer.detach() is not None:
            self._pool._close_session_and_wait(self.id)

    def __enter__(self) -> PoolSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SandboxPool:
    """Local bubblewrap ``Sandbox`` with a concurrency limit and pre-warmed session sandboxes."""

    def __init__(
        self,
        backend: BwrapSandbox | None = None,
        *,
        max_concurrency: int | None = None,
        warm_sessions: int = 0,
        max_sessions: int = 64,
        reap_interval_s: float = 1.0,
    ) -> None:
        self._owns_backend = backend is None
        self.backend = backend or BwrapSandbox()
        self.max_concurrency = max_concurrency or os.cpu_count() or 1
        self.warm_sessions = warm_sessions
        self.max_sessions = max_sessions
        self.reap_interval_s = reap_interval_s
        self._slots = asyncio.Semaphore(self.max_concurrency)  # binds to the pool loop on use
        self._sessions: dict[str, _SessionState] = {}  # touched on the pool loop only
        self._warm: list[AgentProcess] = []
        self._warming = 0
        self._background: set[asyncio.Future[Any]] = set()  # refills, on the pool loop
        self._live_lock = threading.Lock()
        self._live: set[str] = set()
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="trident-sandbox-pool", daemon=True
        )
        self._thread.start()
        self._reaper = self._submit(self._reap_forever())
        self._loop.call_soon_threadsafe(self._start_refill)

    # -- Sandbox protocol --------------------------------------------------------------------

    def run(
        self,
        cmd: list[str],
        *,
        stdin: str | bytes = b"",
        files: Mapping[str, str | bytes] | None = None,
        timeout_s: float = 10.0,
        memory_mb: int = 1024,
        env: Mapping[str, str] | None = None,
    ) -> SandboxResult:
        return self._call(self._run(cmd, stdin, files, timeout_s, memory_mb, env))

    async def run_async(
        self,
        cmd: list[str],
        *,
        stdin: str | bytes = b"",
        files: Mapping[str, str | bytes] | None = None,
        timeout_s: float = 10.0,
        memory_mb: int = 1024,
        env: Mapping[str, str] | None = None,
    ) -> SandboxResult:
        return await self._call_async(self._run(cmd, stdin, files, timeout_s, memory_mb, env))

    def open_session(self, *, ttl_s: float = 600.0, memory_mb: int = 1024) -> PoolSession:
        if ttl_s <= 0 or memory_mb <= 0:
            raise ValueError("ttl_s and memory_mb must be positive")
        session_id = uuid.uuid4().hex
        with self._live_lock:
            if self._closed:
                raise RuntimeError("sandbox pool is closed")
            if len(self._live) >= self.max_sessions:
                raise RuntimeError(f"too many open sessions (max_sessions={self.max_sessions})")
            self._live.add(session_id)
        self._submit(self._open(session_id, ttl_s, memory_mb))
        return PoolSession(self, session_id)

    def close(self) -> None:
        with self._live_lock:
            if self._closed:
                return
            self._closed = True
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        if not self._thread.is_alive():
            self._loop.close()
        if self._owns_backend:
            self.backend.close()

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def is_open(self, session_id: str) -> bool:
        """Whether the session is still open (not closed, expired or killed)."""
        with self._live_lock:
            return session_id in self._live

    @property
    def open_sessions(self) -> int:
        """Sessions opened and not yet closed, expired or killed."""
        with self._live_lock:
            return len(self._live)

    # -- plumbing between the caller's thread/loop and the pool's loop --------------------------

    def _submit(self, coro: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
        if self._closed and not self._thread.is_alive():
            coro.close()
            raise RuntimeError("sandbox pool is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _call(self, coro: Coroutine[Any, Any, _T]) -> _T:
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("blocking SandboxPool call from the pool's own loop")
        return self._submit(coro).result()

    async def _call_async(self, coro: Coroutine[Any, Any, _T]) -> _T:
        return await asyncio.wrap_future(self._submit(coro))

    # -- on the pool loop ----------------------------------------------------------------------

    async def _run(
        self,
        cmd: list[str],
        stdin: str | bytes,
        files: Mapping[str, str | bytes] | None,
        timeout_s: float,
        memory_mb: int,
        env: Mapping[str, str] | None,
    ) -> SandboxResult:
        async with self._slots:
            return await self.backend.run_async(
                cmd, stdin=stdin, files=files, timeout_s=timeout_s, memory_mb=memory_mb, env=env
            )

    async def _open(self, session_id: str, ttl_s: float, memory_mb: int) -> None:
        agent = asyncio.ensure_future(self._acquire_agent(memory_mb))
        self._sessions[session_id] = _SessionState(ttl_s=ttl_s, agent=agent)
        if session_id not in self._live:  # closed before it was opened
            await self._close(session_id)

    async def _acquire_agent(self, memory_mb: int) -> AgentProcess:
        agent = None
        while self._warm and agent is None:
            candidate = self._warm.pop()
            if candidate.alive:
                agent = candidate
            else:
                await candidate.kill()
        self._start_refill()
        if agent is None:
            agent = await self.backend.start_agent()
        try:
            await agent.init(memory_mb)
        except BaseException:
            await agent.kill()
            raise
        return agent

    def _start_refill(self) -> None:
        if self.warm_sessions > len(self._warm) + self._warming and not self._closed:
            task = asyncio.ensure_future(self._refill())
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _refill(self) -> None:
        while len(self._warm) + self._warming < self.warm_sessions and not self._closed:
            self._warming += 1
            try:
                self._warm.append(await self.backend.start_agent())
            except RuntimeError:
                return  # infra trouble: sessions will start cold and report it
            finally:
                self._warming -= 1

    async def _exec(
        self, session_id: str, code: str, kind: SessionKind, timeout_s: float
    ) -> SandboxResult:
        if kind not in ("python", "bash"):
            raise ValueError(f"unknown session kind {kind!r}")
        state = self._sessions.get(session_id)
        if state is None:
            raise SessionClosedError(f"session {session_id} is closed or expired")
        async with state.lock:
            if self._sessions.get(session_id) is not state:
                raise SessionClosedError(f"session {session_id} is closed or expired")
            state.busy = True
            try:
                try:
                    agent = await state.agent
                except RuntimeError as exc:
                    await self._close(session_id)
                    return SandboxResult.infra_error(str(exc))
                except asyncio.CancelledError:
                    if state.agent.cancelled():  # closed while it was starting
                        raise SessionClosedError(f"session {session_id} was closed") from None
                    raise
                async with self._slots:
                    result = await agent.exec(code, kind, timeout_s)
                if not agent.alive:
                    await self._close(session_id)
                return result
            finally:
                state.busy = False
                state.last_used = time.monotonic()

    async def _session_pid(self, session_id: str) -> int | None:
        state = self._sessions.get(session_id)
        if state is None or not state.agent.done() or state.agent.cancelled():
            return None
        if state.agent.exception() is not None:
            return None
        agent = state.agent.result()
        return agent.pid if agent.alive else None

    async def _close(self, session_id: str) -> None:
        with self._live_lock:
            self._live.discard(session_id)
        state = self._sessions.pop(session_id, None)
        if state is None:
            return
        if not state.agent.done():
            state.agent.cancel()
        with contextlib.suppress(BaseException):
            agent = await state.agent
            await agent.kill()

    def _close_session_and_wait(self, session_id: str) -> None:
        if self._closed or not self._thread.is_alive():
            return
        future = self._submit(self._close(session_id))
        if threading.current_thread() is not self._thread:
            with contextlib.suppress(Exception):
                future.result(timeout=30)

    def _discard_session(self, session_id: str) -> None:
        """Finaliser of a garbage-collected handle: close without waiting (may run on any thread)."""
        with contextlib.suppress(RuntimeError):
            if not self._closed:
                self._submit(self._close(session_id))

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.reap_interval_s)
            now = time.monotonic()
            for session_id, state in list(self._sessions.items()):
                if not state.busy and now - state.last_used > state.ttl_s:
                    await self._close(session_id)

    async def _shutdown(self) -> None:
        self._reaper.cancel()
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        for session_id in list(self._sessions):
            await self._close(session_id)
        warm, self._warm = self._warm, []
        for agent in warm:
            await agent.kill()
