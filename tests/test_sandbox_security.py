"""Escape attempts against the real bubblewrap sandbox: each is contained, returns a status, and
leaves the host (this pytest process, its files, its environment) untouched."""

from __future__ import annotations

import asyncio
import contextlib
import glob
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from trident.sandbox.bwrap import BwrapSandbox
from trident.sandbox.pool import SandboxPool

REPO = Path(__file__).resolve().parents[1]
SLACK_S = 5.0  # "returns within timeout + slack": generous, the machine is shared

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")


@pytest.fixture(scope="module")
def sandbox():
    pool = SandboxPool(max_concurrency=2)
    yield pool
    pool.close()


def py(sandbox, code: str, **kw):
    return sandbox.run(["python3", "-c", code], **kw)


def probe(sandbox, code: str, **kw) -> dict:
    """Run ``code`` (which fills ``out``) and return ``out`` as printed JSON."""
    result = py(
        sandbox, "import json, os, sys\nout = {}\n" + code + "\nprint(json.dumps(out))", **kw
    )
    assert result.status == "ok" and result.exit_code == 0, result
    return json.loads(result.stdout.strip().splitlines()[-1])


TRY_READ = """
def try_read(path):
    try:
        with open(path, 'rb') as f:
            return 'READ:' + f.read(200).decode('latin-1')
    except Exception as e:
        return 'denied:' + type(e).__name__
def try_list(path):
    try:
        return sorted(os.listdir(path))
    except Exception as e:
        return 'denied:' + type(e).__name__
"""


def sandbox_processes(since: float) -> list[psutil.Process]:
    """Live (not zombie) processes running as the sandbox uid that started after ``since``."""
    found = []
    for proc in psutil.process_iter(["uids", "create_time", "name", "status"]):
        uids, created = proc.info["uids"], proc.info["create_time"]
        zombie = proc.info["status"] == psutil.STATUS_ZOMBIE
        if uids and uids.real == 65534 and created and created >= since - 1 and not zombie:
            found.append(proc)
    return found


@contextlib.contextmanager
def removing_runtime_dirs() -> Iterator[None]:
    """Remove the runtime dirs of sandbox hosts this block kills with SIGKILL (no cleanup runs)."""
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "trident-sandbox-*")))
    try:
        yield
    finally:
        for path in (
            set(glob.glob(os.path.join(tempfile.gettempdir(), "trident-sandbox-*"))) - before
        ):
            shutil.rmtree(path, ignore_errors=True)


def assert_no_leftovers(since: float) -> None:
    deadline = time.monotonic() + 5
    while sandbox_processes(since) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sandbox_processes(since) == []


def test_no_network_egress(sandbox):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)
    port = server.getsockname()[1]
    try:
        out = probe(
            sandbox,
            f"""
import socket
for name, addr in (("host_loopback", ("127.0.0.1", {port})), ("internet", ("1.1.1.1", 53))):
    try:
        socket.create_connection(addr, timeout=2).close()
        out[name] = "CONNECTED"
    except OSError as e:
        out[name] = "blocked:" + type(e).__name__
out["interfaces"] = sorted(n for _, n in socket.if_nameindex())
""",
        )
        assert out["host_loopback"].startswith("blocked"), out
        assert out["internet"].startswith("blocked"), out
        assert out["interfaces"] == ["lo"], out
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing ever reached the host's listener
    finally:
        server.close()


def test_host_files_are_not_visible(sandbox):
    secret_paths = [
        str(REPO / "pyproject.toml"),
        str(REPO / "trident" / "sandbox" / "bwrap.py"),
        "/etc/shadow",
        "/root/.bashrc",
        "/root/.profile",
    ]
    out = probe(
        sandbox,
        TRY_READ
        + f"""
paths = {secret_paths!r}
out["direct"] = {{p: try_read(p) for p in paths}}
out["proc1_root"] = {{p: try_read("/proc/1/root" + p) for p in paths}}
out["proc_self_root"] = {{p: try_read("/proc/self/root" + p) for p in paths}}
out["dotdot"] = {{p: try_read("../../../../.." + p) for p in paths}}
out["root_dir"] = try_list("/root")
out["repo_dir"] = try_list({str(REPO)!r})
out["etc"] = try_list("/etc")
""",
    )
    for group in ("direct", "proc1_root", "proc_self_root", "dotdot"):
        for path, outcome in out[group].items():
            assert outcome.startswith("denied"), (group, path, outcome)
    # /root holds at most the path down to the bound Python install, nothing of the host's /root.
    python_prefix = BwrapSandbox().python_prefix
    allowed = {python_prefix.split("/")[2]} if python_prefix.startswith("/root/") else set()
    assert out["root_dir"] in ("denied:FileNotFoundError", sorted(allowed)), out["root_dir"]
    assert str(out["repo_dir"]).startswith("denied"), out["repo_dir"]
    assert "shadow" not in out["etc"] and "hostname" not in out["etc"], out["etc"]


def test_symlinks_do_not_escape(sandbox):
    out = probe(
        sandbox,
        TRY_READ
        + f"""
targets = {{"root": "/root/.bashrc", "repo": {str(REPO / "pyproject.toml")!r}, "shadow": "/etc/shadow"}}
for name, target in targets.items():
    os.symlink(target, name)
    out[name] = try_read(name)
os.symlink("/proc/1/root/root", "proc_link")
out["proc_link"] = try_list("proc_link")
out["proc1_cwd"] = try_list("/proc/1/cwd")
""",
    )
    for name in ("root", "repo", "shadow"):
        assert out[name].startswith("denied"), out
    assert ".bashrc" not in str(out["proc_link"]) and ".bashrc" not in str(out["proc1_cwd"])


def test_writes_outside_the_work_dir_fail(sandbox):
    marker = f"trident-escape-{uuid.uuid4().hex}"
    targets = [f"/{marker}", f"/usr/{marker}", f"/etc/{marker}", f"/root/{marker}"]
    prefix = BwrapSandbox().python_prefix
    targets.append(f"{prefix}/{marker}")
    out = probe(
        sandbox,
        f"""
results = {{}}
for path in {targets!r} + ["/tmp/{marker}", "/sandbox/{marker}"]:
    try:
        with open(path, "w") as f:
            f.write("x")
        results[path] = "WROTE"
    except OSError as e:
        results[path] = "denied:" + type(e).__name__
out = results
""",
    )
    for path in targets:
        assert out[path].startswith("denied"), (path, out[path])
    # Writable: the private /tmp and /sandbox, neither of which is the host's.
    assert out[f"/tmp/{marker}"] == "WROTE" and out[f"/sandbox/{marker}"] == "WROTE"
    for host_path in [*targets, f"/tmp/{marker}", f"/sandbox/{marker}"]:
        assert not os.path.exists(host_path), host_path


def test_fork_bomb_is_bounded_and_cleaned_up(sandbox):
    since = time.time()
    counted = probe(
        sandbox,
        """
import time
children = 0
for _ in range(500):
    try:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        children += 1
    except OSError:
        break
out["children"] = children
""",
    )
    assert counted["children"] < BwrapSandbox().config.max_processes, counted
    bomb = (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    start = time.monotonic()
    result = py(sandbox, bomb, timeout_s=1)
    assert result.status in ("timeout", "killed"), result
    assert time.monotonic() - start < 1 + SLACK_S
    assert subprocess.run(["true"]).returncode == 0  # the host can still fork
    assert_no_leftovers(since)


def test_memory_bomb_is_oom(sandbox):
    result = py(sandbox, "x = bytearray(8 * 1024**3)", memory_mb=256)
    assert result.status == "oom", result
    growing = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 * 1024**2))\n"
    result = py(sandbox, growing, memory_mb=256, timeout_s=10)
    assert result.status == "oom", result


def test_cpu_spin_and_sleep_time_out(sandbox):
    since = time.time()
    for code in ("while True:\n    pass", "import time\ntime.sleep(60)"):
        start = time.monotonic()
        result = py(sandbox, code, timeout_s=0.5)
        assert result.status == "timeout" and result.exit_code is None, result
        assert time.monotonic() - start < 0.5 + SLACK_S
    assert_no_leftovers(since)


def test_output_flood_is_capped(sandbox):
    cap = BwrapSandbox().config.max_output_bytes
    host = psutil.Process()
    rss_before = host.memory_info().rss
    flood = "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n    sys.stderr.write('y' * 65536)\n"
    result = py(sandbox, flood, timeout_s=1)
    assert result.status == "timeout" and result.truncated, result.status
    assert len(result.stdout) == cap and len(result.stderr) == cap
    finite = "import sys\nsys.stdout.write('z' * (20 * 1024**2))\n"
    result = py(sandbox, finite, timeout_s=10)
    assert result.status == "ok" and result.exit_code == 0 and result.truncated
    assert len(result.stdout) == cap
    assert host.memory_info().rss - rss_before < 200 * 1024**2


def test_killing_the_parent_leaves_the_host_alone(sandbox):
    since = time.time()
    for code in (
        "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint('still here')",
        "import os, signal\nos.kill(-1, signal.SIGKILL)",
    ):
        result = py(sandbox, code)
        assert result.status in ("ok", "killed"), result
    assert py(sandbox, "print('next run works')").stdout == "next run works\n"
    assert_no_leftovers(since)


def test_host_environment_does_not_leak(sandbox, monkeypatch):
    secret = f"s3cret-{uuid.uuid4().hex}"
    monkeypatch.setenv("TRIDENT_TEST_SECRET", secret)
    result = py(
        sandbox,
        """
import os
print(dict(os.environ))
for pid in os.listdir('/proc'):
    if pid.isdigit():
        for name in ('environ', 'cmdline'):
            try:
                print(pid, name, open(f'/proc/{pid}/{name}', 'rb').read())
            except OSError as e:
                print(pid, name, 'denied', e)
""",
    )
    assert result.status == "ok" and result.exit_code == 0, result
    assert secret not in result.stdout
    assert "TRIDENT_TEST_SECRET" not in result.stdout


def test_host_processes_cannot_be_seen_or_signalled(sandbox):
    me = os.getpid()
    out = probe(
        sandbox,
        f"""
import signal
out["pids"] = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())
try:
    os.kill({me}, signal.SIGKILL)
    out["kill"] = "SENT"
except OSError as e:
    out["kill"] = "failed:" + type(e).__name__
try:
    os.setuid(0)
    out["setuid"] = "ROOT"
except OSError as e:
    out["setuid"] = "failed:" + type(e).__name__
status = open('/proc/self/status').read()
out["cap_eff"] = [l.split()[1] for l in status.splitlines() if l.startswith('CapEff')][0]
out["no_new_privs"] = [l.split()[1] for l in status.splitlines() if l.startswith('NoNewPrivs')][0]
out["uid"] = os.getuid()
""",
    )
    assert len(out["pids"]) < 10, out["pids"]  # only the sandbox's own processes
    if me > max(out["pids"]):
        assert out["kill"] == "failed:ProcessLookupError", out
    assert out["setuid"].startswith("failed"), out
    assert int(out["cap_eff"], 16) == 0 and out["no_new_privs"] == "1" and out["uid"] == 65534
    assert psutil.pid_exists(me)


def test_file_paths_cannot_escape_the_work_dir(sandbox):
    for bad in ("../evil.py", "/etc/evil", "a/../../evil", "."):
        with pytest.raises(ValueError):
            sandbox.run(["true"], files={bad: "x"})


def test_stopping_sandboxes_mid_setup_leaves_nothing():
    """Kills that land while bwrap is still building the sandbox must not orphan it."""
    since = time.time()
    with SandboxPool(max_concurrency=4) as pool:

        async def burst() -> list:
            runs = [pool.run_async(["sleep", "60"], timeout_s=0.001) for _ in range(8)]
            return await asyncio.gather(*runs)

        assert {r.status for r in asyncio.run(burst())} == {"timeout"}
    for _ in range(3):
        SandboxPool(warm_sessions=2).close()  # closed while its warm sessions start
    assert_no_leftovers(since)


def test_sandbox_dies_with_its_host_process():
    """A host process killed with SIGKILL (no cleanup code runs) takes its sandboxes with it."""
    since = time.time()
    script = (
        "from trident.sandbox.bwrap import BwrapSandbox\n"
        "print('started', flush=True)\n"
        "BwrapSandbox().run(['sleep', '60'], timeout_s=60)\n"
    )
    with removing_runtime_dirs():
        host = subprocess.Popen(
            [sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True
        )
        assert host.stdout is not None and host.stdout.readline().strip() == "started"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if any(p.info["name"] == "sleep" for p in sandbox_processes(since)):
                break
            time.sleep(0.05)
        else:
            pytest.fail("the sandboxed command never started")
        host.kill()
        host.wait()
        assert_no_leftovers(since)
