"""Remote sandbox backends: the SandboxFusion client against a stand-in server, e2b's guard rails,
and choosing a backend by name.

What is real and what is not:

- SandboxFusion: the real server is a large Docker image that does not run here. ``FusionStandIn``
  is a small HTTP server that speaks SandboxFusion's ``/run_code`` wire format (request and reply
  fields as in bytedance/SandboxFusion ``sandbox/server/sandbox_api.py``) and *executes* the code
  - in trident's own bubblewrap sandbox, the way SandboxFusion's Python and bash runners do (the
  code written to a temporary file in a fresh directory holding the request's files, stdin fed,
  a negative return code for a signal). It also injects the failures a real deployment has
  (HTTP 500, a ``SandboxError`` reply, a hung request, a 4xx). So the client's request building,
  reply mapping, retries and fault classification are tested end to end; the real server's
  quirks are not.
- e2b: a cloud service (API key, network). Only what needs neither is tested: the missing extra and
  the missing key. ``test_e2b_live`` runs only with ``E2B_API_KEY`` set and the SDK installed.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import sys
import threading
import time
import types
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from trident.rewards import RewardSum
from trident.rewards.code import code_reward
from trident.sandbox import InfraError, SandboxResult, make_sandbox
from trident.sandbox.sandboxfusion import SandboxFusionSandbox

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")


class FusionStandIn:
    """SandboxFusion's ``/run_code`` and ``/v1/ping``, executing in trident's bwrap sandbox.

    ``faults`` is consumed one per ``/run_code`` request: ``"500"``, ``"422"``, ``"sandbox_error"``
    or ``"hang"`` (sleep ``hang_s``, then answer 500); an empty list means "run the code".
    """

    LANGUAGES = {"python": ("python3", ".py"), "bash": ("bash", ".sh")}

    def __init__(self, sandbox: Any) -> None:
        self.sandbox = sandbox
        self.faults: list[str] = []
        self.requests: list[dict[str, Any]] = []
        self.hang_s = 5.0
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def reply(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/v1/ping":
                    self.reply(200, "pong")
                else:
                    self.reply(404, {"detail": "Not Found"})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stand_in.requests.append(body)
                fault = stand_in.faults.pop(0) if stand_in.faults else ""
                if fault == "hang":
                    time.sleep(stand_in.hang_s)
                    fault = "500"
                if fault == "500":
                    self.reply(500, {"detail": "Internal Server Error"})
                elif fault == "422" or body.get("language") not in stand_in.LANGUAGES:
                    self.reply(422, {"detail": [{"loc": ["body", "language"], "msg": "bad"}]})
                elif fault == "sandbox_error":
                    self.reply(200, {"status": "SandboxError", "message": "runner crashed"})
                else:
                    self.reply(200, stand_in.run_code(body))

        class Server(ThreadingHTTPServer):
            def handle_error(self, request: Any, client_address: Any) -> None:
                pass  # a client that gave up on a hung request: nothing to report

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.block_on_close = False
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def run_code(self, body: dict[str, Any]) -> dict[str, Any]:
        """SandboxFusion's ``run_python``/``run_bash`` + ``parse_run_status``, on bwrap."""
        interpreter, suffix = self.LANGUAGES[body["language"]]
        name = f"tmp{uuid.uuid4().hex[:8]}{suffix}"
        files = {k: base64.b64decode(v) for k, v in (body.get("files") or {}).items()}
        files[name] = body["code"].encode()
        memory = body.get("memory_limit_MB", -1)
        result: SandboxResult = self.sandbox.run(
            [interpreter, name],
            stdin=body.get("stdin") or "",
            files=files,
            timeout_s=float(body.get("run_timeout", 10)),
            memory_mb=memory if memory > 0 else 1024,
        )
        run: dict[str, Any] = {
            "execution_time": result.duration_s,
            "stdout": result.stdout,
            "stderr": result.stderr,
            "return_code": None,
        }
        if result.status == "timeout":
            return {
                "status": "Failed",
                "message": "",
                "run_result": {**run, "status": "TimeLimitExceeded"},
            }
        if result.status == "error":
            message = result.stderr
            return {
                "status": "SandboxError",
                "message": message,
                "run_result": {**run, "status": "Error"},
            }
        code = result.exit_code
        assert code is not None
        if result.status == "killed" and code > 128:  # asyncio's returncode for a signal
            code = 128 - code
        run.update(status="Finished", return_code=code)
        return {"status": "Success" if code == 0 else "Failed", "message": "", "run_result": run}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def stand_in():
    from trident.sandbox.pool import SandboxPool

    pool = SandboxPool(max_concurrency=2)
    server = FusionStandIn(pool)
    yield server
    server.close()
    pool.close()


@pytest.fixture
def fusion(stand_in):
    stand_in.faults.clear()
    stand_in.requests.clear()
    client = SandboxFusionSandbox(
        stand_in.url, compile_timeout_s=0.0, slack_s=5.0, retries=2, backoff_s=0.01
    )
    yield client
    client.close()


# -- SandboxFusion: request building (no server) -------------------------------------------------


def test_python_command_becomes_a_python_request():
    client = SandboxFusionSandbox("http://127.0.0.1:9")
    body = client.build_request(
        ["python3", "main.py"], stdin="1\n", files={"main.py": "print(1)", "d/x.txt": b"\xff"}
    )
    assert body["language"] == "python" and body["code"] == "print(1)"
    assert body["files"] == {"d/x.txt": base64.b64encode(b"\xff").decode()}
    assert body["stdin"] == "1\n" and body["run_timeout"] == 10.0
    assert body["memory_limit_MB"] == 1024
    other = client.build_request(["ls", "-l", "a b"], env={"K": "it's"})
    assert other["language"] == "bash"
    assert other["code"] == "export K='it'\"'\"'s'\nexec ls -l 'a b'\n"
    with pytest.raises(ValueError):
        client.build_request(["true"], files={"../x": "no"})
    with pytest.raises(ValueError):
        client.build_request(["cat"], stdin=b"\xff\xfe")
    with pytest.raises(NotImplementedError):
        client.open_session()
    client.close()


# -- SandboxFusion: against the stand-in server --------------------------------------------------


@needs_bwrap
def test_fusion_runs_programs(fusion, stand_in):
    assert fusion.health()
    program = "import sys\nprint(open('data.txt').read().strip(), sum(map(int, sys.stdin.read().split())))"
    result = fusion.run(
        ["python3", "main.py"], stdin="3 4\n", files={"main.py": program, "data.txt": "sum:"}
    )
    assert result.status == "ok" and result.exit_code == 0, result
    assert result.stdout == "sum: 7\n"
    assert stand_in.requests[-1]["language"] == "python"
    assert "main.py" not in stand_in.requests[-1]["files"]

    result = fusion.run(["sh", "-c", 'echo "$GREETING" "$1"', "sh", "arg"], env={"GREETING": "hi"})
    assert result.status == "ok" and result.stdout == "hi arg\n", result
    assert stand_in.requests[-1]["language"] == "bash"


@needs_bwrap
def test_fusion_the_models_failures_are_not_infra_errors(fusion):
    def py(code: str, **kw: Any) -> SandboxResult:
        return fusion.run(["python3", "main.py"], files={"main.py": code}, **kw)

    exited = py("import sys\nprint('partial')\nsys.exit(3)")
    assert (exited.status, exited.exit_code, exited.stdout) == ("ok", 3, "partial\n")
    raised = py("raise ValueError('nope')")
    assert raised.status == "ok" and raised.exit_code == 1 and "ValueError" in raised.stderr
    killed = py("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
    assert (killed.status, killed.exit_code) == ("killed", 137), killed
    oom = py("x = bytearray(1 << 30)", memory_mb=64)
    assert oom.status == "oom", oom
    start = time.monotonic()
    hung = py("while True:\n    pass", timeout_s=1.0)
    assert hung.status == "timeout" and hung.exit_code is None, hung
    assert time.monotonic() - start < 8


@needs_bwrap
def test_fusion_infra_failures_are_errors_and_retried(fusion, stand_in):
    stand_in.faults[:] = ["500", "sandbox_error"]  # transient: the third attempt runs it
    result = fusion.run(["python3", "main.py"], files={"main.py": "print('ok')"})
    assert result.status == "ok" and result.stdout == "ok\n", result
    assert len(stand_in.requests) == 3

    stand_in.requests.clear()
    stand_in.faults[:] = ["500"] * 3
    result = fusion.run(["true"])
    assert result.status == "error" and "HTTP 500" in result.stderr, result
    assert len(stand_in.requests) == 3  # 1 + retries

    stand_in.requests.clear()
    stand_in.faults[:] = ["422"]
    result = fusion.run(["true"])
    assert result.status == "error" and "HTTP 422" in result.stderr, result
    assert len(stand_in.requests) == 1  # a rejected request is not repeated


@needs_bwrap
def test_fusion_hang_and_unreachable_are_errors(stand_in):
    stand_in.faults[:] = ["hang"]
    stand_in.hang_s = 5.0
    client = SandboxFusionSandbox(stand_in.url, compile_timeout_s=0.0, slack_s=0.5, retries=2)
    start = time.monotonic()
    result = client.run(["true"], timeout_s=0.5)
    assert result.status == "error" and "did not answer" in result.stderr, result
    assert time.monotonic() - start < 4  # not retried: a hung server would only hang again
    client.close()

    dead = SandboxFusionSandbox("http://127.0.0.1:9", retries=1, backoff_s=0.01)
    result = dead.run(["true"])
    assert result.status == "error" and "unreachable" in result.stderr, result
    assert not dead.health()
    dead.close()


@needs_bwrap
def test_code_reward_through_sandboxfusion(fusion, stand_in):
    response = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    cases = [{"input": "1 2\n", "output": "3"}, {"input": "5 5\n", "output": "10"}]
    assert asyncio.run(code_reward(response, tests=cases, sandbox=fusion)) == 1.0
    asserts = "assert add(1, 2) == 3\nassert add(2, 2) == 5"
    program = "```python\ndef add(a, b):\n    return a + b\n```"
    assert asyncio.run(code_reward(program, tests=asserts, sandbox=fusion)) == 0.5

    stand_in.faults[:] = ["500"] * 50  # the service is down: infra_error, never a zero
    with pytest.raises(InfraError):
        asyncio.run(code_reward(response, tests=cases, sandbox=fusion))
    model = RewardSum([(code_reward, 1.0)], timeout_s=30.0)
    row = {"tests": cases, "sandbox": fusion}
    assert asyncio.run(model.score(response, row)) == (None, "infra_error")


# -- choosing a backend by name ------------------------------------------------------------------


def test_make_sandbox_by_name(monkeypatch):
    from trident.sandbox.pool import SandboxPool
    from trident.sandbox.service import RemoteSandbox

    fusion = make_sandbox("sandboxfusion+http://127.0.0.1:9")
    assert isinstance(fusion, SandboxFusionSandbox) and fusion.base_url == "http://127.0.0.1:9"
    fusion.close()
    for spec in ("http://127.0.0.1:9", "trident+http://127.0.0.1:9"):
        remote = make_sandbox(spec, retries=0)
        assert isinstance(remote, RemoteSandbox) and remote.base_url == "http://127.0.0.1:9"
        remote.close()
    monkeypatch.setenv("TRIDENT_SANDBOX", "sandboxfusion+http://127.0.0.1:10")
    from_env = make_sandbox()
    assert isinstance(from_env, SandboxFusionSandbox) and from_env.base_url.endswith(":10")
    from_env.close()
    monkeypatch.delenv("TRIDENT_SANDBOX")
    local = make_sandbox(max_concurrency=1)
    assert isinstance(local, SandboxPool)
    local.close()
    with pytest.raises(ValueError, match="unknown sandbox"):
        make_sandbox("docker")


# -- e2b -----------------------------------------------------------------------------------------


def test_e2b_without_the_extra_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "e2b_code_interpreter", None)  # import fails
    monkeypatch.setenv("E2B_API_KEY", "e2b_test")
    from trident.sandbox.e2b_backend import E2BSandbox

    with pytest.raises(ImportError, match=r"pip install 'trident\[e2b\]'"):
        E2BSandbox()
    with pytest.raises(ImportError, match=r"pip install 'trident\[e2b\]'"):
        make_sandbox("e2b")


def test_e2b_without_an_api_key_says_so(monkeypatch):
    # The SDK's import is satisfied by a bare module: nothing is called before the key check.
    monkeypatch.setitem(sys.modules, "e2b_code_interpreter", types.ModuleType("stub"))
    monkeypatch.delenv("E2B_API_KEY", raising=False)
    from trident.sandbox.e2b_backend import E2BSandbox

    with pytest.raises(RuntimeError, match="E2B_API_KEY"):
        E2BSandbox()
    with pytest.raises(RuntimeError, match="E2B_API_KEY"):
        make_sandbox("e2b:my-template")


def _e2b_sdk_installed() -> bool:
    try:
        import e2b_code_interpreter  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _e2b_sdk_installed(), reason="needs pip install 'trident[e2b]'")
def test_e2b_unreachable_service_is_an_infra_error(monkeypatch):
    """The real SDK, no account needed: a service that cannot be reached is status ``error``."""
    monkeypatch.setenv("E2B_CONNECTION_RETRIES", "0")
    from trident.sandbox.e2b_backend import E2BSandbox

    with E2BSandbox(api_key="e2b_" + "0" * 40, domain="invalid.localhost") as sandbox:
        result = sandbox.run(["true"], timeout_s=2)
        assert result.status == "error" and "e2b failed" in result.stderr, result
        session = sandbox.open_session()
        assert session.exec("1").status == "error"


@pytest.mark.skipif(
    not os.environ.get("E2B_API_KEY") or not _e2b_sdk_installed(),
    reason="live e2b test: needs E2B_API_KEY and pip install 'trident[e2b]'",
)
def test_e2b_live():
    from trident.sandbox.e2b_backend import E2BSandbox

    with E2BSandbox() as sandbox:
        result = sandbox.run(
            ["python3", "main.py"],
            stdin="2 3\n",
            files={"main.py": "import sys\nprint(sum(map(int, sys.stdin.read().split())))"},
        )
        assert result.status == "ok" and result.stdout.strip() == "5", result
        failed = sandbox.run(["sh", "-c", "echo oops >&2; exit 4"])
        assert (failed.status, failed.exit_code) == ("ok", 4) and "oops" in failed.stderr
        hung = sandbox.run(["sleep", "30"], timeout_s=2)
        assert hung.status == "timeout", hung
        assert (
            asyncio.run(
                code_reward(
                    "```python\nprint(int(input()) * 2)\n```",
                    tests=[{"input": "21", "output": "42"}],
                    sandbox=sandbox,
                )
            )
            == 1.0
        )
        with sandbox.open_session() as session:
            assert session.exec("x = 41").passed
            assert session.exec("x + 1").stdout.strip() == "42"
