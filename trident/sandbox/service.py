"""Sandbox over HTTP: the ``trident sandbox serve`` server and the ``RemoteSandbox`` client.

The server (aiohttp) puts a ``SandboxPool`` behind five routes; bodies and replies are JSON, byte
payloads base64::

    GET    /health                      -> {"ok": true, "open_sessions": n}
    POST   /run                         {"cmd", "stdin_b64", "files_b64", "timeout_s",
                                         "memory_mb", "env"} -> SandboxResult
    POST   /sessions                    {"id", "ttl_s", "memory_mb"} -> {"id"}
    POST   /sessions/{id}/exec          {"code", "kind", "timeout_s"} -> SandboxResult
                                         (404 when the session is closed, expired or unknown)
    DELETE /sessions/{id}               -> {"closed": true}

``RemoteSandbox`` implements ``trident.sandbox.Sandbox`` against it. Every request has a
deadline (the command's ``timeout_s`` plus ``slack_s``); connection failures and 503s are retried
with backoff, a dropped connection only for ``run`` (safe to repeat: each run starts from a fresh
sandbox; a session call is retried only while it cannot have reached the server), a missed
deadline never (a hung service would only hang again). Anything else that goes wrong on the way -
the service killed, a hung or garbled reply - comes back as a ``SandboxResult`` with status
``error``, which the reward layer turns into ``InfraError``. A 400 (a malformed request) raises
``ValueError``: that is the caller's bug, not the infrastructure's.

Deliberate simplifications: no authentication (bind to 127.0.0.1 or a private network); the async
client runs the synchronous ``httpx`` client on a private thread pool (``max_inflight`` threads),
which makes it independent of the caller's event loop; remote sessions are reclaimed by the
server's TTL reaper, not by a client-side finaliser. The client's connection pool, ``health``,
``close`` and ``with`` are ``trident.sandbox.base.HttpSandboxClient``'s.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from collections.abc import Mapping
from typing import Any

import httpx
from aiohttp import web

from trident.sandbox.base import (
    BlockingSession,
    HttpSandboxClient,
    InfraError,
    SandboxResult,
    SessionClosedError,
    SessionKind,
)
from trident.sandbox.pool import PoolSession, SandboxPool


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


# -- server ----------------------------------------------------------------------------------


class _BadRequest(ValueError):
    pass


def _field(body: Mapping[str, Any], key: str, kind: type, default: Any = None) -> Any:
    value = body.get(key, default)
    if value is None or (kind is float and isinstance(value, int)):
        return value
    if not isinstance(value, kind) or isinstance(value, bool) != (kind is bool):
        raise _BadRequest(f"field {key!r} must be {kind.__name__}")
    return value


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError as exc:
        raise _BadRequest(f"body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise _BadRequest("body must be a JSON object")
    return body


@web.middleware
async def _bad_requests(request: web.Request, handler: Any) -> web.StreamResponse:
    """A malformed request (a bad field, a body that is not JSON) answers 400 with the reason."""
    try:
        return await handler(request)
    except (_BadRequest, ValueError, TypeError) as exc:
        return web.json_response({"error": str(exc)}, status=400)


def create_app(pool: SandboxPool) -> web.Application:
    """The HTTP app over ``pool`` (the app closes the pool on cleanup)."""
    sessions: dict[str, PoolSession] = {}  # keeps handles alive: a dropped handle is closed

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"ok": True, "open_sessions": pool.open_sessions})

    async def run(request: web.Request) -> web.Response:
        body = await _json_body(request)
        cmd = _field(body, "cmd", list)
        if not cmd or not all(isinstance(a, str) for a in cmd):
            raise _BadRequest("'cmd' must be a non-empty list of strings")
        files_b64 = _field(body, "files_b64", dict, {})
        result = await pool.run_async(
            cmd,
            stdin=base64.b64decode(_field(body, "stdin_b64", str, "")),
            files={k: base64.b64decode(v) for k, v in files_b64.items()},
            timeout_s=_field(body, "timeout_s", float, 10.0),
            memory_mb=_field(body, "memory_mb", int, 1024),
            env=_field(body, "env", dict),
        )
        return web.json_response(result.to_dict())

    async def open_session(request: web.Request) -> web.Response:
        body = await _json_body(request)
        for stale in [k for k, s in sessions.items() if not pool.is_open(s.id)]:
            sessions.pop(stale).close()
        session_id = _field(body, "id", str) or uuid.uuid4().hex
        if session_id in sessions:
            raise _BadRequest(f"session {session_id!r} exists")
        try:
            session = pool.open_session(
                ttl_s=_field(body, "ttl_s", float, 600.0),
                memory_mb=_field(body, "memory_mb", int, 1024),
            )
        except RuntimeError as exc:  # too many sessions
            return web.json_response({"error": str(exc)}, status=503)
        sessions[session_id] = session
        return web.json_response({"id": session_id})

    async def exec_session(request: web.Request) -> web.Response:
        body = await _json_body(request)
        session = sessions.get(request.match_info["session_id"])
        kind = _field(body, "kind", str, "python")
        if kind not in ("python", "bash"):
            raise _BadRequest("'kind' must be 'python' or 'bash'")
        try:
            if session is None:
                raise SessionClosedError(f"no session {request.match_info['session_id']!r}")
            result = await session.exec_async(
                _field(body, "code", str, ""),
                kind=kind,
                timeout_s=_field(body, "timeout_s", float, 30.0),
            )
        except SessionClosedError as exc:
            return web.json_response({"error": str(exc)}, status=404)
        return web.json_response(result.to_dict())

    async def close_session(request: web.Request) -> web.Response:
        session = sessions.pop(request.match_info["session_id"], None)
        if session is not None:
            await asyncio.get_running_loop().run_in_executor(None, session.close)
        return web.json_response({"closed": True})

    async def cleanup(_: web.Application) -> None:
        await asyncio.get_running_loop().run_in_executor(None, pool.close)

    app = web.Application(middlewares=[_bad_requests], client_max_size=64 << 20)
    app.router.add_get("/health", health)
    app.router.add_post("/run", run)
    app.router.add_post("/sessions", open_session)
    app.router.add_post("/sessions/{session_id}/exec", exec_session)
    app.router.add_delete("/sessions/{session_id}", close_session)
    app.on_cleanup.append(cleanup)
    return app


def serve(
    host: str = "127.0.0.1",
    port: int = 8470,
    *,
    max_concurrency: int | None = None,
    warm_sessions: int = 2,
    max_sessions: int = 64,
) -> None:
    """Run the sandbox service until SIGINT/SIGTERM (``trident sandbox serve``)."""
    pool = SandboxPool(
        max_concurrency=max_concurrency, warm_sessions=warm_sessions, max_sessions=max_sessions
    )
    problem = pool.backend.unavailable()
    if problem:
        pool.close()
        raise SystemExit(f"trident sandbox serve: {problem}")
    web.run_app(
        create_app(pool),
        host=host,
        port=port,
        print=lambda _: print(f"trident sandbox service on http://{host}:{port}", flush=True),
    )


# -- client ----------------------------------------------------------------------------------


class RemoteSandbox(HttpSandboxClient):
    """``Sandbox`` backed by a ``trident sandbox serve`` service."""

    def __init__(
        self,
        base_url: str,
        *,
        slack_s: float = 5.0,
        connect_timeout_s: float = 2.0,
        retries: int = 2,
        backoff_s: float = 0.2,
        max_inflight: int = 64,
    ) -> None:
        super().__init__(
            base_url,
            connect_timeout_s=connect_timeout_s,
            max_inflight=max_inflight,
            thread_name_prefix="trident-remote-sandbox",
        )
        self.slack_s = slack_s
        self.retries = retries
        self.backoff_s = backoff_s

    def _timeout(self, seconds: float) -> httpx.Timeout:
        return httpx.Timeout(seconds + self.slack_s, connect=self.connect_timeout_s)

    def _request(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None,
        seconds: float,
        *,
        idempotent: bool,
    ) -> tuple[int, Any] | str:
        """(status, JSON reply), or an error message once retries are spent."""
        error = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                reply = self._client.request(
                    method, path, json=body, timeout=self._timeout(seconds)
                )
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                error = f"sandbox service unreachable at {self.base_url}: {exc!r}"
                continue
            except httpx.TimeoutException as exc:  # hung: asking again would only wait again
                return (
                    f"sandbox service did not answer within {seconds + self.slack_s:.1f} s: {exc!r}"
                )
            except httpx.HTTPError as exc:  # sent, then failed: only safe to repeat if idempotent
                error = f"sandbox service request failed: {exc!r}"
                if idempotent:
                    continue
                return error
            if reply.status_code == 503:
                error = f"sandbox service overloaded: {reply.text[:500]}"
                continue
            try:
                return reply.status_code, reply.json()
            except ValueError:
                return f"sandbox service sent a non-JSON reply ({reply.status_code}): {reply.text[:500]}"
        return error

    def _result(self, outcome: tuple[int, Any] | str, start: float) -> SandboxResult:
        if isinstance(outcome, str):
            return SandboxResult.infra_error(outcome, time.monotonic() - start)
        status, data = outcome
        if status == 400:
            raise ValueError(f"sandbox service rejected the request: {data.get('error')}")
        if status == 404:
            raise SessionClosedError(str(data.get("error", "session is closed")))
        try:
            if status != 200:
                raise ValueError(f"HTTP {status}: {data}")
            return SandboxResult.from_dict(data)
        except (KeyError, ValueError, TypeError) as exc:
            return SandboxResult.infra_error(
                f"bad reply from sandbox service: {exc}", time.monotonic() - start
            )

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
        start = time.monotonic()
        body = {
            "cmd": list(cmd),
            "stdin_b64": _b64(stdin),
            "files_b64": {k: _b64(v) for k, v in (files or {}).items()},
            "timeout_s": timeout_s,
            "memory_mb": memory_mb,
            "env": dict(env) if env else None,
        }
        return self._result(self._request("POST", "/run", body, timeout_s, idempotent=True), start)

    def open_session(self, *, ttl_s: float = 600.0, memory_mb: int = 1024) -> RemoteSession:
        return RemoteSession(self, ttl_s=ttl_s, memory_mb=memory_mb)


class RemoteSession(BlockingSession):
    """A session on the service; created there by the first ``exec`` (so opening never blocks)."""

    def __init__(self, sandbox: RemoteSandbox, *, ttl_s: float, memory_mb: int) -> None:
        self.id = uuid.uuid4().hex
        self._sandbox = sandbox
        self._executor = sandbox._executor
        self._ttl_s = ttl_s
        self._memory_mb = memory_mb
        self._created = False
        self._closed = False

    def start(self) -> None:
        """Create the session on the service now (the first ``exec`` does it otherwise); raise
        ``InfraError`` if the service cannot."""
        if self._created:
            return
        body = {"id": self.id, "ttl_s": self._ttl_s, "memory_mb": self._memory_mb}
        outcome = self._sandbox._request("POST", "/sessions", body, 0.0, idempotent=False)
        if isinstance(outcome, str) or outcome[0] != 200:
            raise InfraError(outcome if isinstance(outcome, str) else str(outcome[1]))
        self._created = True

    def exec(
        self, code: str, *, kind: SessionKind = "python", timeout_s: float = 30.0
    ) -> SandboxResult:
        if self._closed:
            raise SessionClosedError(f"session {self.id} is closed")
        start = time.monotonic()
        remote = self._sandbox
        if not self._created:
            try:
                self.start()
            except InfraError as e:
                return SandboxResult.infra_error(str(e), time.monotonic() - start)
        body = {"code": code, "kind": kind, "timeout_s": timeout_s}
        outcome = remote._request(
            "POST", f"/sessions/{self.id}/exec", body, timeout_s, idempotent=False
        )
        return remote._result(outcome, start)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._created:
            self._sandbox._request("DELETE", f"/sessions/{self.id}", None, 0.0, idempotent=True)

    def __enter__(self) -> RemoteSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
