"""A rollout server killed mid-run (``kill -9`` of its vLLM engine core or of its API server) is
taken out, restarted, brought to the served weights (verified) and rejoins; the run finishes
with no sample lost or duplicated. With two servers the other one carries on meanwhile; with
one, the step waits for the restart. Both kinds of kill, with 2 servers and with 1. A server that dies more often than ``rollout.max_restarts``
stops the run with its log.

Everything is real: ``trident train`` in a subprocess, vLLM servers, Ray, FSDP2; the failure is
a real SIGKILL of a real process."""

import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import httpx

from tests.conftest import Run, cmdline, engine_core, parent, tagged_processes, wait_gone
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
        if "vllm.entrypoints.openai.api_server" in line:
            found.setdefault(int(line[line.index("--port") + 1]), []).append(pid)
    out = {}
    for port, pids in found.items():
        (out[port],) = [p for p in pids if (ppid := parent(p)) and ppid not in pids]
    return out


def _kill_with_requests_in_flight(port: int, pid: int, timeout: float = 120) -> None:
    """SIGKILL ``pid`` (the engine core or the API server of the server on ``port``) while at
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
            os.kill(pid, signal.SIGKILL)
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
    generated = last["ledger/run/generated_samples"]
    discarded = sum(
        v for k, v in last.items() if k.startswith("ledger/run/discarded/") and "_samples" in k
    )
    assert generated == 16 * steps + discarded + last["ledger/run/waiting_samples"]
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
