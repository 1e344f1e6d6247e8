"""Failure handling of the RL loop: a server that cannot start, an exception mid-run, Ctrl-C.
After each, no vLLM, Ray or trainer process of the run may be left."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import REPO
from trident.rollout.vllm_server import ServerStartError, VLLMServer


def _tagged_processes(tag: str) -> set[int]:
    """Processes whose environment carries ``TRIDENT_TEST_TAG=tag``: the run's own driver, Ray
    processes, trainer actors and vLLM servers all inherit it; nothing else on the machine has it."""
    needle = f"TRIDENT_TEST_TAG={tag}".encode()
    pids = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":  # zombies hold no resources; pid 1 reaps them in its own time
                    pids.add(int(entry.name))
        except OSError:
            continue
    return pids


def _wait_gone(tag: str, timeout: float = 60) -> set[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _tagged_processes(tag):
            return set()
        time.sleep(1)
    return _tagged_processes(tag)


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


def _env(tag: str) -> dict[str, str]:
    return {**os.environ, "TRIDENT_TEST_TAG": tag}


def test_exception_mid_run_leaves_no_process(tiny_model, tmp_path):
    tag = uuid.uuid4().hex
    # An impossible tolerance makes the first weight-sync verification fail: an exception raised
    # after the servers and the trainer are up.
    r = subprocess.run(
        _train_cmd(tiny_model, tmp_path, "sync.tolerance=1e-30"),
        env=_env(tag),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert r.returncode == 2, r.stderr[-3000:]
    assert "error: " in r.stderr and "probe" in r.stderr.strip().splitlines()[-1]
    assert _wait_gone(tag) == set()


def test_ctrl_c_leaves_no_process(tiny_model, tmp_path):
    tag = uuid.uuid4().hex
    proc = subprocess.Popen(
        _train_cmd(tiny_model, tmp_path),
        env=_env(tag),
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
    assert _wait_gone(tag) == set()
