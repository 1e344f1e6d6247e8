"""Sandboxes for model-generated code: the seam (``Sandbox``, ``Session``) and the result type.

A sandbox runs one untrusted command in a fresh, isolated filesystem and returns a
``SandboxResult``; a session keeps one sandbox alive across calls (a Python REPL and a bash shell
that share a work directory), for multi-turn tool use.

Status, and whose fault it is:

=========  ====================================================================  ==========
status     meaning                                                               fault
=========  ====================================================================  ==========
ok         the program ran and exited by itself (any exit code)                  -
timeout    wall-clock or CPU-time limit hit; the whole sandbox was killed        model
oom        the memory limit was hit (heuristic, see ``trident.sandbox.bwrap``)   model
killed     the program died of a signal                                          model
error      the sandbox itself failed: bwrap missing or failed to set up, the     infra
           sandbox service is down or did not answer in time
=========  ====================================================================  ==========

Only ``error`` is the infrastructure's; callers that score code (``trident.rewards.code``) turn it
into ``InfraError`` so the sample is marked ``infra_error`` rather than scored zero.

Implementations, chosen by name with ``make_sandbox(spec)`` (``$TRIDENT_SANDBOX`` by default):

===================================  =================================================  ========
spec                                 backend                                            sessions
===================================  =================================================  ========
``local`` (default), ``bwrap``       ``SandboxPool``: local bubblewrap                  yes
                                     (``trident.sandbox.pool``)
``http://HOST:PORT``,                ``RemoteSandbox``: a ``trident sandbox serve``     yes
``trident+http://HOST:PORT``         service (``trident.sandbox.service``)
``http://A:PORT,http://B:PORT,...``  ``SandboxFleet``: several services, least-loaded   yes
                                     host first, a failed call retried on another
                                     (``trident.sandbox.fleet``)
``sandboxfusion+http://HOST:PORT``   ``SandboxFusionSandbox``: a SandboxFusion server   no
                                     (``trident.sandbox.sandboxfusion``)
``e2b``, ``e2b:TEMPLATE``            ``E2BSandbox``: e2b cloud sandboxes, needs         yes
                                     ``pip install 'trident[e2b]'`` and ``E2B_API_KEY``
                                     (``trident.sandbox.e2b_backend``)
===================================  =================================================  ========
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:  # loaded lazily by __getattr__ below
    from trident.sandbox.bwrap import BwrapConfig, BwrapSandbox
    from trident.sandbox.e2b_backend import E2BSandbox
    from trident.sandbox.pool import SandboxPool
    from trident.sandbox.sandboxfusion import SandboxFusionSandbox
    from trident.sandbox.service import RemoteSandbox

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


SANDBOX_ENV = "TRIDENT_SANDBOX"


def make_sandbox(spec: str | None = None, **kwargs: Any) -> Sandbox:
    """Build the sandbox backend named by ``spec`` (see the table in the module docstring).

    ``spec`` defaults to ``$TRIDENT_SANDBOX``, else ``"local"``. ``kwargs`` go to the backend's
    constructor. The caller owns the result and calls ``close()`` on it. Raises ``ValueError``
    for an unknown spec, ``ImportError`` when the backend's optional extra is not installed.
    """
    spec = (spec if spec is not None else os.environ.get(SANDBOX_ENV, "")).strip() or "local"
    if spec in ("local", "bwrap"):
        from trident.sandbox.pool import SandboxPool

        return SandboxPool(**kwargs)
    scheme, sep, rest = spec.partition("+")
    if sep and scheme == "trident" and rest.startswith(("http://", "https://")):
        spec = rest
    if "," in spec:  # several trident sandbox serve hosts
        from trident.sandbox.fleet import SandboxFleet

        urls = [u.strip().removeprefix("trident+") for u in spec.split(",") if u.strip()]
        return SandboxFleet(urls, **kwargs)
    if spec.startswith(("http://", "https://")):
        from trident.sandbox.service import RemoteSandbox

        return RemoteSandbox(spec, **kwargs)
    if sep and scheme == "sandboxfusion" and rest.startswith(("http://", "https://")):
        from trident.sandbox.sandboxfusion import SandboxFusionSandbox

        return SandboxFusionSandbox(rest, **kwargs)
    if spec == "e2b" or spec.startswith("e2b:"):
        from trident.sandbox.e2b_backend import E2BSandbox

        template = spec.partition(":")[2] or None
        return E2BSandbox(**({"template": template} if template else {}), **kwargs)
    raise ValueError(
        f"unknown sandbox {spec!r}: use 'local', 'http://HOST:PORT' (trident sandbox serve), "
        "'sandboxfusion+http://HOST:PORT' or 'e2b[:TEMPLATE]'"
    )


@functools.cache
def shared_sandbox(spec: str) -> Sandbox:
    """One backend per ``spec`` for the whole process, never closed before it exits: what
    environments built per trajectory use when ``env.kwargs.sandbox`` names a backend, so their
    trajectories share one pool (or one fleet's load counts)."""
    return make_sandbox(spec)


class EpisodeSandbox:
    """The sandbox session of one episode (an environment's trajectory), from ``sandbox``: a
    backend shared by every trajectory, a ``make_sandbox`` spec (one backend for the process,
    ``shared_sandbox``), or None for a private pool opened for the episode and closed with it."""

    def __init__(self, sandbox: Sandbox | str | None = None) -> None:
        if isinstance(sandbox, str):
            sandbox = shared_sandbox(sandbox)
        self.sandbox, self.own = sandbox, sandbox is None
        self.session: Any = None

    def open(self, *, ttl_s: float, memory_mb: int) -> Any:
        """Open the episode's session (a ``Session``; remote ones add ``exec_async``)."""
        if self.sandbox is None:
            from trident.sandbox.pool import SandboxPool

            self.sandbox = SandboxPool(max_concurrency=1)
        self.session = self.sandbox.open_session(ttl_s=ttl_s, memory_mb=memory_mb)
        return self.session

    async def close(self) -> None:
        """Close the session, and the private pool if there is one. Idempotent."""
        session, self.session = self.session, None
        if session is not None:
            await asyncio.to_thread(session.close)
        if self.own and self.sandbox is not None:
            sandbox, self.sandbox = self.sandbox, None
            await asyncio.to_thread(sandbox.close)


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


def __getattr__(name: str) -> Any:
    # Implementations load lazily: importing the seam must not import aiohttp/httpx.
    if name in ("SandboxPool",):
        from trident.sandbox.pool import SandboxPool

        return SandboxPool
    if name in ("BwrapSandbox", "BwrapConfig"):
        from trident.sandbox import bwrap

        return getattr(bwrap, name)
    if name == "RemoteSandbox":
        from trident.sandbox.service import RemoteSandbox

        return RemoteSandbox
    if name == "SandboxFusionSandbox":
        from trident.sandbox.sandboxfusion import SandboxFusionSandbox

        return SandboxFusionSandbox
    if name == "E2BSandbox":  # importing the module does not import the SDK
        from trident.sandbox.e2b_backend import E2BSandbox

        return E2BSandbox
    raise AttributeError(f"module 'trident.sandbox' has no attribute {name!r}")


__all__ = [
    "STATUSES",
    "BwrapConfig",
    "BwrapSandbox",
    "E2BSandbox",
    "InfraError",
    "RemoteSandbox",
    "SANDBOX_ENV",
    "Sandbox",
    "SandboxFusionSandbox",
    "SandboxPool",
    "SandboxResult",
    "SandboxStatus",
    "Session",
    "SessionClosedError",
    "SessionKind",
    "EpisodeSandbox",
    "make_sandbox",
    "shared_sandbox",
]
