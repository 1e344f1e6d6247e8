"""The sandbox seam: the ``Sandbox`` and ``Session`` protocols, their result, and what every
backend shares: the argument checks (``validate_run_args``), the status heuristics
(``classify``), the output cap, and the adapters between blocking and async calls
(``BlockingClient``, ``BlockingSession``, ``HttpSandboxClient``, ``run_coroutine_sync``).

Every backend (``bwrap``/``pool``, ``service``, ``fleet``, ``sandboxfusion``, ``e2b_backend``)
imports from here and from nothing of another backend's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import os
import signal
import threading
from collections.abc import Coroutine, Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, Self, TypeVar, runtime_checkable

if TYPE_CHECKING:  # imported when a client is built: importing the seam must not import httpx
    import httpx

_T = TypeVar("_T")

SandboxStatus = Literal["ok", "timeout", "oom", "killed", "error"]
SessionKind = Literal["python", "bash"]

STATUSES: tuple[str, ...] = ("ok", "timeout", "oom", "killed", "error")


class InfraError(RuntimeError):
    """The sandbox infrastructure failed (not the model's code): mark the sample ``infra_error``."""


class SessionClosedError(RuntimeError):
    """``exec`` on a session that was closed, expired (TTL) or killed by an earlier timeout."""


@dataclass(frozen=True)
class SandboxResult:
    """What one command (or one session call) did.

    ``stdout``/``stderr`` are decoded as UTF-8 (invalid bytes replaced) and capped; ``truncated``
    is True when either stream was cut at the cap. ``exit_code`` is None when the program did not
    exit by itself (timeout, sandbox error); a program killed by signal N reports 128 + N.
    """

    status: SandboxStatus
    exit_code: int | None
    stdout: str
    stderr: str
    duration_s: float
    truncated: bool = False

    @property
    def passed(self) -> bool:
        """Ran to completion and exited 0."""
        return self.status == "ok" and self.exit_code == 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SandboxResult:
        status = data["status"]
        if status not in STATUSES:
            raise ValueError(f"unknown sandbox status {status!r}")
        return cls(
            status=status,
            exit_code=data.get("exit_code"),
            stdout=str(data.get("stdout", "")),
            stderr=str(data.get("stderr", "")),
            duration_s=float(data.get("duration_s", 0.0)),
            truncated=bool(data.get("truncated", False)),
        )

    @classmethod
    def infra_error(cls, message: str, duration_s: float = 0.0) -> SandboxResult:
        """A result for a sandbox that could not run the command at all."""
        return cls("error", None, "", message, duration_s, False)


@runtime_checkable
class Session(Protocol):
    """One long-lived sandbox holding a Python REPL and a bash shell that share ``/sandbox``."""

    id: str

    def exec(
        self, code: str, *, kind: SessionKind = "python", timeout_s: float = 30.0
    ) -> SandboxResult:
        """Called per tool call from synchronous code: run ``code`` in the session's REPL or shell.

        State (Python globals, shell variables, cwd, files) persists between calls. A call that
        times out kills the session; later calls raise ``SessionClosedError``.
        """
        ...

    async def exec_async(
        self, code: str, *, kind: SessionKind = "python", timeout_s: float = 30.0
    ) -> SandboxResult:
        """Called per tool call from asyncio code (agent loops); same contract as ``exec``."""
        ...

    def close(self) -> None:
        """Called when the episode ends (or by ``with``/the finaliser): kill the sandbox. Idempotent."""
        ...


@runtime_checkable
class Sandbox(Protocol):
    """Runs untrusted commands in fresh sandboxes and opens stateful sessions."""

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
        """Called from synchronous code (CLI, scripts) to run ``cmd`` once in a fresh sandbox.

        ``files`` are written into the work directory ``/sandbox`` (the cwd) before ``cmd`` starts;
        ``stdin`` is fed to it. Never raises for anything the command does; infrastructure
        failures come back as status ``error``.
        """
        ...

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
        """Called from asyncio code (reward functions) for each command; same contract as ``run``."""
        ...

    def open_session(self, *, ttl_s: float = 600.0, memory_mb: int = 1024) -> Session:
        """Called when an episode needs state across tool calls. Returns at once; the sandbox is
        started (or taken from the warm pool) by the first ``exec``. The session is killed after
        ``ttl_s`` seconds without a call, on ``close()``, or when its handle is garbage-collected.
        """
        ...

    def close(self) -> None:
        """Called once by the owner at shutdown: kill every sandbox and session it started."""
        ...


_OOM_MARKERS = ("MemoryError", "Cannot allocate memory", "std::bad_alloc", "out of memory")
_SIGNAL_CODES = range(129, 129 + 64)


def classify(exit_code: int, stderr: str) -> SandboxStatus:
    """Status of a program that started and ended by itself (see ``trident.sandbox.bwrap``)."""
    if exit_code == 128 + signal.SIGXCPU:
        return "timeout"
    if exit_code != 0 and any(m in stderr[-4096:] for m in _OOM_MARKERS):
        return "oom"
    if exit_code in _SIGNAL_CODES:
        return "killed"
    return "ok"


def check_relpath(path: str) -> str:
    """``path`` normalised; ``ValueError`` unless it is relative and inside the work dir."""
    norm = os.path.normpath(path)
    if os.path.isabs(norm) or norm == "." or norm.startswith(".."):
        raise ValueError(f"sandbox file path must be relative and inside the work dir: {path!r}")
    return norm


def as_bytes(data: str | bytes) -> bytes:
    """``data`` as bytes (text encoded as UTF-8)."""
    return data.encode() if isinstance(data, str) else bytes(data)


def validate_run_args(
    cmd: list[str], files: Mapping[str, str | bytes] | None, timeout_s: float, memory_mb: int
) -> dict[str, bytes]:
    """Called first by a backend's ``run``: ``ValueError`` for an empty command, a non-positive
    limit or a file path outside the work dir; returns ``files`` as normalised path -> bytes."""
    if not cmd:
        raise ValueError("empty command")
    if timeout_s <= 0 or memory_mb <= 0:
        raise ValueError("timeout_s and memory_mb must be positive")
    return {check_relpath(k): as_bytes(v) for k, v in (files or {}).items()}


def cap_text(text: str, limit: int) -> tuple[str, bool]:
    """``text`` cut to at most ``limit`` UTF-8 bytes, and whether it was cut."""
    data = text.encode("utf-8", "replace")
    if len(data) <= limit:
        return text, False
    return data[:limit].decode("utf-8", "replace"), True


def run_coroutine_sync(coro: Coroutine[Any, Any, _T]) -> _T:
    """Run ``coro`` to completion from synchronous code, even if this thread has a running loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name="trident-sandbox-sync")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


class BlockingClient:
    """For backends whose ``run`` blocks (HTTP and SDK clients): ``run_async`` runs it on the
    backend's own thread pool, ``self._executor``."""

    _executor: concurrent.futures.Executor

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
        call = functools.partial(
            self.run,  # type: ignore[attr-defined]
            cmd, stdin=stdin, files=files, timeout_s=timeout_s, memory_mb=memory_mb, env=env,
        )  # fmt: skip
        return await asyncio.get_running_loop().run_in_executor(self._executor, call)


class BlockingSession:
    """For sessions whose ``exec`` blocks: ``exec_async`` runs it on ``self._executor`` (the
    backend's thread pool)."""

    _executor: concurrent.futures.Executor

    async def exec_async(
        self, code: str, *, kind: SessionKind = "python", timeout_s: float = 30.0
    ) -> SandboxResult:
        call = functools.partial(self.exec, code, kind=kind, timeout_s=timeout_s)  # type: ignore[attr-defined]
        return await asyncio.get_running_loop().run_in_executor(self._executor, call)


class HttpSandboxClient(BlockingClient):
    """For backends that are HTTP clients of a sandbox service: one ``httpx.Client`` on
    ``base_url`` and a thread pool of ``max_inflight`` for the async calls, ``health``,
    ``close`` and ``with``."""

    health_path: str = "/health"

    def __init__(
        self,
        base_url: str,
        *,
        connect_timeout_s: float,
        max_inflight: int,
        thread_name_prefix: str,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        import httpx

        self.base_url = base_url.rstrip("/")
        self.connect_timeout_s = connect_timeout_s
        self._client: httpx.Client = httpx.Client(
            base_url=self.base_url,
            headers=dict(headers or {}),
            limits=httpx.Limits(
                max_connections=max_inflight, max_keepalive_connections=max_inflight
            ),
        )
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_inflight, thread_name_prefix=thread_name_prefix
        )

    def health(self) -> bool:
        """Whether the service answers ``GET health_path`` with 200 now."""
        import httpx

        with contextlib.suppress(httpx.HTTPError):
            reply = self._client.get(self.health_path, timeout=self.connect_timeout_s)
            return reply.status_code == 200
        return False

    def close(self) -> None:
        """Called once by the owner at shutdown: stop the thread pool, close the connections."""
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
