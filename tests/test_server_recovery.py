"""A rollout server killed mid-run (``kill -9`` of its vLLM engine core or of its API server) is
taken out, restarted, brought to the served weights (verified) and rejoins; the run finishes
with no sample lost or duplicated. With two servers the other one carries on meanwhile; with
one, the step waits for the restart. Both kinds of kill, with 2 servers and with 1. A server that dies more often than ``rollout.max_restarts``
stops the run with its log.

A frozen server (SIGSTOP of its engine core or of its API server) is a dead one: taken out by
the liveness or the health check, killed, restarted, rejoined.

Everything is real: ``trident train`` in a subprocess, vLLM servers, Ray, FSDP2; the failure is
a real signal (SIGKILL, SIGSTOP) to a real process."""

import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from tests.conftest import Run, cmdline, engine_core, parent, tagged_processes, wait_gone
from trident.rollout.vllm_server import API_SERVER
from trident.telemetry.lineage import read_samples


def _cmd(model: str, run_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "trident.cli", "train", f"model.path={model}", f"run.dir={run_dir}",
        "run.name=r", "pipeline.prompts_per_step=4", "rollout.n=4", "rollout.max_tokens=12",
        "eval.before_after=false", "telemetry.progress=false", "trainer.cpu_threads=1", *extra,
    ]  # fmt: skip


def _api_servers(tag: str) -> dict[int, int]:
    """The run's vLLM API servers: port -> pid. A child the API server forks (the engine core
    before it sets its title) carries the same command line; the API server is the one whose
    parent does not."""
    found: dict[int, list[int]] = {}
    for pid in tagged_processes(tag):
        line = cmdline(pid).split()
        if API_SERVER in line:
            found.setdefault(int(line[line.index("--port") + 1]), []).append(pid)
    out = {}
    for port, pids in found.items():
        (out[port],) = [p for p in pids if (ppid := parent(p)) and ppid not in pids]
    return out


def _kill_with_requests_in_flight(
    port: int, pid: int, timeout: float = 120, sig: signal.Signals = signal.SIGKILL
) -> None:
    """Send ``sig`` to ``pid`` (the engine core or the API server of the server on ``port``) while at
    least 2 requests are in flight on it, by vLLM's ``/load`` (the run's servers track it:
    ``--enable-server-load-tracking``). A sync's probe is one request, so 2 are at least one
    generation request. A kill picked by the clock or by CPU time can land in a weight sync,
    with generation paused and nothing to resubmit: on a fast host the first work after an idle
    spell is the sync that follows a step."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            load = httpx.get(f"http://127.0.0.1:{port}/load", timeout=1).json()["server_load"]
        except httpx.HTTPError:
            load = 0  # restarting
        if load >= 2:
            os.kill(pid, sig)
            return
        time.sleep(0.005)
    raise AssertionError(f"server on port {port} had no generation in flight for {timeout} s")


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "r" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _servers_after(run_dir: Path, step: int) -> set[str]:
    """The servers that wrote the samples trained after ``step``."""
    return {r["server"] for r in read_samples(run_dir / "r") if r["trained"] and r["step"] > step}


def _assert_nothing_lost(run_dir: Path, steps: int | None, out: str) -> list[dict]:
    """Every step trained a whole batch, no sample twice, the ledger balanced, every sync
    verified, every token within the staleness bound. ``steps=None``: a run stopped early, its
    logged steps."""
    rows = _metrics(run_dir)
    steps = len(rows) if steps is None else steps
    assert [r["step"] for r in rows] == list(range(steps)), out[-3000:]
    assert all(r["trained_samples"] == 16 for r in rows)
    ids = [
        r["sample_id"] for r in read_samples(run_dir / "r") if r["trained"] and r["step"] < steps
    ]
    assert len(ids) == len(set(ids)) == 16 * steps  # none lost, none twice
    last = rows[-1]
    for unit in ("samples", "tokens"):  # a resubmitted prefix's tokens are counted once
        generated = last[f"ledger/run/generated_{unit}"]
        discarded = sum(
            v for k, v in last.items() if k.startswith("ledger/run/discarded/") and unit in k
        )
        trained = last[f"ledger/run/trained_{unit}"]
        assert generated == trained + discarded + last[f"ledger/run/waiting_{unit}"], unit
    assert last["ledger/run/trained_samples"] == 16 * steps
    assert last["ledger/run/trained_tokens"] == sum(r["ledger/trained_tokens"] for r in rows)
    assert all(r["sync/max_abs_dlogp"] < 1e-3 for r in rows)
    assert all(r["staleness/max"] <= 1 for r in rows)
    return rows


def test_two_servers_survive_a_killed_engine_and_a_killed_api_server(tiny_model, tmp_path):
    """separate_async over 2 servers: kill server A's engine core; steps go on on server B while
    A restarts; then kill B's API server (with both down the run waits). Both come back at the
    served weights and steps go on over both; the run is then stopped (SIGTERM) so the test does
    not race the run's end. Requests in flight are resubmitted from their prefix."""
    tag = uuid.uuid4().hex
    cmd = _cmd(
        tiny_model, tmp_path, "pipeline.mode=separate_async", "pipeline.max_staleness=1",
        "rollout.num_servers=2", "pipeline.steps=500",
        "rollout.extra_server_args=[--enable-server-load-tracking]",
    )  # fmt: skip
    run = Run(cmd, tag, tmp_path)
    try:
        run.wait_for(lambda: len(_metrics(tmp_path)) >= 1)
        servers = _api_servers(tag)
        assert len(servers) == 2
        port_a, port_b = sorted(servers)
        _kill_with_requests_in_flight(port_a, engine_core(tag, tmp_path, port_a))
        # a step trained while A is down (taken out, not back yet): B carried the rollout
        run.wait_for(lambda: _metrics(tmp_path)[-1].get("rollout/restarts") == 1)
        assert "rollout/recovery_s" not in _metrics(tmp_path)[-1]
        _kill_with_requests_in_flight(port_b, _api_servers(tag)[port_b])
        run.wait_for(lambda: run.output.count("is back at weight version") == 2)
        # both rejoin the router: later steps train samples from both (the first steps after
        # may still be all the first one's, generated ahead while the other was starting)
        both_back = len(_metrics(tmp_path))
        run.wait_for(lambda: len(_servers_after(tmp_path, both_back)) == 2)
        run.proc.send_signal(signal.SIGTERM)
    finally:
        out = run.finish()
    assert run.proc.returncode == 143, out[-3000:]
    rows = _assert_nothing_lost(tmp_path, None, out)
    assert rows[-1]["rollout/restarts"] == 2
    assert rows[-1]["rollout/resubmitted"] >= 1  # the streamed requests were in flight
    assert wait_gone(tag) == set()


def test_one_server_killed_twice_the_steps_wait_for_its_restarts(tiny_model, tmp_path):
    """sync on 1 server: kill -9 of the API server mid-rollout, then, once it is back, of its new
    engine core; each time the step waits for the restart, the groups in flight are generated
    again there, and the run finishes at the served weights."""
    tag, steps = uuid.uuid4().hex, 8
    # long responses (the untrained model rarely stops), so the rollout is most of a step
    cmd = _cmd(tiny_model, tmp_path, f"pipeline.steps={steps}", "rollout.max_tokens=96")
    run = Run(cmd, tag, tmp_path)
    try:
        run.wait_for(lambda: len(_metrics(tmp_path)) >= 1)
        (pid,) = _api_servers(tag).values()
        os.kill(pid, signal.SIGKILL)
        run.wait_for(lambda: "rollout/recovery_s" in _metrics(tmp_path)[-1])
        os.kill(engine_core(tag, tmp_path), signal.SIGKILL)
    finally:
        out = run.finish()
    assert run.proc.returncode == 0, out[-3000:]
    rows = _assert_nothing_lost(tmp_path, steps, out)
    assert rows[-1]["rollout/restarts"] == 2
    assert rows[-1]["rollout/resubmitted"] >= 1  # the groups in flight when it died
    backs = [line for line in out.splitlines() if "is back at weight version" in line]
    assert len(backs) == 2, out[-3000:]
    # brought back to the trained weights, not the start-up ones
    assert all(int(b.split("version ")[1].split()[0]) >= 1 for b in backs)
    assert wait_gone(tag) == set()


def test_liveness_judges_only_a_server_with_requests_pending_and_no_progress():
    """The frozen-engine rule (``trident.pipeline.recovery.Liveness``), one check every 2 s with a
    timeout of 10 s: a busy server whose counters move is never judged, however long it is busy;
    an idle or paused one (nothing of ours pending: the weight gate drains before a pause) is
    never judged however still its counters; unreadable counters judge nothing; the stall is
    counted from when requests were pending with the counters still, not from the last move."""
    from trident.pipeline.recovery import Liveness

    def stalls(checks: list[tuple[int, tuple[float, ...] | None]]) -> list[float]:
        rule = Liveness()
        return [rule.stalled_s(2.0 * t, n, p) for t, (n, p) in enumerate(checks)]

    busy = [(8, (5.0, 100.0 + t, 0.5)) for t in range(100)]  # a token a check, for 200 s
    assert max(stalls(busy)) == 0
    prefill = [(1, (5.0, 100.0, 0.1 * (t % 7))) for t in range(100)]  # KV usage moves
    assert max(stalls(prefill)) == 0
    paused = [(0, (5.0, 100.0, 0.0))] * 100  # still counters, nothing pending
    assert max(stalls(paused)) == 0
    assert max(stalls([(3, None)] * 100)) == 0
    # idle for 20 s, then 2 requests and nothing moves: 10 s after they are first seen
    frozen = stalls([(0, (5.0, 100.0, 0.0))] * 10 + [(2, (5.0, 100.0, 0.0))] * 6)
    assert frozen[9:] == [0, 0, 2, 4, 6, 8, 10]
    # a move resets it; so does a check with nothing pending
    moved = stalls([(2, (1.0, 1.0, 0.0))] * 4 + [(2, (1.0, 2.0, 0.0))] + [(2, (1.0, 2.0, 0.0))] * 2)
    assert moved == [0, 2, 4, 6, 0, 2, 4]


def test_a_server_killed_for_memory_stops_the_run_in_one_line():
    """A server whose restart fails because Ray's memory monitor killed it (its sweep often
    takes a trainer rank too) stops the run with one line: what was killed, the node's memory
    and the settings to lower; not the server's log, which says nothing of it. The failure is
    injected (a restarter raising Ray's error as its raylet words it); the monitor itself, for
    real, is ``test_failures``' memory test, where either death may be seen first."""
    import asyncio

    from ray.exceptions import OutOfMemoryError

    from trident.pipeline.gate import WeightGate
    from trident.pipeline.recovery import ServerRecovery
    from trident.rollout.engine import VLLMClient
    from trident.rollout.router import Router

    killed = OutOfMemoryError(
        "Task was killed due to the node running low on memory.\n"
        "Memory on the node (IP: 127.0.0.1, ID: 1f2e) was 7.06GB used / 23.59GB limit (0.30)\n"
        "Selected to kill: job ID=01000000, lease ID=2a3b, task name=RolloutServerActor.__init__"
        ", required resources={}, pid=4242, actual memory used=0.07GB, worker ID=3c4d)\n"
        "Top 10 memory users:\nPID\tMEM(GB)\tCOMMAND\n4243\t0.35\tray::PolicyWorker"
    )

    class Fleet:  # the owner of the servers, whose restart meets the monitor's kill
        nodes: dict[str, str] = {}

        async def restart(self, i: int) -> VLLMClient:
            raise killed

        def log_path(self, i: int) -> Path:
            raise AssertionError("the log is not read for a kill by the memory monitor")

    async def recover() -> BaseException | None:
        router = Router([VLLMClient("http://127.0.0.1:9")])
        recovery = ServerRecovery(
            router, WeightGate(router), trainer=None, fleet=Fleet(), max_restarts=3,  # type: ignore[arg-type]
            health_check_s=1.0,
        )  # fmt: skip
        router.take_out(0)  # what a failed request or health check does; recovery.down follows
        await asyncio.gather(*recovery._tasks)
        return router.fatal

    error = asyncio.run(recover())
    assert str(error) == (
        "rollout server 0 ran out of memory: Ray's memory monitor killed RolloutServerActor "
        "(0.07GB) with the node at 7.06GB of 23.59GB: the run does not fit in memory; lower "
        "trainer.micro_batch_tokens or trainer.logprob_chunk_tokens, or set "
        "trainer.activation_checkpointing=true, model.lora, or rollout.max_restarts=0 (no kept "
        "copy of the served weights)"
    )


@pytest.mark.parametrize("frozen", ["engine_core", "api_server"])
def test_a_frozen_server_is_taken_out_killed_and_restarted(tiny_model, tmp_path, frozen):
    """sync on 1 server: SIGSTOP mid-rollout of its engine core, whose API server still answers
    ``/health`` (the liveness check takes it out: requests pending, no progress in ``/metrics``
    for ``rollout.liveness_timeout_s``), or of its API server (the health check takes it out:
    ``/health`` no longer answers). Its process group is killed, the stopped process with it,
    it is restarted and rejoins at the served weights, the groups in flight are generated again,
    and the run finishes its steps."""
    tag, steps = uuid.uuid4().hex, 3
    cmd = _cmd(
        tiny_model, tmp_path, f"pipeline.steps={steps}", "rollout.max_tokens=96",
        "rollout.liveness_timeout_s=10", "rollout.extra_server_args=[--enable-server-load-tracking]",
    )  # fmt: skip
    run = Run(cmd, tag, tmp_path)
    try:
        run.wait_for(lambda: len(_metrics(tmp_path)) >= 1)
        ((port, api_server),) = _api_servers(tag).items()
        pid = engine_core(tag, tmp_path) if frozen == "engine_core" else api_server
        _kill_with_requests_in_flight(port, pid, sig=signal.SIGSTOP)
        stopped = time.monotonic()
        run.wait_for(lambda: "is down: restarting" in run.output)
        out_s = time.monotonic() - stopped
        run.wait_for(lambda: "is back at weight version" in run.output)
        back_s = time.monotonic() - stopped
        print(
            f"SIGSTOP of the {frozen}: taken out after {out_s:.1f} s, back in after {back_s:.1f} s"
        )
    finally:
        out = run.finish()
    assert run.proc.returncode == 0, out[-3000:]
    assert not cmdline(pid)  # the stopped process was killed with its process group
    rows = _assert_nothing_lost(tmp_path, steps, out)
    assert rows[-1]["rollout/restarts"] == 1
    assert rows[-1]["rollout/resubmitted"] >= 1  # the groups in flight when it froze
    # the engine core's API server answers /health: only the liveness check can find it
    assert ("requests pending and no engine progress" in out) == (frozen == "engine_core")
    assert wait_gone(tag) == set()


def test_a_server_that_dies_too_often_stops_the_run_with_its_log(tiny_model, tmp_path):
    tag = uuid.uuid4().hex
    cmd = _cmd(tiny_model, tmp_path, "pipeline.steps=200", "rollout.max_restarts=0")
    run = Run(cmd, tag, tmp_path)
    try:
        run.wait_for(lambda: len(_metrics(tmp_path)) >= 1)
        os.kill(engine_core(tag, tmp_path), signal.SIGKILL)
    finally:
        out = run.finish(timeout=300)
    assert run.proc.returncode == 2, out[-3000:]
    tail = out[out.rindex("error: ") :]
    assert "rollout server 0" in tail and "rollout.max_restarts=0" in tail, tail[-3000:]
    assert "vllm_server_0.log" in tail  # and the log's last lines follow
    assert wait_gone(tag) == set()


def _kill_at(run: Run, faults: Path, moment: str, kill, frozen: bool = False) -> str:
    """Wait until the run reaches the armed ``moment`` (``trident.weights.faults``), where it
    waits; ``kill(urls)`` one of the servers involved there and return its url once it is gone
    (its ``/health`` no longer answers; at once if ``frozen``: a stopped engine core leaves it
    answering), which lets the run go on into the failure."""
    hit = faults / f"{moment}.hit"
    run.wait_for(hit.exists)
    url = kill(json.loads(hit.read_text()))
    deadline = time.monotonic() + (0 if frozen else 60)
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code != 200:
                break
        except httpx.HTTPError:
            break
        time.sleep(0.1)
    hit.unlink()
    return url


def _killer(tag: str, run_dir: Path, engine: bool, spare: str | None = None, sig=signal.SIGKILL):
    """A ``kill`` for ``_kill_at``: ``sig`` to the engine core (``engine``) or the API server of
    the first server involved other than ``spare``; returns once a killed process is gone."""

    def kill(urls: list[str]) -> str:
        url = next(u for u in urls if u != spare)
        port = int(url.rsplit(":", 1)[1])
        pid = engine_core(tag, run_dir, port) if engine else _api_servers(tag)[port]
        os.kill(pid, sig)
        while sig == signal.SIGKILL and cmdline(pid):
            time.sleep(0.05)
        return url

    return kill


def test_kills_between_a_push_and_its_verify_during_a_rejoin_and_during_a_push(
    tiny_model, tmp_path, monkeypatch
):
    """sync over 2 servers with delta sync, each fault at a named moment (armed by the test,
    ``TRIDENT_FAULT_DIR``): B's API server killed between a push and its verification (the push
    is verified on A alone, which is not sent the version again: a delta applied once); B's new
    engine core killed during its rejoin (B is restarted again); A's engine core killed during a
    later push (the push is repeated on B, in full); then B's engine core frozen (SIGSTOP) during
    a push, with the servers paused: the push's calls to B time out (``sync.timeout_s``), B
    answers ``/health`` but generates no token, so it is taken out, killed and restarted, and the
    push is repeated on A. Every step trains its whole batch, every sync is verified, no sample
    is lost or trained twice; stopped by SIGTERM once all are back."""
    tag = uuid.uuid4().hex
    faults = tmp_path / "faults"
    faults.mkdir()
    monkeypatch.setenv("TRIDENT_FAULT_DIR", str(faults))  # the run's processes inherit it
    cmd = _cmd(
        tiny_model, tmp_path, "rollout.num_servers=2", "sync.delta=true", "pipeline.steps=500",
        "sync.timeout_s=10", "rollout.liveness_timeout_s=10",
    )  # fmt: skip
    run = Run(cmd, tag, tmp_path)
    try:
        run.wait_for(lambda: len(_metrics(tmp_path)) >= 1)
        (faults / "pushed").touch()
        (faults / "rejoin").touch()
        b = _kill_at(run, faults, "pushed", _killer(tag, tmp_path, engine=False))
        assert _kill_at(run, faults, "rejoin", _killer(tag, tmp_path, engine=True)) == b
        run.wait_for(lambda: "is back at weight version" in run.output)
        (faults / "push").touch()
        a = _kill_at(run, faults, "push", _killer(tag, tmp_path, engine=True, spare=b))
        run.wait_for(lambda: run.output.count("is back at weight version") == 2)
        (faults / "push").touch()
        freeze = _killer(tag, tmp_path, engine=True, spare=a, sig=signal.SIGSTOP)
        assert _kill_at(run, faults, "push", freeze, frozen=True) == b
        run.wait_for(lambda: run.output.count("is back at weight version") == 3)
        back = len(_metrics(tmp_path))
        run.wait_for(lambda: len(_metrics(tmp_path)) > back)
        run.proc.send_signal(signal.SIGTERM)
    finally:
        out = run.finish()
    assert run.proc.returncode == 143, out[-3000:]
    rows = _assert_nothing_lost(tmp_path, None, out)
    assert rows[-1]["rollout/restarts"] == 4
    assert "died during its rejoin" in out
    # the repeat of the verified push sent nothing (A held it); every other push sent
    assert [r["sync/servers_sent"] for r in rows].count(0) == 1
    assert wait_gone(tag) == set()
