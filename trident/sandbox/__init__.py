"""Sandboxes for model-generated code: ``make_sandbox`` and the seam (``trident.sandbox.base``).

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
import functools
import os
from typing import TYPE_CHECKING, Any

from trident.sandbox.base import (
    STATUSES,
    BlockingClient,
    BlockingSession,
    HttpSandboxClient,
    InfraError,
    Sandbox,
    SandboxResult,
    SandboxStatus,
    Session,
    SessionClosedError,
    SessionKind,
    as_bytes,
    check_relpath,
    classify,
    validate_run_args,
)

if TYPE_CHECKING:  # loaded lazily by __getattr__ below
    from trident.sandbox.bwrap import BwrapConfig, BwrapSandbox
    from trident.sandbox.e2b_backend import E2BSandbox
    from trident.sandbox.pool import SandboxPool
    from trident.sandbox.sandboxfusion import SandboxFusionSandbox
    from trident.sandbox.service import RemoteSandbox

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
    "BlockingClient",
    "BlockingSession",
    "HttpSandboxClient",
    "as_bytes",
    "check_relpath",
    "classify",
    "validate_run_args",
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
