"""``Sandbox`` backed by a SandboxFusion service (bytedance/SandboxFusion, ``POST /run_code``).

For users who already run SandboxFusion. Only ``httpx`` is needed (a core dependency), so there
is no extra to install. Wire format (SandboxFusion's ``sandbox/server/sandbox_api.py``; the
``sandbox-fusion`` client package on PyPI sends the same)::

    POST /run_code  {"code", "language", "run_timeout", "compile_timeout", "memory_limit_MB",
                     "stdin", "files": {relpath: base64}}
    -> {"status": "Success" | "Failed" | "SandboxError", "message",
        "run_result": {"status": "Finished" | "TimeLimitExceeded" | "Error",
                       "return_code", "stdout", "stderr", "execution_time"}, ...}
    GET  /v1/ping   -> "pong"

SandboxFusion runs a *program text* in a language, not an argv, in a fresh temp directory that
holds ``files`` (the cwd). ``run(cmd, ...)`` maps the argv onto that:

- ``[python|python3|python3.N, SCRIPT.py]`` with SCRIPT among ``files`` and no ``env``:
  ``language="python"`` with SCRIPT's text as the code and the other files beside it. This runs
  in SandboxFusion's Python runtime (its ``sandbox-runtime`` environment, with its packages);
  the script's own file name is not kept (SandboxFusion writes the code to a temporary name).
- anything else: ``language="bash"`` with the script ``export K=V`` (for ``env``) then
  ``exec CMD...`` (shell-quoted). Commands resolve on the server's PATH, so ``python3`` there may
  be the server's interpreter rather than the runtime environment.

Status (whose fault, as everywhere in ``trident.sandbox``): ``run_result.status`` ``Finished``
-> ``ok``/``oom``/``killed`` by ``trident.sandbox.base.classify`` (a negative return code, a
signal, becomes 128 + N); ``TimeLimitExceeded`` -> ``timeout``. The infrastructure's failures come
back as status ``error`` (callers that score code raise ``InfraError``, never a zero): the server
unreachable, a reply later than ``run_timeout + compile_timeout + slack_s`` (a hung server),
HTTP 5xx or a ``SandboxError`` after ``retries`` attempts, a reply that is not SandboxFusion's
(4xx, non-JSON, no ``run_result``). A run is a pure function of its request, so failed attempts
are retried (with backoff), except a hang: asking again would only wait again.

Not supported: sessions (SandboxFusion has no stateful sandbox; ``/run_jupyter`` replays cells in a
fresh kernel per request) - ``open_session`` raises ``NotImplementedError``; use the local
``SandboxPool``, ``trident sandbox serve`` or e2b. Output is capped here at ``max_output_bytes``
per stream (``truncated``), as the local backend does. Limits other than time and memory are
SandboxFusion's own (its isolation mode, cgroups, network policy).

Exercised in this repository only against a small stand-in server in ``tests/test_sandbox_remote.py``
that speaks this wire format and executes the code in trident's own bubblewrap sandbox; the real
SandboxFusion server (a large Docker image) was not run.
"""

from __future__ import annotations

import base64
import re
import shlex
import time
from collections.abc import Mapping
from typing import Any

import httpx

from trident.sandbox.base import (
    HttpSandboxClient,
    SandboxResult,
    cap_text,
    classify,
    validate_run_args,
)

_PYTHON = re.compile(r"python(3(\.\d+)?)?")
_RETRY_STATUSES = (500, 502, 503, 504)


class SandboxFusionSandbox(HttpSandboxClient):
    """``trident.sandbox.Sandbox`` over a SandboxFusion server's ``/run_code``."""

    health_path = "/v1/ping"

    def __init__(
        self,
        base_url: str = "http://localhost:8080",
        *,
        compile_timeout_s: float = 10.0,
        slack_s: float = 10.0,
        connect_timeout_s: float = 3.0,
        retries: int = 2,
        backoff_s: float = 0.5,
        max_inflight: int = 64,
        max_output_bytes: int = 1 << 20,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(
            base_url,
            connect_timeout_s=connect_timeout_s,
            max_inflight=max_inflight,
            thread_name_prefix="trident-sandboxfusion",
            headers=headers,
        )
        self.compile_timeout_s = compile_timeout_s
        self.slack_s = slack_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_output_bytes = max_output_bytes

    # -- request -------------------------------------------------------------------------------

    def build_request(
        self,
        cmd: list[str],
        *,
        stdin: str | bytes = b"",
        files: Mapping[str, str | bytes] | None = None,
        timeout_s: float = 10.0,
        memory_mb: int = 1024,
        env: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        """The ``/run_code`` body for one ``run`` (see the module docstring for the mapping)."""
        blobs = validate_run_args(cmd, files, timeout_s, memory_mb)
        try:
            stdin_text = stdin if isinstance(stdin, str) else bytes(stdin).decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError("SandboxFusion carries stdin as text: stdin must be UTF-8") from None
        script = cmd[1] if len(cmd) == 2 else ""
        if _PYTHON.fullmatch(cmd[0]) and script.endswith(".py") and script in blobs and not env:
            try:
                code = blobs.pop(script).decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError(f"{script} is not UTF-8") from None
            language = "python"
        else:
            lines = [f"export {_env_name(k)}={shlex.quote(v)}" for k, v in (env or {}).items()]
            code = "\n".join([*lines, "exec " + shlex.join(cmd), ""])
            language = "bash"
        return {
            "code": code,
            "language": language,
            "run_timeout": timeout_s,
            "compile_timeout": self.compile_timeout_s,
            "memory_limit_MB": memory_mb,
            "stdin": stdin_text,
            "files": {k: base64.b64encode(v).decode("ascii") for k, v in blobs.items()},
        }

    # -- transport -----------------------------------------------------------------------------

    def _post(self, body: dict[str, Any]) -> dict[str, Any] | str:
        """The JSON reply of a good ``/run_code``, or why there is none once retries are spent."""
        seconds = body["run_timeout"] + body["compile_timeout"] + self.slack_s
        timeout = httpx.Timeout(seconds, connect=self.connect_timeout_s)
        error = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                reply = self._client.post("/run_code", json=body, timeout=timeout)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                error = f"SandboxFusion unreachable at {self.base_url}: {exc!r}"
                continue
            except httpx.TimeoutException as exc:  # hung: asking again would only wait again
                return f"SandboxFusion did not answer within {seconds:.1f} s: {exc!r}"
            except httpx.HTTPError as exc:
                error = f"SandboxFusion request failed: {exc!r}"
                continue
            if reply.status_code in _RETRY_STATUSES:
                error = f"SandboxFusion answered HTTP {reply.status_code}: {reply.text[:500]}"
                continue
            if reply.status_code != 200:  # 4xx: a request this server does not accept
                return f"SandboxFusion rejected the request (HTTP {reply.status_code}): {reply.text[:500]}"
            try:
                data = reply.json()
            except ValueError:
                return f"SandboxFusion sent a non-JSON reply: {reply.text[:500]}"
            if not isinstance(data, dict):
                return f"SandboxFusion sent an unexpected reply: {str(data)[:500]}"
            if data.get("status") == "SandboxError":  # its own failure: transient, retry
                error = f"SandboxFusion reported SandboxError: {str(data.get('message'))[:500]}"
                continue
            return data
        return error

    def to_result(self, data: dict[str, Any], elapsed_s: float) -> SandboxResult:
        """A ``/run_code`` reply as a ``SandboxResult``."""
        run = data.get("run_result")
        if not isinstance(run, dict):
            message = data.get("message") or f"no run_result (status {data.get('status')!r})"
            return SandboxResult.infra_error(f"SandboxFusion: {message}", elapsed_s)
        stdout, cut_out = cap_text(run.get("stdout") or "", self.max_output_bytes)
        stderr, cut_err = cap_text(run.get("stderr") or "", self.max_output_bytes)
        truncated = cut_out or cut_err
        duration = run.get("execution_time")
        duration = float(duration) if isinstance(duration, (int, float)) else elapsed_s
        status = run.get("status")
        if status == "TimeLimitExceeded":
            return SandboxResult("timeout", None, stdout, stderr, duration, truncated)
        code = run.get("return_code")
        if status != "Finished" or not isinstance(code, int):
            message = stderr.strip() or data.get("message") or f"run status {status!r}"
            return SandboxResult.infra_error(f"SandboxFusion failed to run it: {message}", duration)
        if code < 0:  # killed by signal -code (a subprocess return code)
            code = 128 - code
        return SandboxResult(classify(code, stderr), code, stdout, stderr, duration, truncated)

    # -- Sandbox protocol ----------------------------------------------------------------------

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
        body = self.build_request(
            cmd, stdin=stdin, files=files, timeout_s=timeout_s, memory_mb=memory_mb, env=env
        )
        start = time.monotonic()
        outcome = self._post(body)
        if isinstance(outcome, str):
            return SandboxResult.infra_error(outcome, time.monotonic() - start)
        return self.to_result(outcome, time.monotonic() - start)

    def open_session(self, *, ttl_s: float = 600.0, memory_mb: int = 1024) -> Any:
        raise NotImplementedError(
            "SandboxFusion has no stateful sessions: use the local SandboxPool, "
            "`trident sandbox serve` (RemoteSandbox) or the e2b backend for multi-turn tools"
        )


def _env_name(name: str) -> str:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ValueError(f"not a valid environment variable name: {name!r}")
    return name
