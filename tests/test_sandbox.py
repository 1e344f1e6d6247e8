"""The sandbox's behaviour on a real bubblewrap: runs, statuses, the pool's concurrency limit,
sessions (state, TTL, cleanup), the CLI, and the HTTP service with its failure modes."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import psutil
import pytest

from tests.conftest import REPO, run_cli
from tests.test_sandbox_security import SLACK_S, removing_runtime_dirs
from trident.cli import sandbox as sandbox_cli
from trident.sandbox import SandboxResult, SessionClosedError
from trident.sandbox.base import classify
from trident.sandbox.bwrap import BwrapSandbox
from trident.sandbox.pool import SandboxPool
from trident.sandbox.service import RemoteSandbox

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")


@pytest.fixture(scope="module")
def pool():
    pool = SandboxPool(max_concurrency=2, warm_sessions=1, reap_interval_s=0.2)
    yield pool
    pool.close()


def test_run_basics(pool):
    result = pool.run(
        ["python3", "pkg/main.py", "arg"],
        stdin="world",
        files={
            "pkg/main.py": "import os, sys\nprint('hello', input(), sys.argv[1], os.getcwd(), os.environ['X'])\nprint('warn', file=sys.stderr)\nsys.exit(3)",
            "data.bin": b"\x00\x01",
        },
        env={"X": "from-env"},
    )
    assert result.status == "ok" and result.exit_code == 3, result
    assert result.stdout == "hello world arg /sandbox from-env\n"
    assert result.stderr == "warn\n" and not result.truncated
    assert result.duration_s > 0


def test_each_run_starts_from_an_empty_work_dir(pool):
    first = pool.run(
        ["sh", "-c", "echo x > /sandbox/left; echo y > /tmp/left; ls -A /sandbox /tmp"]
    )
    assert first.passed and "left" in first.stdout
    second = pool.run(["sh", "-c", "ls -A /sandbox /tmp"])
    assert second.passed and "left" not in second.stdout, second.stdout


def test_statuses(pool):
    assert pool.run(["python3", "-c", "raise ValueError('boom')"]).status == "ok"
    segv = pool.run(["python3", "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"])
    assert (segv.status, segv.exit_code) == ("killed", 139)
    missing = pool.run(["no-such-command"])
    assert missing.status == "error" and missing.exit_code is None
    assert classify(128 + 24, "") == "timeout"  # SIGXCPU: the CPU-time limit
    assert classify(1, "...\nMemoryError\n") == "oom"
    assert classify(0, "MemoryError") == "ok"  # printed it, exited fine


def test_broken_backend_is_an_infra_error():
    from trident.sandbox.bwrap import BwrapConfig

    broken = BwrapSandbox(BwrapConfig(python_prefix="/nonexistent/python"))
    result = broken.run(["python3", "-c", "print(1)"])
    assert result.status == "error" and "Python" in result.stderr


def test_async_and_sync_entry_points(pool):
    async def main() -> list[SandboxResult]:
        backend = BwrapSandbox()
        try:
            direct = await backend.run_async(["echo", "direct"])
            # A synchronous call from inside a running loop still works (runs on a helper thread).
            nested = backend.run(["echo", "nested"])
        finally:
            backend.close()
        pooled = await asyncio.gather(*(pool.run_async(["echo", str(i)]) for i in range(3)))
        return [direct, nested, *pooled]

    outputs = [r.stdout.strip() for r in asyncio.run(main())]
    assert outputs == ["direct", "nested", "0", "1", "2"]


def test_pool_limits_concurrency():
    program = (
        "import time\nstart = time.monotonic()\ntime.sleep(0.4)\nprint(start, time.monotonic())"
    )
    with SandboxPool(max_concurrency=2) as limited:

        async def burst() -> list[SandboxResult]:
            return await asyncio.gather(
                *(limited.run_async(["python3", "-c", program]) for _ in range(6))
            )

        results = asyncio.run(burst())
    spans = [tuple(map(float, r.stdout.split())) for r in results]
    assert all(r.passed for r in results) and len(spans) == 6
    # CLOCK_MONOTONIC is shared with the sandbox: count how many runs overlapped at each start.
    peak = max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans)
    assert peak <= 2, spans


def test_session_keeps_state(pool):
    with pool.open_session(ttl_s=60) as session:
        assert session.exec("x = 20\nx + 1").stdout == "21\n"
        assert session.exec("x * 2").stdout == "40\n"
        assert session.exec("open('shared.txt', 'w').write('from python')").passed
        bash = session.exec("export GREETING=hi; cd /tmp; cat /sandbox/shared.txt", kind="bash")
        assert bash.passed and bash.stdout == "from python"
        again = session.exec("echo $GREETING $(pwd); echo oops >&2; false", kind="bash")
        assert (again.exit_code, again.stdout, again.stderr) == (1, "hi /tmp\n", "oops\n")
        failed = session.exec("1 / 0")
        assert (
            failed.status == "ok" and failed.exit_code == 1 and "ZeroDivisionError" in failed.stderr
        )
        assert session.exec("echo 'unterminated", kind="bash").exit_code != 0
        assert session.exec("x").stdout == "20\n"  # state survived the errors
        assert session.exec("echo $GREETING", kind="bash").stdout == "hi\n"


def test_session_async(pool):
    async def main() -> str:
        with pool.open_session() as session:
            await session.exec_async("import math")
            result = await session.exec_async("math.factorial(5)")
            return result.stdout

    assert asyncio.run(main()) == "120\n"


def session_processes(session) -> list[psutil.Process]:
    """The session's bwrap process and everything below it (its Python agent, bash, ...)."""
    root = psutil.Process(session.pid)
    return [root, *root.children(recursive=True)]


def assert_all_gone(processes: list[psutil.Process]) -> None:
    _, alive = psutil.wait_procs(processes, timeout=10)
    assert [p for p in alive if p.status() != psutil.STATUS_ZOMBIE] == []


def test_session_cleanup_close_ttl_and_gc():
    with SandboxPool(warm_sessions=2, reap_interval_s=0.1) as fresh:
        with fresh.open_session() as closed_by_with:
            assert closed_by_with.exec("import subprocess").passed
            assert closed_by_with.exec("sleep 0.1", kind="bash").passed
            processes = session_processes(closed_by_with)
            assert len(processes) >= 4  # bwrap, its init, the agent, bash
        assert_all_gone(processes)
        with pytest.raises(SessionClosedError):
            closed_by_with.exec("1")

        expiring = fresh.open_session(ttl_s=0.5)
        assert expiring.exec("y = 1").passed
        processes = session_processes(expiring)
        deadline = time.monotonic() + 10
        while fresh.is_open(expiring.id) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert_all_gone(processes)
        with pytest.raises(SessionClosedError):
            expiring.exec("y")

        dropped = fresh.open_session()
        assert dropped.exec("z = 1").passed
        processes = session_processes(dropped)
        del dropped
        gc.collect()
        assert_all_gone(processes)
        assert fresh.open_sessions == 0


def test_session_timeout_kills_the_session(pool):
    session = pool.open_session()
    start = time.monotonic()
    result = session.exec("import time\ntime.sleep(60)", timeout_s=0.5)
    assert result.status == "timeout"
    assert time.monotonic() - start < 0.5 + SLACK_S
    with pytest.raises(SessionClosedError):
        session.exec("1")
    hung_bash = pool.open_session()
    assert hung_bash.exec("true", kind="bash").passed
    processes = session_processes(hung_bash)
    assert hung_bash.exec("sleep 60", kind="bash", timeout_s=0.5).status == "timeout"
    assert_all_gone(processes)
    session.close()
    hung_bash.close()


def test_session_memory_limit(pool):
    with pool.open_session(memory_mb=256) as session:
        assert session.exec("x = bytearray(2 * 1024**3)").status == "oom"
        assert session.exec("1 + 1").stdout == "2\n"  # a MemoryError does not end the session


def test_cli_run_prints_one_json_object(capsys):
    r = run_cli(
        "sandbox", "run", "--timeout", "5", "--", "python3", "-c", "print(6 * 7)", timeout=120
    )
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert set(result) == {"status", "exit_code", "stdout", "stderr", "duration_s", "truncated"}
    assert (result["status"], result["stdout"]) == ("ok", "42\n")
    assert sandbox_cli.main(["sandbox", "run", "--", "no-such-command"]) == 1
    assert json.loads(capsys.readouterr().out)["status"] == "error"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def start_service() -> Iterator[tuple[RemoteSandbox, subprocess.Popen]]:
    """A real `trident sandbox serve` process and a client of it."""
    port = _free_port()
    command = ["sandbox", "serve", "--port", str(port), "--warm-sessions", "1"]
    with removing_runtime_dirs():  # tests kill the service with SIGKILL
        proc = subprocess.Popen([sys.executable, "-m", "trident.cli.sandbox", *command], cwd=REPO)
        client = RemoteSandbox(f"http://127.0.0.1:{port}", slack_s=3.0, retries=2, backoff_s=0.1)
        try:
            deadline = time.monotonic() + 60
            while not client.health():
                assert proc.poll() is None and time.monotonic() < deadline, "service did not start"
                time.sleep(0.1)
            yield client, proc
        finally:
            client.close()
            proc.terminate()  # a graceful stop closes its pool
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def service():
    with start_service() as started:
        yield started


def test_service_runs_and_sessions(service):
    client, _ = service
    result = client.run(
        ["python3", "main.py"], files={"main.py": "print(input()[::-1])"}, stdin="abc"
    )
    assert result.passed and result.stdout == "cba\n"
    assert client.run(["sleep", "10"], timeout_s=1).status == "timeout"
    with client.open_session() as session:
        assert session.exec("n = 7").passed
        assert session.exec("n * 6").stdout == "42\n"
        assert session.exec("echo $((6 * 7))", kind="bash").stdout == "42\n"
    with pytest.raises(SessionClosedError):
        session.exec("n")
    with pytest.raises(ValueError):
        client.run(["true"], files={"../escape": "x"})

    async def many() -> list[str]:
        results = await asyncio.gather(*(client.run_async(["echo", str(i)]) for i in range(4)))
        return [r.stdout for r in results]

    assert asyncio.run(many()) == ["0\n", "1\n", "2\n", "3\n"]


def test_killed_service_is_an_infra_error(service):
    client, proc = service
    assert client.run(["true"]).passed
    outcome: dict[str, SandboxResult] = {}
    worker = threading.Thread(
        target=lambda: outcome.setdefault("r", client.run(["sleep", "30"], timeout_s=30))
    )
    worker.start()
    time.sleep(1.0)
    proc.kill()  # mid-request
    proc.wait()
    worker.join(timeout=30)
    assert outcome["r"].status == "error", outcome
    after = client.run(["true"])
    assert after.status == "error" and "unreachable" in after.stderr


def test_hung_service_is_an_infra_error():
    """A listener that never answers (failure injection): the client gives up at its deadline."""
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)
        client = RemoteSandbox(f"http://127.0.0.1:{hung.getsockname()[1]}", slack_s=0.5)
        start = time.monotonic()
        result = client.run(["true"], timeout_s=0.5)
        assert result.status == "error" and "did not answer" in result.stderr
        assert time.monotonic() - start < 0.5 + 0.5 + SLACK_S
        session_result = client.open_session().exec("1", timeout_s=0.5)
        assert session_result.status == "error"
        client.close()


def test_a_fleet_spreads_load_and_survives_a_dead_host():
    """``make_sandbox("http://a,http://b")``: calls and sessions spread over both services;
    once one is killed, calls (a run of the code reward's kind) and sessions (a terminal
    trajectory) go to the other, and none fails."""
    from trident.sandbox import make_sandbox
    from trident.sandbox.fleet import SandboxFleet

    with start_service() as (a, proc_a), start_service() as (b, _):
        fleet = make_sandbox(f"{a.base_url}, trident+{b.base_url}", recheck_s=60)
        assert isinstance(fleet, SandboxFleet)
        try:

            async def runs(n: int) -> list[SandboxResult]:
                return list(
                    await asyncio.gather(*(fleet.run_async(["echo", str(i)]) for i in range(n)))
                )

            assert [r.stdout for r in asyncio.run(runs(8))] == [f"{i}\n" for i in range(8)]
            assert min(fleet.calls) >= 2, fleet.calls  # both hosts answered
            sessions = [fleet.open_session() for _ in range(2)]
            assert {s.host for s in sessions} == {a.base_url, b.base_url}
            for s in sessions:
                s.close()
            proc_a.kill()
            proc_a.wait()
            before = list(fleet.calls)
            assert all(r.passed for r in asyncio.run(runs(6)))
            assert fleet.calls[1] - before[1] == 6 and fleet.calls[0] == before[0]
            assert fleet.down_until[0] > time.monotonic()  # a is out until its recheck
            row = {"prompt": "p", "setup": "mkdir -p proj", "check": '[ "$(cat proj/x)" = 7 ]'}

            async def trajectory() -> float | None:
                from trident.envs.terminal import TerminalEnv
                from trident.tools.parsers import AssistantTurn, ToolCall

                env = TerminalEnv(sandbox=fleet)
                await env.reset(row)
                call = ToolCall("c", "bash", {"code": "echo 7 > proj/x"})
                await env.tools.run([call])
                result = await env.step(AssistantTurn("", "", []), [])
                await env.close()
                return result.reward

            assert [asyncio.run(trajectory()) for _ in range(3)] == [1.0, 1.0, 1.0]
        finally:
            fleet.close()
