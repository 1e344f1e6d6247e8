"""Failure handling of the RL loop: a server that cannot start, an exception mid-run, Ctrl-C.
After each, no vLLM, Ray or trainer process of the run may be left."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from trident.rollout.vllm_server import ServerStartError, VLLMServer

PATTERNS = (
    "vllm.entrypoints",
    "raylet",
    "gcs_server",
    "ray::",
    "default_worker.py",
    "PolicyWorker",
)


def _run_processes() -> set[int]:
    pids = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(p in cmd for p in PATTERNS):
            pids.add(int(entry.name))
    return pids


def _wait_gone(before: set[int], timeout: float = 60) -> set[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = _run_processes() - before
        if not left:
            return left
        time.sleep(1)
    return _run_processes() - before


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
    before = _run_processes()
    # An impossible tolerance makes the first weight-sync verification fail: an exception raised
    # after the servers and the trainer are up.
    r = subprocess.run(
        _train_cmd(tiny_model, tmp_path, "sync.tolerance=1e-30"),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert r.returncode == 2, r.stderr[-3000:]
    assert "error: " in r.stderr and "probe" in r.stderr.strip().splitlines()[-1]
    assert _wait_gone(before) == set()


def test_ctrl_c_leaves_no_process(tiny_model, tmp_path):
    before = _run_processes()
    proc = subprocess.Popen(
        _train_cmd(tiny_model, tmp_path),
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
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-3000:]
    assert _wait_gone(before) == set()
