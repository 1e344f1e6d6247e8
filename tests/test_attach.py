"""Attach mode: a vLLM server started outside ``trident train`` (the session's
``demo_server``, a ``trident rollout serve`` in its own process) is checked, synced and verified
every step by two runs in turn, and left running: after them it still answers and serves the
second run's final weights. It stops cleanly on SIGTERM when the session ends
(``conftest.rollout_server``). A URL where no trident server answers stops a run with one line,
before the trainer starts."""

import json
from pathlib import Path

import httpx

from tests.conftest import run_cli

STEPS = 3


def _train(model: str, run_dir: Path, name: str, url: str) -> list[str]:
    return [
        "train", f"model.path={model}", f"run.dir={run_dir}", f"run.name={name}",
        f"rollout.server_urls=[{url}]", f"pipeline.steps={STEPS}", "pipeline.prompts_per_step=4",
        "rollout.n=4", "rollout.max_tokens=12", "eval.before_after=false",
        "telemetry.progress=false", "trainer.cpu_threads=1",
    ]  # fmt: skip


def test_two_runs_sync_and_verify_a_server_they_did_not_start(
    demo_sft_model, demo_server, tmp_path
):
    url = demo_server
    for name in ("first", "second"):
        r = run_cli(*_train(demo_sft_model, tmp_path, name, url))
        assert r.returncode == 0, r.stderr[-3000:]
        assert f"attached to rollout server {url}" in r.stdout + r.stderr
        assert "rollout server(s) up" not in r.stderr  # it started none
        rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").open()]
        assert [m["step"] for m in rows] == list(range(STEPS))
        assert all(m["sync/max_abs_dlogp"] < 1e-3 for m in rows)  # every sync verified
        # left running, at the weights this run pushed last
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        served = httpx.get(f"{url}/weight_info", timeout=10).json()["weight_version"]
        assert served == str(STEPS)


def test_a_url_with_no_trident_server_stops_the_run_in_one_line(tiny_model, tmp_path):
    r = run_cli(*_train(tiny_model, tmp_path, "r", "http://127.0.0.1:9"), timeout=120)
    assert r.returncode == 2, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: rollout server http://127.0.0.1:9 (rollout.server_urls)"), last
    assert "does not answer" in last
