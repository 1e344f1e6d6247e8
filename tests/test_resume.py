"""Exact resume: a run of 2N steps equals N steps + SIGKILL of the driver mid-step N+1 +
``trident train --resume`` + the rest.

Each mode runs three times through the real command line (FSDP2 trainer on Ray, from the demo's
warm-up so rewards vary): uninterrupted; killed with SIGKILL right after the step-N checkpoint
is complete (the driver is then in step N+1); resumed. Every run attaches to the session's vLLM server
(``demo_server``, a ``trident rollout serve``): each run installs its own weights at its start,
so a server that outlives a killed run is what a resume meets in attach mode. In the deterministic mode
(``run.deterministic``: every sample seeded from its group id) the resumed run must train the same
sample ids in the same steps, at the same weight versions, with the same rewards and losses,
and end on the same weights. The token ledger continues across the resume, and the killed run
leaves no process behind. In ``separate_async`` (timing-dependent by nature) the checkpoint
catches groups in flight, whose partial responses the resumed run continues, and every drawn
prompt is trained exactly once.

In ``sync`` the run is killed while it writes a checkpoint after step N: the half-written one is
never picked.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import REPO, start_until, tagged_env, wait_gone
from trident.telemetry.lineage import read_samples
from trident.telemetry.metrics import read_metrics

N = 3
COMPARED = ("reward_mean", "generated/reward_mean", "response_len_mean", "loss", "grad_norm")


def _cmd(model: str, url: str, run_dir: Path, name: str, mode: str, *extra: str) -> list[str]:
    eta = "1" if mode == "separate_async" else "0"
    return [
        sys.executable, "-m", "trident.cli", "train", f"model.path={model}", f"run.dir={run_dir}",
        f"run.name={name}", f"rollout.server_urls=[{url}]", f"pipeline.mode={mode}",
        f"pipeline.max_staleness={eta}",
        f"pipeline.steps={2 * N}", "pipeline.prompts_per_step=4", "rollout.n=4",
        "rollout.max_tokens=16", f"checkpoint.every={N}", "checkpoint.keep_last=2",
        "run.deterministic=true", "eval.before_after=false", "telemetry.progress=false",
        "telemetry.tensorboard=false", *extra,
    ]  # fmt: skip


def _run(cmd: list[str], tag: str) -> None:
    r = subprocess.run(
        cmd, env=tagged_env(tag), capture_output=True, text=True, timeout=900, cwd=REPO
    )
    assert r.returncode == 0, r.stderr[-3000:]


def _kill_when(cmd: list[str], tag: str, ready) -> None:
    """Start ``cmd``; SIGKILL the driver as soon as ``ready()``; no process may be left.
    ``ready()`` is asked every 5 ms: a tiny-model checkpoint is written in ~80 ms, and asked
    every 0.2 s the sync test missed all three after step N in one fresh clone."""
    proc = start_until(cmd, tag, ready, poll=0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    # Ray's reaper, and the servers' death signals (every vLLM process), clean up
    assert wait_gone(tag, timeout=180) == set()


def _story(run_dir: Path) -> list[tuple[int, str, bool, int, float | None]]:
    rows = read_samples(run_dir)
    return sorted(
        (r["step"], r["sample_id"], r["trained"], r["version"], r["reward"]) for r in rows
    )


def _resumed_and_whole(
    mode: str, model: str, url: str, tmp_path: Path, *extra: str, killed_when=None
) -> tuple[Path, Path]:
    """The uninterrupted run and the killed-and-resumed one (``extra``: the latter's own
    overrides; ``killed_when``: when to kill it, by default once step N's checkpoint is done)."""
    tag = uuid.uuid4().hex
    _run(_cmd(model, url, tmp_path, "whole", mode), tag)
    cmd = _cmd(model, url, tmp_path, "killed", mode, *extra)
    manifest = tmp_path / "killed" / "checkpoints" / f"step_{N}" / "manifest.json"
    _kill_when(cmd, tag, killed_when or manifest.exists)
    assert not (tmp_path / "killed" / "checkpoints" / "final").exists()
    _run([*cmd, "--resume"], tag)
    return tmp_path / "killed", tmp_path / "whole"


def test_sync_resume_equals_an_uninterrupted_run(demo_sft_model, demo_server, tmp_path):
    """Killed while it writes a checkpoint after step N (every step is checkpointed in the
    killed run, which changes nothing it computes): the half-written checkpoint is never
    picked, the resume starts from the one before and the steps in between are trained again,
    exactly."""
    ckpts = tmp_path / "killed" / "checkpoints"

    half_written: list[str] = []  # the checkpoint being written at the kill, not complete

    def kill_now() -> bool:
        writing = [p.name.removeprefix(".tmp-") for p in ckpts.glob(".tmp-step_*")]
        if (ckpts / f"step_{N}" / "manifest.json").exists() and writing:
            half_written.extend(w for w in writing if not (ckpts / w / "manifest.json").exists())
            return bool(half_written)
        return False

    resumed, whole = _resumed_and_whole(
        "sync", demo_sft_model, demo_server, tmp_path, "checkpoint.every=1", killed_when=kill_now
    )
    assert half_written
    assert not any(ckpts.glob(".tmp-*"))  # cleared by the resume
    assert json.loads((ckpts / "final" / "manifest.json").read_text())["step"] == 2 * N
    w, r = read_metrics(whole), read_metrics(resumed)
    assert [m["step"] for m in r] == list(range(2 * N))  # the log reads as one run
    assert [m["version"] for m in r] == [m["version"] for m in w]
    assert _story(resumed) == _story(whole)  # same samples, steps, versions and rewards
    assert len({row[1] for row in _story(whole)}) == 2 * N * 16
    for key in COMPARED:
        assert [m[key] for m in r] == pytest.approx([m[key] for m in w], rel=1e-4, abs=1e-6), key
    assert r[-1]["ledger/run/trained_samples"] == w[-1]["ledger/run/trained_samples"] == 2 * N * 16
    final = "checkpoints/final/model.safetensors"
    a, b = load_file(whole / final), load_file(resumed / final)
    assert a.keys() == b.keys()
    for name in a:
        assert (a[name] - b[name]).abs().max() <= 1e-5, name


def test_separate_async_resume_loses_and_repeats_no_sample(demo_sft_model, demo_server, tmp_path):
    """Streaming is timing-dependent (which group finishes first, where an update interrupts a
    response), so two runs differ step by step; what must hold is that the resumed run trains
    every prompt drawn exactly once, like the uninterrupted one, with groups caught in flight
    by the checkpoint continued, and the ledger balanced."""
    resumed, whole = _resumed_and_whole("separate_async", demo_sft_model, demo_server, tmp_path)
    state = torch.load(resumed / "checkpoints" / f"step_{N}" / "run_state.pt", weights_only=False)
    caught = {g.group_id for g in state["inflight"]}
    caught |= {s.group_id for _, samples in state["buffer"]["ready"] for s in samples}
    assert caught, "the checkpoint caught no group in flight or waiting"
    trained = {run: [row[1] for row in _story(run) if row[2]] for run in (resumed, whole)}
    assert len(trained[resumed]) == len(set(trained[resumed])) == 2 * N * 16
    assert set(trained[resumed]) == set(trained[whole])
    assert caught <= {sid.rsplit("-", 1)[0] for sid in trained[resumed]}
    r = read_metrics(resumed)
    assert [m["step"] for m in r] == list(range(2 * N))
    assert all(m["staleness/max"] <= 1 for m in r)
    assert (
        r[-1]["ledger/run/generated_samples"]
        == r[-1]["ledger/run/trained_samples"] + r[-1]["ledger/run/waiting_samples"]
    )
