"""``Sandbox`` backed by e2b cloud sandboxes (``pip install 'trident[e2b]'``, an ``E2B_API_KEY``).

For users who already run their code in e2b. Uses the ``e2b-code-interpreter`` SDK (sync API,
on a thread pool for the async calls):

- ``run(cmd, ...)``: a fresh e2b sandbox per run (``Sandbox.create``, killed afterwards), like
  every trident backend - nothing survives a run. ``files`` and ``stdin`` are written with
  ``files.write`` (work dir ``/home/user/trident``, stdin in ``/tmp``), then one
  ``commands.run`` of ``cd WORK && ulimit -v MEMORY && exec timeout -k 1 T CMD < STDIN`` with
  ``env`` as the command's environment. The wall-clock limit is enforced inside the sandbox by
  coreutils ``timeout``: exit 124 (or 137 once its KILL follow-up fired) after the deadline ->
  ``timeout``; the SDK's own command deadline is ``timeout_s + slack_s``, so an SDK timeout means
  the service hung (``error``). Other exit codes -> ``ok``/``oom``/``killed`` by
  ``trident.sandbox.base.classify``; a non-zero exit (the SDK's ``CommandExitException``) is the
  program's result, not an error.
- ``open_session()``: one e2b sandbox per session, created by the first ``exec``; Python runs in
  the code interpreter's Jupyter kernel (``run_code``, state persists, the value of a trailing
  expression is appended to stdout like trident's REPL), bash in its bash kernel
  (``run_code(language="bash")``). A call past ``timeout_s`` kills the session (status
  ``timeout``); the e2b sandbox's own timeout is pushed to ``ttl_s`` after every call, so an idle
  session expires after ``ttl_s`` there too. ``memory_mb`` is not applied to sessions (the VM's
  size comes from the template).
- Network: ``allow_internet_access=False`` by default (trident's sandboxes have no network);
  pass ``internet=True`` to allow it.

Whose fault: anything the SDK raises other than a command's non-zero exit - no API key accepted,
quota, the service unreachable, a sandbox that could not be created - is the infrastructure's:
status ``error`` (callers that score code raise ``InfraError``), never a zero.

What was exercised: only what needs no e2b account - a clear ``ImportError`` without the extra
and a clear error without ``E2B_API_KEY`` (``tests/test_sandbox_remote.py``). The live test there
runs only when ``E2B_API_KEY`` is set; it has not been run for this code, so the mapping above
follows the SDK's documented behaviour (``e2b-code-interpreter`` 2.x) and is unverified against
the service.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib
import math
import os
import shlex
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any

from trident.sandbox.base import (
    BlockingClient,
    BlockingSession,
    SandboxResult,
    SessionClosedError,
    SessionKind,
    as_bytes,
    cap_text,
    classify,
    validate_run_args,
)

WORK_DIR = "/home/user/trident"
_STDIN = "/tmp/.trident-stdin"
_INSTALL_HINT = "the e2b backend needs the e2b SDK: pip install 'trident[e2b]'"


def _import_sdk() -> Any:
    try:  # by name: the SDK is an optional dependency
        return importlib.import_module("e2b_code_interpreter")
    except ImportError as exc:
        raise ImportError(f"{_INSTALL_HINT} ({exc})") from exc


class E2BSandbox(BlockingClient):
    """``trident.sandbox.Sandbox`` on e2b cloud sandboxes (one per run, one per session)."""

    def __init__(
        self,
        *,
        template: str | None = None,
        api_key: str | None = None,
        domain: str | None = None,
        internet: bool = False,
        slack_s: float = 30.0,
        request_timeout_s: float = 30.0,
        max_inflight: int = 16,
        max_output_bytes: int = 1 << 20,
    ) -> None:
        self._sdk = _import_sdk()
        self.api_key = api_key or os.environ.get("E2B_API_KEY")
        if not self.api_key:
            raise RuntimeError(
                "the e2b backend needs an API key: set E2B_API_KEY (or pass api_key=...)"
            )
        self.template = template
        self.domain = domain
        self.internet = internet
        self.slack_s = slack_s
        self.request_timeout_s = request_timeout_s
        self.max_output_bytes = max_output_bytes
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_inflight, thread_name_prefix="trident-e2b"
        )
        self._lock = threading.Lock()
        self._sessions: set[E2BSession] = set()

    def _create(self, lifetime_s: float) -> Any:
        """A new e2b sandbox that e2b itself kills after ``lifetime_s`` (our backstop)."""
        kwargs: dict[str, Any] = {
            "timeout": max(60, math.ceil(lifetime_s)),
            "allow_internet_access": self.internet,
            "api_key": self.api_key,
            "request_timeout": self.request_timeout_s,
        }
        if self.template:
            kwargs["template"] = self.template
        if self.domain:
            kwargs["domain"] = self.domain
        return self._sdk.Sandbox.create(**kwargs)

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
        blobs = validate_run_args(cmd, files, timeout_s, memory_mb)
        script = (
            f"cd {WORK_DIR} && ulimit -v {memory_mb << 10} && "
            f"exec timeout -k 1 {timeout_s:g} {shlex.join(cmd)} < {_STDIN}"
        )
        start = time.monotonic()
        sandbox = None
        try:
            sandbox = self._create(timeout_s + 2 * self.slack_s)
            sandbox.files.make_dir(WORK_DIR)
            for rel, data in blobs.items():
                sandbox.files.write(f"{WORK_DIR}/{rel}", data)
            sandbox.files.write(_STDIN, as_bytes(stdin))
            started = time.monotonic()
            try:
                out = sandbox.commands.run(
                    script, envs=dict(env or {}), timeout=timeout_s + self.slack_s
                )
            except self._sdk.CommandExitException as exc:  # the program's non-zero exit
                out = exc
            ran_s = time.monotonic() - started
        except Exception as exc:  # the SDK's (or the service's) failure, not the program's
            return SandboxResult.infra_error(
                f"e2b failed: {type(exc).__name__}: {exc}", time.monotonic() - start
            )
        finally:
            if sandbox is not None:
                with contextlib.suppress(Exception):
                    sandbox.kill()
        return self._result(out.exit_code, out.stdout, out.stderr, timeout_s, ran_s)

    def _result(
        self, exit_code: int, stdout: str | None, stderr: str | None, timeout_s: float, ran_s: float
    ) -> SandboxResult:
        out, cut_out = cap_text(stdout or "", self.max_output_bytes)
        err, cut_err = cap_text(stderr or "", self.max_output_bytes)
        if exit_code in (124, 137) and ran_s >= timeout_s:  # coreutils `timeout` fired
            return SandboxResult("timeout", None, out, err, ran_s, cut_out or cut_err)
        return SandboxResult(
            classify(exit_code, err), exit_code, out, err, ran_s, cut_out or cut_err
        )

    def open_session(self, *, ttl_s: float = 600.0, memory_mb: int = 1024) -> E2BSession:
        if ttl_s <= 0 or memory_mb <= 0:
            raise ValueError("ttl_s and memory_mb must be positive")
        session = E2BSession(self, ttl_s)
        with self._lock:
            self._sessions.add(session)
        return session

    def close(self) -> None:
        with self._lock:
            sessions, self._sessions = list(self._sessions), set()
        for session in sessions:
            session.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> E2BSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class E2BSession(BlockingSession):
    """One e2b sandbox with a Python and a bash kernel (implements ``trident.sandbox.Session``)."""

    def __init__(self, owner: E2BSandbox, ttl_s: float) -> None:
        self.id = uuid.uuid4().hex
        self._owner = owner
        self._executor = owner._executor
        self._ttl_s = ttl_s
        self._sandbox: Any = None
        self._closed = False
        self._last_used = time.monotonic()
        self._lock = threading.Lock()

    def exec(
        self, code: str, *, kind: SessionKind = "python", timeout_s: float = 30.0
    ) -> SandboxResult:
        if kind not in ("python", "bash"):
            raise ValueError(f"unknown session kind {kind!r}")
        owner = self._owner
        with self._lock:
            if self._closed or time.monotonic() - self._last_used > self._ttl_s:
                self._kill()
                raise SessionClosedError(f"session {self.id} is closed or expired")
            start = time.monotonic()
            try:
                if self._sandbox is None:
                    self._sandbox = owner._create(self._ttl_s)
                execution = self._sandbox.run_code(code, language=kind, timeout=timeout_s)
            except owner._sdk.TimeoutException as exc:
                elapsed = time.monotonic() - start
                self._kill()  # its state is no longer trustworthy, as for local sessions
                if elapsed >= timeout_s:
                    return SandboxResult("timeout", None, "", "", elapsed)
                return SandboxResult.infra_error(f"e2b timed out: {exc}", elapsed)
            except Exception as exc:
                self._kill()
                return SandboxResult.infra_error(
                    f"e2b failed: {type(exc).__name__}: {exc}", time.monotonic() - start
                )
            finally:
                self._last_used = time.monotonic()
            with contextlib.suppress(Exception):  # keep an idle session alive for ttl_s
                self._sandbox.set_timeout(max(60, math.ceil(self._ttl_s)))
        stdout = "".join(execution.logs.stdout)
        stderr = "".join(execution.logs.stderr)
        if kind == "python" and execution.text is not None:
            stdout += execution.text + "\n"
        exit_code = 0
        if execution.error is not None:
            stderr += (
                execution.error.traceback or f"{execution.error.name}: {execution.error.value}"
            )
            exit_code = 1
        return owner._result(exit_code, stdout, stderr, math.inf, time.monotonic() - start)

    def _kill(self) -> None:
        self._closed = True
        sandbox, self._sandbox = self._sandbox, None
        if sandbox is not None:
            with contextlib.suppress(Exception):
                sandbox.kill()

    def close(self) -> None:
        with self._lock:
            self._kill()
        with self._owner._lock:
            self._owner._sessions.discard(self)

    def __enter__(self) -> E2BSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
