"""Sandboxes across machines: several ``trident sandbox serve`` hosts behind one ``Sandbox``.

``make_sandbox("http://a:8000,http://b:8000")`` (or ``$TRIDENT_SANDBOX`` set to such a list)
builds a ``SandboxFleet``. Each call goes to the healthy host with the fewest calls in flight
(an open session counts as one until it closes), so load spreads by how fast each host answers.
A call whose host fails (status ``error``: unreachable, overloaded, a bad reply) marks the host
down and is retried once on each other healthy host; a host that is down is left out for
``recheck_s``, then tried again (when every host is down, those that answer ``/health`` are
tried). A session stays on the host that opened it (its state lives there); opening one tries
the hosts in the same order. Only when every host fails does the caller see the ``error``
result (for the code reward: an ``infra_error`` sample, never a zero reward).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from trident.sandbox.base import BlockingClient, InfraError, SandboxResult
from trident.sandbox.service import RemoteSandbox, RemoteSession

_T = TypeVar("_T")


class SandboxFleet(BlockingClient):
    """``Sandbox`` over several ``trident sandbox serve`` services (see the module docstring)."""

    def __init__(
        self, urls: Sequence[str], *, recheck_s: float = 10.0, max_inflight: int = 64, **kwargs: Any
    ) -> None:
        if not urls:
            raise ValueError("a sandbox fleet needs at least one URL")
        self.hosts = [RemoteSandbox(u, max_inflight=max_inflight, **kwargs) for u in urls]
        self.recheck_s = recheck_s
        self.inflight = [0] * len(self.hosts)
        self.calls = [0] * len(self.hosts)  # calls answered per host (for metrics and tests)
        self.down_until = [0.0] * len(self.hosts)
        self._lock = threading.Lock()
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_inflight, thread_name_prefix="trident-sandbox-fleet"
        )

    def _order(self) -> list[int]:
        """Hosts to try: those not marked down, by calls in flight; if every host is down, those
        that answer ``/health`` now."""
        now = time.monotonic()
        with self._lock:
            up = sorted(
                (i for i in range(len(self.hosts)) if self.down_until[i] <= now),
                key=lambda i: (self.inflight[i], self.calls[i]),
            )
        return up or [i for i in range(len(self.hosts)) if self.hosts[i].health()]

    def _on(self, i: int, call: Callable[[RemoteSandbox], _T], failed: Callable[[_T], bool]) -> _T:
        with self._lock:
            self.inflight[i] += 1
        try:
            out = call(self.hosts[i])
        finally:
            with self._lock:
                self.inflight[i] -= 1
        with self._lock:
            if failed(out):
                self.down_until[i] = time.monotonic() + self.recheck_s
            else:
                self.down_until[i] = 0.0
                self.calls[i] += 1
        return out

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
        result = SandboxResult.infra_error("no sandbox host is up")
        for i in self._order():
            result = self._on(
                i,
                lambda host: host.run(
                    cmd, stdin=stdin, files=files, timeout_s=timeout_s, memory_mb=memory_mb, env=env
                ),
                lambda r: r.status == "error",
            )
            if result.status != "error":
                return result
        return result

    def open_session(self, *, ttl_s: float = 600.0, memory_mb: int = 1024) -> FleetSession:
        """A session on the first host that opens one; its calls stay on that host, and it
        counts as in flight there until it closes."""
        error: Exception | None = None
        for i in self._order():
            session = self.hosts[i].open_session(ttl_s=ttl_s, memory_mb=memory_mb)
            try:
                session.start()
            except InfraError as e:  # the host's fault: mark it down, try the next
                with self._lock:
                    self.down_until[i] = time.monotonic() + self.recheck_s
                error = e
                continue
            with self._lock:
                self.inflight[i] += 1
            return FleetSession(session, lambda i=i: self._release(i))
        raise InfraError(f"no sandbox host opened a session: {error}")

    def _release(self, i: int) -> None:
        with self._lock:
            self.inflight[i] -= 1

    def health(self) -> bool:
        return any(h.health() for h in self.hosts)

    def close(self) -> None:
        for h in self.hosts:
            h.close()
        self._executor.shutdown(wait=False, cancel_futures=True)


class FleetSession:
    """A ``RemoteSession`` on one host of a fleet; closing it frees its slot on the host."""

    def __init__(self, session: RemoteSession, release: Callable[[], None]) -> None:
        self.session, self._release = session, release
        self.id, self.host = session.id, session._sandbox.base_url
        self.exec, self.exec_async = session.exec, session.exec_async

    def close(self) -> None:
        release, self._release = self._release, None
        self.session.close()
        if release is not None:
            release()

    def __enter__(self) -> FleetSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
