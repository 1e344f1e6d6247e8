"""An elastic rollout fleet (``trident.rollout.membership``, ``ServerRecovery.members``): servers
join a running job (routed to only after a verified sync), leave it (their requests in flight
finish), and die out of it (their work resubmitted elsewhere); below ``rollout.min_servers`` the
run waits for a joiner, saying so. One streaming run goes through all of it, with real vLLM
servers (``trident rollout serve``) and nothing lost. And the servers' prefix caches across a
weight install: nothing computed by the old weights is reused, what the new ones compute is."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from tests.conftest import REPO, Run, tagged_env, wait_gone
from trident.telemetry.lineage import read_samples
from trident.telemetry.metrics import read_metrics

# Steps enough that B leaves long before the run could end: until the run takes A out, B serves
# alone at the run's pace (~0.6 s a step). At 8, then at 16, a CI run finished every step before
# C joined (here B left at step 7 to 9 of 16).
STEPS, PROMPTS, N = 40, 4, 2


def _serve(model: str, out: Path, tag: str, *extra: str) -> tuple[Run, str]:
    """``trident rollout serve`` (``extra``: e.g. ``--join RUN_DIR``) and its url, once up."""
    out.mkdir(parents=True)
    cmd = [sys.executable, "-m", "trident.cli", "rollout", "serve", f"model.path={model}",
           f"run.dir={out}", "run.name=server", *extra]  # fmt: skip
    server = Run(cmd, tag, out)
    server.wait_for(lambda: "serving at " in server.output)
    match = re.search(r"serving at (\S+?)[:,]? ", server.output)
    assert match, server.output[-3000:]
    return server, match.group(1)


def _steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _rollout(cmd: str, url: str, run_dir: Path, tag: str, code: int = 0) -> str:
    """``trident rollout join|leave URL RUN_DIR`` (exiting with ``code``); its output."""
    r = subprocess.run(
        [sys.executable, "-m", "trident.cli", "rollout", cmd, url, str(run_dir)],
        env=tagged_env(tag), capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    assert r.returncode == code, r.stdout + r.stderr
    return r.stdout + r.stderr


def test_servers_join_die_and_leave_a_running_job_and_nothing_is_lost(tiny_model, tmp_path):
    """A is up; the run starts on A with ``rollout.min_servers=1``. B (``trident rollout serve
    --join``, started with the run) joins once the run reads its fleet; asked again (``trident
    rollout join``) it is routed to already, and a third server is refused
    (``rollout.max_servers=2``). After the next step A is killed (SIGTERM to a server the run
    attached: mid-generation, its requests are resubmitted to B from their prefixes) and left
    out; after the next, SIGTERM to B drains it (its requests in flight finish on it, then it
    deregisters and stops; ``trident rollout leave`` answers at once since it has left). With
    no server up the run waits and says so, until C (``serve --join``) joins; it finishes on C.
    C listens on 127.0.0.2, an address that is not the run's (loopback, ``127.0.0.1``): to the
    run it is on another host, and it takes every sync's buckets over HTTP (the cross-host path).

    Each joiner's samples come only after its verified sync; every drawn prompt is trained
    exactly once; staleness stays within η; every sync is verified; the fleet size is logged."""
    tag = uuid.uuid4().hex
    a, url_a = _serve(tiny_model, tmp_path / "a", tag)
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "trident.cli", "train", f"model.path={tiny_model}",
        f"run.dir={tmp_path}", "run.name=run", f"rollout.server_urls=[{url_a}]",
        "rollout.min_servers=1", "rollout.max_servers=2", "pipeline.mode=separate_async", "pipeline.max_staleness=1",
        f"pipeline.steps={STEPS}", f"pipeline.prompts_per_step={PROMPTS}", f"rollout.n={N}",
        "rollout.max_tokens=128", "eval.before_after=false", "telemetry.progress=false",
        "telemetry.tensorboard=false", "checkpoint.every=0",
    ]  # fmt: skip
    (tmp_path / "run").mkdir()
    run = Run(cmd, tag, tmp_path)  # its output: tmp_path/output.txt
    b = c = None
    try:
        run.wait_for(lambda: (run_dir / "config.yaml").exists())
        t0 = time.monotonic()
        b, url_b = _serve(tiny_model, tmp_path / "b", tag, "--join", str(run_dir))
        assert f"joined {run_dir}" in b.output
        print(f"serve --join with the run's start: routed to in {time.monotonic() - t0:.1f} s")
        at_join = _steps_done(run_dir)
        assert "in 0.0 s" in _rollout("join", url_b, run_dir, tag)  # routed to already
        third = "http://127.0.0.1:9"  # refused before anything is asked of it
        refused = _rollout("join", third, run_dir, tag, code=2)
        assert f"refused {third}: rollout.max_servers=2 are up" in refused
        run.wait_for(lambda: _steps_done(run_dir) >= at_join + 1)
        a.proc.send_signal(signal.SIGTERM)  # mid-generation: streaming never stops
        run.wait_for(lambda: f"({url_a}) is down: left out" in run.output)
        at_kill = _steps_done(run_dir)
        run.wait_for(lambda: _steps_done(run_dir) >= at_kill + 1)
        b.proc.send_signal(signal.SIGTERM)  # drains: the run stops sending, in-flight finish
        b.finish(timeout=300)
        assert f"left {run_dir}" in b.output, b.output[-2000:]
        drained = re.search(rf"\({re.escape(url_b)}\) left after .*", run.output)
        assert drained, run.output[-3000:]
        print(drained.group(0))
        assert "left" in _rollout("leave", url_b, run_dir, tag)  # it has: the run answers
        run.wait_for(
            lambda: "waiting for rollout servers: 0 up, rollout.min_servers=1" in run.output
        )
        before_c = _steps_done(run_dir)
        assert before_c < STEPS - 2, f"the run may end before C joins: {run.output[-3000:]}"
        t0 = time.monotonic()
        c, url_c = _serve(
            tiny_model, tmp_path / "c", tag, "--join", str(run_dir), "--host", "127.0.0.2"
        )
        assert f"joined {run_dir}" in c.output
        print(f"serve --join: command -> routed to in {time.monotonic() - t0:.1f} s")
        output = run.finish()
        assert run.proc.returncode == 0, output[-3000:]
    finally:
        run.finish()
        for server in (a, b, c):
            if server is not None and server.proc.poll() is None:
                server.proc.send_signal(signal.SIGTERM)
                server.finish(timeout=120)
    assert c is not None and c.proc.returncode == 143, c.output[-2000:]  # the run had ended
    assert wait_gone(tag) == set()

    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(STEPS))
    assert all(m["sync/max_abs_dlogp"] <= 2e-3 for m in metrics)  # every sync verified
    assert all(m["staleness/max"] <= 1 for m in metrics)
    assert max(m["rollout/servers"] for m in metrics) == 2  # A and B
    rows = read_samples(run_dir)
    trained = [r["sample_id"] for r in rows if r["trained"]]
    assert len(trained) == len(set(trained)) == STEPS * PROMPTS * N  # none lost, none twice
    by_server = {url: [r for r in rows if r["server"] == url] for url in (url_a, url_b, url_c)}
    assert all(by_server.values())  # each served some
    # a joiner's samples end with versions pushed to it after it joined, each verified
    assert min(r["version_max"] for r in by_server[url_b]) >= at_join - 1
    assert min(r["version_max"] for r in by_server[url_c]) >= before_c
    # C, on "another host", fetched its first install and every later sync over HTTP; B, on
    # this one, read the shared-memory files
    logs = {
        s: (run_dir / "logs" / f"vllm_server_joined_{s.proc.pid}.log").read_text() for s in (b, c)
    }
    assert "buckets via http" in logs[c] and "via shm" not in logs[c]
    assert "buckets via shm" in logs[b] and "via http" not in logs[b]
    assert metrics[-1]["sync/http_servers"] == 1
    last = metrics[-1]
    for unit in ("samples", "tokens"):
        assert (
            last[f"ledger/run/generated_{unit}"]
            == last[f"ledger/run/trained_{unit}"] + last[f"ledger/run/waiting_{unit}"]
        ), unit


def _prefix_hits(url: str) -> float:
    """The server's prefix-cache hits so far, in tokens (``vllm:prefix_cache_hits_total``)."""
    import httpx

    from trident.rollout.engine import metric_sums

    name = "vllm:prefix_cache_hits_total"
    return metric_sums(httpx.get(f"{url}/metrics", timeout=10).text, [name]).get(name, 0.0)


def test_an_install_keeps_old_prefixes_from_new_requests_and_same_version_ones_reused(
    demo_server,
):
    """A weight install (``WeightGate.update``, as every sync runs it) resets the servers' prefix
    caches: a prompt seen under the old weights is computed again (no hit), and from then on it
    is reused under the new ones (hits), on the session's real vLLM server."""
    import asyncio

    from trident.pipeline.gate import WeightGate
    from trident.rollout.engine import SamplingParams, VLLMClient
    from trident.rollout.router import Router

    async def scenario() -> list[float]:
        router = Router([VLLMClient(demo_server)])
        gate = WeightGate(router)
        prompt = [10 + i % 400 for i in range(300)]  # whole KV blocks of 16 (GPU) or 128 (CPU)
        params = SamplingParams(max_tokens=1, temperature=0.0)
        hits = [_prefix_hits(demo_server)]

        async def ask() -> None:
            await router.generate(prompt, params)
            await asyncio.sleep(1.5)  # the engine's stats reach /metrics with its next log
            hits.append(_prefix_hits(demo_server))

        await ask()  # computed (or hit from an earlier test: not counted below)
        await ask()  # same version: reused

        async def push(urls: list[str]) -> dict[str, float]:
            return {}  # the weights are not the point: the install's cache reset is

        await gate.update(gate.version + 1, push)
        await ask()  # new version: computed again
        await ask()  # and reused
        await router.aclose()
        return hits

    hits = asyncio.run(scenario())
    print(f"prefix-cache hits (tokens) after each request: {hits}")
    gains = [b - a for a, b in zip(hits, hits[1:], strict=False)]
    assert gains[1] > 0, hits  # same-version prefix reused
    assert gains[2] == 0, hits  # an old version's blocks are never hit after the install
    assert gains[3] > 0, hits  # the new version's are
