"""Failure handling of the RL loop: a server that cannot start, an exception mid-run, Ctrl-C, a
SIGTERM. After each, no vLLM, Ray or trainer process of the run may be left. And a connection to
a server that drops without an answer, and a rendezvous port taken before a single rank binds it."""

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import (
    REPO,
    Run,
    cmdline,
    engine_core,
    start_until,
    tagged_env,
    tagged_processes,
    wait_gone,
)
from trident.rollout.vllm_server import ServerStartError, VLLMServer


def test_server_that_fails_to_start_reports_its_log(tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(
        json.dumps({"architectures": ["NoSuchForCausalLM"], "model_type": "nosuch"})
    )
    server = VLLMServer(str(broken), tmp_path / "server.log", weight_transfer_backend=None)
    with pytest.raises(ServerStartError) as err:
        server.start(timeout_s=240)
    message = str(err.value)
    assert "exited with code" in message and str(tmp_path / "server.log") in message
    assert "nosuch" in message.lower()  # the tail of vLLM's own log explains why


def _train_cmd(model: str, run_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "trident.cli", "train", f"model.path={model}", f"run.dir={run_dir}",
        "run.name=r", "pipeline.steps=200", "pipeline.prompts_per_step=4", "rollout.n=4",
        "eval.before_after=false", "telemetry.progress=false", *extra,
    ]  # fmt: skip


def test_exception_mid_run_leaves_no_process(tiny_model, tmp_path):
    tag = uuid.uuid4().hex
    # An impossible tolerance makes the first weight-sync verification fail: an exception raised
    # after the servers and the trainer are up.
    r = subprocess.run(
        _train_cmd(tiny_model, tmp_path, "sync.tolerance=1e-30"),
        env=tagged_env(tag),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert r.returncode == 2, r.stderr[-3000:]
    assert "error: " in r.stderr and "probe" in r.stderr.strip().splitlines()[-1]
    assert wait_gone(tag) == set()


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_or_kill_leaves_no_process(sig, code, tiny_model, tmp_path):
    tag = uuid.uuid4().hex
    proc = subprocess.Popen(
        _train_cmd(tiny_model, tmp_path, "rollout.cpu_threads=2"),
        env=tagged_env(tag),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
    )
    metrics = tmp_path / "r" / "metrics.jsonl"
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline and not (
        metrics.exists() and metrics.read_text().count("\n") >= 2
    ):
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(1)
    assert metrics.exists(), "training never started"
    # the engine computes on the threads asked for, not on the one its Ray actor was given
    environ = Path(f"/proc/{engine_core(tag, tmp_path)}/environ").read_bytes().split(b"\0")
    assert b"OMP_NUM_THREADS=2" in environ
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == code, out[-3000:]
    assert wait_gone(tag) == set()


# -- a connection dropped without an answer ------------------------------------------------------


async def _dropping_server(drops: int, port: int = 0) -> tuple[asyncio.Server, list[int]]:
    """An HTTP server on loopback that closes its first ``drops`` connections after reading the
    request, without answering (what a server closing an idle keep-alive connection looks like
    to the client reusing it), then answers ``{"ok": true}``. Returns it and its connection
    count."""
    seen = [0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen[0] += 1
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1]) for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        )  # fmt: skip
        await reader.readexactly(length)
        if seen[0] > drops:
            body = b'{"ok": true}'
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body)
            )
            await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", port), seen


@pytest.mark.parametrize(("drops", "answered"), [(1, True), (2, False)])
def test_a_dropped_connection_is_retried_once(drops, answered):
    from trident.rollout.engine import EngineError, VLLMClient

    async def main() -> tuple[dict | str, int]:
        server, seen = await _dropping_server(drops)
        port = server.sockets[0].getsockname()[1]
        client = VLLMClient(f"http://127.0.0.1:{port}", timeout_s=10)
        try:
            return await client._post("/v1/completions", {"prompt": [1, 2]}), seen[0]
        except EngineError as e:
            return str(e), seen[0]
        finally:
            await client.aclose()
            server.close()

    got, connections = asyncio.run(main())
    if answered:  # the drop is invisible: one retry on a new connection
        assert (got, connections) == ({"ok": True}, 2)
    else:  # a server that keeps dropping is an error that names it, after one retry only
        assert connections == 2
        assert "/v1/completions" in got and "ServerDisconnectedError" in got


def test_a_client_used_by_successive_event_loops_leaves_no_session_open():
    """The fleet's clients serve the evals and the run, each its own ``asyncio.run``: each loop's
    session is closed as that loop ends, without ``aclose``."""
    from trident.cluster.net import free_port
    from trident.rollout.engine import VLLMClient

    port, sessions = free_port(), []
    client = VLLMClient(f"http://127.0.0.1:{port}", timeout_s=10)

    async def one_loop() -> dict:
        server, _ = await _dropping_server(0, port)
        try:
            answer = await client._post("/v1/completions", {"prompt": [1]})
            sessions.append(client.http)
            return answer
        finally:
            server.close()

    assert [asyncio.run(one_loop()) for _ in range(2)] == [{"ok": True}] * 2
    assert len(set(map(id, sessions))) == 2 and all(s.closed for s in sessions)


# -- a hang ---------------------------------------------------------------------------------------


def _memory_used() -> tuple[int, int]:
    """Bytes used (total - available, as Ray's memory monitor counts) and total."""
    info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    total, available = (int(info[k].split()[0]) << 10 for k in ("MemTotal", "MemAvailable"))
    return total - available, total


def test_a_rank_killed_for_memory_stops_the_run_saying_what_to_change(tiny_model, tmp_path):
    """Ray's memory monitor, for real: the run's Ray kills workers above a threshold set 6 GiB
    over what the machine used before the run (which takes ~3 of them); once it has trained a
    step the test takes the rest and 1 GiB more, and the monitor kills the newest worker, the
    trainer rank (and, at times, the server in the same sweep). The run stops at once (a restart
    would run out again, so ``run.max_restarts`` does not apply) with one line naming what was
    killed and the settings to lower, not Ray's page of memory tables."""
    tag = uuid.uuid4().hex
    env_threshold: dict[str, str] = {}
    cmd = _train_cmd(tiny_model, tmp_path, "run.max_restarts=2", "trainer.cpu_threads=1")
    metrics = tmp_path / "r" / "metrics.jsonl"
    used, total = _memory_used()
    # the run itself (Ray, a server, a rank) takes ~3 GiB more once it is up
    env_threshold["RAY_memory_usage_threshold"] = f"{(used + (6 << 30)) / total:.3f}"
    os.environ.update(env_threshold)
    try:
        run = Run(cmd, tag, tmp_path)
    finally:
        for key in env_threshold:
            os.environ.pop(key)
    ballast: list[bytearray] = []
    try:
        run.wait_for(lambda: metrics.exists() and metrics.read_text().strip() != "")
        used_now, _ = _memory_used()
        assert used_now < (used + (6 << 30)), "the run alone went over the threshold"
        need = used + (6 << 30) - used_now + (1 << 30)
        for _ in range(need >> 28):  # 256 MiB at a time, every page touched
            ballast.append(bytearray(b"\1" * (1 << 28)))
        run.proc.wait(timeout=120)
    finally:
        out = run.finish(timeout=120)
        ballast.clear()
    assert run.proc.returncode == 2, out[-3000:]
    last = out.strip().splitlines()[-1]
    # The monitor's sweep may take the server with the rank; the run reports whichever death
    # it sees first, in one line naming what was killed either way
    assert last.startswith(
        ("error: trainer rank 0 ran out of memory during", "error: rollout server 0 ran out of")
    ), out[-3000:]
    assert "Ray's memory monitor killed PolicyWorker (" in last and " with the node at " in last
    assert "trainer.micro_batch_tokens" in last and "model.lora" in last, last
    # the run is not restarted (it would run out again), and Ray's page is not printed (the
    # monitor may kill a server too, which is restarted like any dead server meanwhile)
    assert ": restarting from " not in out and "Top 10 memory users" not in out
    assert wait_gone(tag, timeout=180) == set()


ORPHAN = """
import os, sys, time
from trident.cluster.process import die_with_parent
parent = os.getpid()
if os.fork() == 0:
    open(sys.argv[1] + ".tmp", "w").write(str(os.getpid()))
    os.rename(sys.argv[1] + ".tmp", sys.argv[1] + ".pid")
    time.sleep(0.5)  # its parent has exited by now: an orphan before it asks
    die_with_parent(parent=parent if sys.argv[2] == "told" else None)
    open(sys.argv[1], "w").write("outlived its parent")
os._exit(0)
"""


@pytest.mark.parametrize("told", [True, False])
def test_a_process_whose_parent_died_before_it_asked_dies_at_once(told, tmp_path):
    """``die_with_parent``'s start-up window, for real: a child whose parent exits before it
    arms ``PR_SET_PDEATHSIG`` gets no signal from the kernel and lives on (a vLLM engine core
    outlived its server so); told the pid that started it, it signals itself at once."""
    out = tmp_path / "outlived"
    code = [sys.executable, "-c", ORPHAN, str(out), "told" if told else "not told"]
    subprocess.run(code, check=True, timeout=60, cwd=REPO)
    pid_file = out.with_suffix(".pid")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not pid_file.exists():
        time.sleep(0.05)
    pid = int(pid_file.read_text())
    while time.monotonic() < deadline and cmdline(pid):
        time.sleep(0.05)
    assert not cmdline(pid)
    assert out.exists() is not told


STUBBORN = """
import os, signal, sys, time
from trident.cluster.process import die_with_parent
parent = os.getpid()
if os.fork() == 0:
    signal.signal(signal.SIGTERM, lambda *_: None)  # a shutdown that never ends
    die_with_parent(parent=parent, kill_after_s=1.0)
    open(sys.argv[1] + ".tmp", "w").write(str(os.getpid()))
    os.rename(sys.argv[1] + ".tmp", sys.argv[1] + ".pid")
    time.sleep(60)
    open(sys.argv[1], "w").write("outlived its parent")
    os._exit(0)
while not os.path.exists(sys.argv[1] + ".pid"):
    time.sleep(0.05)
os._exit(0)
"""


def test_a_process_that_ignores_its_parents_death_is_killed_after_the_grace(tmp_path):
    """``die_with_parent(kill_after_s=...)``, as vLLM's API server arms it: the SIGTERM the
    kernel sends when the parent dies is caught and ignored (a shutdown that hangs); the
    process is killed ``kill_after_s`` later all the same."""
    out = tmp_path / "outlived"
    subprocess.run([sys.executable, "-c", STUBBORN, str(out)], check=True, timeout=60, cwd=REPO)
    pid = int(out.with_suffix(".pid").read_text())
    orphaned = time.monotonic()
    while cmdline(pid) and time.monotonic() < orphaned + 30:
        time.sleep(0.05)
    assert not cmdline(pid) and not out.exists()
    assert time.monotonic() - orphaned > 0.5  # not at once: the grace came first


STUCK_UNWIND = """
import signal, sys, time
import trident.cli.main
cli = sys.modules["trident.cli.main"]  # the module: trident.cli.main is also the package's main()
cli.UNWIND_DUMP_S = 1
signal.signal(signal.SIGTERM, cli._raise_terminated)
try:  # "up" inside: a SIGTERM right after it is caught too
    print("up", flush=True)
    time.sleep(60)
except cli.Terminated:
    time.sleep(3)  # an unwind that hangs
"""


def test_an_unwind_after_sigterm_that_hangs_prints_every_threads_stack():
    """A run's SIGTERM unwinds like Ctrl-C (servers, trainer, Ray stopped on the way out); if
    that takes longer than ``UNWIND_DUMP_S``, every thread's stack is printed, so a job that
    does not stop says where it is stuck."""
    proc = subprocess.Popen(
        [sys.executable, "-c", STUCK_UNWIND], cwd=REPO, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline() == "up\n"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert "Thread 0x" in err and 'File "<string>", line 11' in err  # the hung line


def test_a_hang_dump_says_which_process_is_stopped(tmp_path):
    """py-spy reads no stack of a stopped process; the dump names the process and says which of
    its tree is stopped, and still holds the stacks of the ones that run."""
    from trident.pipeline.watchdog import Watchdog
    from trident.telemetry.trace import Trace

    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys; subprocess.run(['sleep', '60'])"]
    )
    sleeper = None
    try:
        deadline = time.monotonic() + 30
        while not (child := Path(f"/proc/{parent.pid}/task/{parent.pid}/children").read_text()):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        sleeper = int(child.split()[0])
        os.kill(sleeper, signal.SIGSTOP)
        while Path(f"/proc/{sleeper}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
            assert time.monotonic() < deadline
            time.sleep(0.05)

        watchdog = Watchdog(60, tmp_path, Trace(), {"server": parent.pid})

        async def dump() -> Path:
            return watchdog.dump()

        text = (asyncio.run(dump()) / "server.txt").read_text()
        line = watchdog.stopped()  # what the watchdog's one-line message says of it
    finally:
        parent.kill()
        parent.wait()
        if sleeper is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(sleeper, signal.SIGKILL)
    assert text.startswith(f"# server (pid {parent.pid})\n"), text
    assert f"# process {sleeper} (sleep) is stopped (state T in /proc/{sleeper}/stat)" in text
    assert "Failed to get stack traces" not in text, text
    assert line == f"; stopped (SIGSTOP, state T): server's process {sleeper} (sleep)", line
    assert f"# process {parent.pid} " not in text  # the parent runs: py-spy's stack of it
    assert f"Process {parent.pid}: " in text and "subprocess.py" in text, text


def test_a_hang_is_explained_with_every_process_stacks(tiny_model, tmp_path):
    """A rollout server whose engine stops (SIGSTOP of its engine core: its API server still
    answers ``/health``, its requests neither finish nor fail) stalls the step; the watchdog
    dumps the stacks and stops the run with the stage that hung. (A stopped API server is
    caught by the health check before the next weight sync and restarted instead, which on a
    fast host is back before the hang timeout: test_server_recovery.)"""
    tag = uuid.uuid4().hex
    # no periodic health check: it would not see this hang anyway (/health answers)
    cmd = _train_cmd(
        tiny_model, tmp_path, "run.hang_timeout_s=20", "rollout.request_timeout_s=900",
        "rollout.health_check_s=0",
    )  # fmt: skip
    metrics = tmp_path / "r" / "metrics.jsonl"
    proc = start_until(cmd, tag, lambda: metrics.exists() and metrics.read_text().count("\n") >= 1)
    engine = None
    try:
        engine = engine_core(tag, tmp_path)
        os.kill(engine, signal.SIGSTOP)
        out, _ = proc.communicate(timeout=300)
    finally:
        if engine is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(engine, signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2, out[-3000:]
    last = out.strip().splitlines()[-1]
    # the engine stopped in the middle of generation or before the next weight sync
    assert "no step progress" in last, last
    assert re.search(r"stage '(generate' on rollout http://|weight sync' on trainer)", last), last
    assert f"vllm_server_0's process {engine} (" in last, last  # named as stopped
    (hang,) = (tmp_path / "r").glob("hang-*")
    driver = (hang / "driver.txt").read_text()
    assert "asyncio tasks" in driver and "trident/pipeline" in driver  # where the driver waits
    assert "PolicyWorker" in (hang / "trainer_rank0.txt").read_text()  # py-spy's dump
    # the server's dump names it, and its stopped engine core: py-spy reads no stack there
    server = (hang / "vllm_server_0.txt").read_text()
    assert server.startswith("# vllm_server_0 (pid "), server[:3000]
    assert f"# process {engine} (" in server and "is stopped (state T" in server, server[:3000]
    assert "Failed to get stack traces" not in server, server[-3000:]
    assert "vllm/entrypoints" in server, server[:3000]  # py-spy's stack of the API server
    assert wait_gone(tag) == set()


def test_a_dead_trainer_rank_restarts_the_run_then_stops_it_naming_it(tiny_model, tmp_path):
    """``run.max_restarts=1``: a rank that dies before the first checkpoint restarts the run from
    the start (the attempt's files set aside in ``attempts/``); the second death stops the run
    with one line naming the rank and the checkpoint to resume from. (A restart from a
    checkpoint is as exact as ``--resume``: ``tests/test_resume.py``.)"""
    tag = uuid.uuid4().hex
    cmd = _train_cmd(
        tiny_model, tmp_path, "checkpoint.every=3", "checkpoint.keep_last=1", "run.max_restarts=1"
    )
    run_dir = tmp_path / "r"
    checkpoints, metrics = run_dir / "checkpoints", run_dir / "metrics.jsonl"

    def ranks() -> list[int]:
        return [p for p in tagged_processes(tag) if "ray::PolicyWorker" in cmdline(p)]

    def steps() -> list[int]:
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        return [json.loads(line)["step"] for line in lines]

    killed: list[int] = []

    def kill_rank() -> None:
        (rank,) = ranks()
        assert rank not in killed
        os.kill(rank, signal.SIGKILL)
        killed.append(rank)

    run = Run(cmd, tag, tmp_path)
    try:
        run.wait_for(lambda: len(steps()) >= 1)  # step 0 logged; the first checkpoint: step 3
        assert not checkpoints.exists() or not any(checkpoints.glob("step_*"))
        kill_rank()
        run.wait_for(lambda: "restarting from the start" in run.output)
        run.wait_for((checkpoints / "step_3" / "manifest.json").exists)
        kill_rank()
    finally:
        out = run.finish(timeout=300)
    assert run.proc.returncode == 2, out[-3000:]
    assert out.count("trainer rank 0 died during") >= 2, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert "trainer rank 0 died during" in last and f"(pid {killed[-1]})" in last, last
    assert "resume from " in last and "/checkpoints/step_" in last and "--resume" in last, last
    done = steps()
    assert done == list(range(len(done))) and len(done) >= 3  # one log, no step twice
    # the attempt that died before any checkpoint: its log set aside, not deleted
    first = min((run_dir / "attempts").iterdir())
    assert json.loads((first / "metrics.jsonl").read_text().splitlines()[0])["step"] == 0
    assert wait_gone(tag, timeout=180) == set()


def test_a_single_rank_starts_when_its_rendezvous_port_was_taken():
    """Between picking a free port and binding it, another process may take it (seen: the
    trainer rank's ``EADDRINUSE`` while rollout servers restarted). A single rank binds none.
    In a fresh interpreter: a process group, once made, is kept for the process."""
    script = """
import socket
import torch
import torch.distributed as dist
from trident.train.fsdp import init_distributed
taken = socket.socket()
taken.bind(("127.0.0.1", 0))
taken.listen()
init_distributed(0, 1, "127.0.0.1", taken.getsockname()[1])
t = torch.ones(2)
dist.all_reduce(t)
print(dist.get_world_size(), t.tolist())
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == "1 [1.0, 1.0]"
