"""Exact resume: a run of 2N steps equals N steps + SIGKILL of the driver mid-step N+1 +
``trident train --resume`` + the rest.

Each mode runs three times through the real command line (FSDP2 trainer on Ray, from the demo's
warm-up so rewards vary): uninterrupted; killed with SIGKILL right after the step-N checkpoint
is complete (the driver is then in step N+1); resumed. Every run attaches to a vLLM server
(``demo_server``, a ``trident rollout serve``, or the ``separate_async`` test's own): each run
installs its own weights at its start, so a server that outlives a killed run is what a resume
meets in attach mode. In the deterministic mode (``run.deterministic``: every sample seeded
from its group id) the resumed run must train the same sample ids in the same steps, at the same weight versions, with the same rewards and losses,
and end on the same weights. The token ledger continues across the resume, and the killed run
leaves no process behind; ``colocate_async`` (one step off-policy, batch N+1 in the checkpoint)
is as exact as ``sync``. In ``separate_async`` (timing-dependent by nature) the checkpoint
catches responses part-way, which the resumed run continues from their saved tokens and
versions, and every drawn prompt is trained exactly once.

In ``sync`` the run is killed while it writes a checkpoint after step N: the half-written one is
never picked. The automatic restart (``run.max_restarts``, after a trainer rank dies) is as exact
as ``--resume``; both are compared with one uninterrupted run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import (
    REPO,
    cmdline,
    rollout_server,
    start_until,
    tagged_env,
    tagged_processes,
    wait_gone,
)
from trident.models.load import load_tokenizer
from trident.telemetry.lineage import read_samples
from trident.telemetry.metrics import read_metrics

N = 3
STEPS = 4  # of the separate_async runs, 8 prompts each
COMPARED = ("reward_mean", "generated/reward_mean", "response_len_mean", "loss", "grad_norm")


def _cmd(model: str, url: str, run_dir: Path, name: str, mode: str, *extra: str) -> list[str]:
    eta = "0" if mode == "sync" else "1"
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
    mode: str,
    model: str,
    url: str,
    tmp_path: Path,
    *extra: str,
    killed_when=None,
    whole=None,
    shared: tuple[str, ...] = (),
) -> tuple[Path, Path]:
    """The uninterrupted run (``whole``, when one ran already) and the killed-and-resumed one
    (``extra``: the latter's own overrides, ``shared``: both runs'; ``killed_when``: when to
    kill it, by default once step N's checkpoint is done)."""
    tag = uuid.uuid4().hex
    if whole is None:
        _run(_cmd(model, url, tmp_path, "whole", mode, *shared), tag)
        whole = tmp_path / "whole"
    cmd = _cmd(model, url, tmp_path, "killed", mode, *shared, *extra)
    manifest = tmp_path / "killed" / "checkpoints" / f"step_{N}" / "manifest.json"
    _kill_when(cmd, tag, killed_when or manifest.exists)
    assert not (tmp_path / "killed" / "checkpoints" / "final").exists()
    _run([*cmd, "--resume"], tag)
    return tmp_path / "killed", whole


@pytest.fixture(scope="module")
def whole_sync(demo_sft_model, demo_server, tmp_path_factory) -> Path:
    """The uninterrupted ``sync`` run that both ways of continuing a stopped one must equal."""
    run_dir = tmp_path_factory.mktemp("sync")
    _run(_cmd(demo_sft_model, demo_server, run_dir, "whole", "sync"), uuid.uuid4().hex)
    return run_dir / "whole"


def _assert_continued_exactly(resumed: Path, whole: Path) -> None:
    """Same samples, steps, versions, rewards and losses, one log, the ledger continued to the
    token, the same final weights."""
    ckpts = resumed / "checkpoints"
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
    for unit in ("samples", "tokens"):  # the ledger continued across the kill, to the token
        for key in ("generated", "trained", "waiting"):
            assert r[-1][f"ledger/run/{key}_{unit}"] == w[-1][f"ledger/run/{key}_{unit}"], key
    _assert_same_final_weights(whole, resumed)


def test_sync_resume_equals_an_uninterrupted_run(demo_sft_model, demo_server, whole_sync, tmp_path):
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
        "sync", demo_sft_model, demo_server, tmp_path, "checkpoint.every=1",
        killed_when=kill_now, whole=whole_sync,
    )  # fmt: skip
    assert half_written
    _assert_continued_exactly(resumed, whole)


def test_an_automatic_restart_is_as_exact_as_resume(
    demo_sft_model, demo_server, whole_sync, tmp_path
):
    """``run.max_restarts=1``: the trainer rank killed (SIGKILL) in step N+1, after the step-N
    checkpoint; the run restarts everything from that checkpoint by itself and ends exactly as
    the uninterrupted run does."""
    tag = uuid.uuid4().hex
    cmd = _cmd(demo_sft_model, demo_server, tmp_path, "restarted", "sync", "run.max_restarts=1")
    manifest = tmp_path / "restarted" / "checkpoints" / f"step_{N}" / "manifest.json"
    proc = start_until(cmd, tag, manifest.exists, poll=0.005)
    (rank,) = [p for p in tagged_processes(tag) if "ray::PolicyWorker" in cmdline(p)]
    assert os.getpriority(os.PRIO_PROCESS, rank) == 0  # Ray's own default would be nice 15
    os.kill(rank, signal.SIGKILL)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-3000:]
    assert f"restarting from {manifest.parent}" in out, out[-3000:]
    _assert_continued_exactly(tmp_path / "restarted", whole_sync)
    assert wait_gone(tag, timeout=180) == set()


def test_separate_async_resume_loses_and_repeats_no_sample(tiny_model, tmp_path):
    """Streaming is timing-dependent (which group finishes first, where an update interrupts a
    response), so two runs differ step by step; what must hold is that the resumed run trains
    every prompt drawn exactly once, like the uninterrupted one, with groups caught in flight
    by the checkpoint continued, and the ledger balanced. The model is the untrained one, whose
    responses run to ``max_tokens``. The killed run checkpoints every step and is killed right
    after the first checkpoint that holds a response part-way (one an update interrupted that
    has not finished since): each such response must be trained once, continued from the tokens
    it saved, with their own versions."""
    # A checkpoint catches a response part-way only if the rollout is busy then: once it is
    # quicker than a step, it waits with the next batch ready (the buffer's freshness rule) and
    # nothing is in flight at any checkpoint. Generating a batch costs B groups one after
    # another (``max_running_groups=1``), each as many decode steps as its longest response,
    # whatever n is; a step costs B·n samples. So B=8, n=2 and responses up to 448 tokens make
    # the rollout the slower side, on 2 cores too, so long as the two share the cores fairly.
    # They did not on a CI host: the trainer ran at Ray's worker niceness (15, since set to 0 by
    # ``init_ray``) beside a server at 0, got almost no CPU while vLLM generated (a step took
    # 10-14 s there, 0.8 s alone), so every step ended just after the rollout's next batch was
    # done and none of 3 checkpoints caught a response. The run's server here is its own, at
    # the lowest priority (nice 19): the trainer takes the CPU it needs first, and the rollout
    # is the slower side on any host (locally the trainer then waits 5-10 s for each batch).
    ckpts = tmp_path / "killed" / "checkpoints"
    seen: dict[str, list[int]] = {}  # checkpoint -> tokens of each response in flight
    caught_at: dict = {}

    def caught_part_way() -> bool:  # asked of the newest complete checkpoint, once each
        done = [p for p in ckpts.glob("step_*") if (p / "manifest.json").exists()]
        newest = max(done, key=lambda p: int(p.name.split("_")[1]), default=None)
        if newest is None or newest.name in seen:
            return False
        state = torch.load(newest / "run_state.pt", weights_only=False)
        progress = [p for g in state["inflight"] for p in g.progress]
        seen[newest.name] = [len(p.tokens) for p in progress if p.finish is None]
        if any(p.tokens and p.finish is None for p in progress):
            caught_at.update(step=int(newest.name.split("_")[1]), state=state)
            return True
        return False

    (server := tmp_path / "server").mkdir()
    try:
        with rollout_server(tiny_model, server, uuid.uuid4().hex, nice=19) as url:
            resumed, whole = _resumed_and_whole(
                "separate_async", tiny_model, url, tmp_path, "rollout.max_tokens=448",
                "pipeline.max_running_groups=1", "checkpoint.every=1", killed_when=caught_part_way,
                shared=(f"pipeline.steps={STEPS}", "pipeline.prompts_per_step=8", "rollout.n=2"),
            )  # fmt: skip
    except AssertionError as e:  # none caught: what each checkpoint held, and the step times
        times = [
            {k: round(v, 2) for k, v in m.items() if k.startswith("time/")}
            for m in read_metrics(tmp_path / "killed")
        ]
        raise AssertionError(f"in flight at each checkpoint: {seen}; step times: {times}") from e
    state = caught_at["state"]
    assert 0 < caught_at["step"] < STEPS
    caught = {g.group_id for g in state["inflight"]}
    caught |= {s.group_id for _, samples in state["buffer"]["ready"] for s in samples}
    trained = {run: [row[1] for row in _story(run) if row[2]] for run in (resumed, whole)}
    assert len(trained[resumed]) == len(set(trained[resumed])) == STEPS * 8 * 2
    assert set(trained[resumed]) == set(trained[whole])
    assert caught <= {sid.rsplit("-", 1)[0] for sid in trained[resumed]}
    partial = {
        f"{g.group_id}-{k}": p
        for g in state["inflight"]
        for k, p in enumerate(g.progress)
        if p.tokens and p.finish is None
    }
    tokenizer = load_tokenizer(tiny_model)
    rows = {row["sample_id"]: row for row in read_samples(resumed) if row["trained"]}
    for sid, p in partial.items():  # continued from its saved prefix, which kept its versions
        row = rows[sid]
        # a prefix may end inside a character (the untrained model's tokens): compare before it
        prefix = tokenizer.decode(p.tokens, skip_special_tokens=True).rstrip("\ufffd")
        assert row["response"].startswith(prefix)
        assert row["response_tokens"] > len(p.tokens)
        assert row["version_min"] == min(p.versions) and max(p.versions) <= state["version"]
        assert row["version_max"] >= state["version"]  # the rest: by the weights resumed from
    r = read_metrics(resumed)
    assert [m["step"] for m in r] == list(range(STEPS))
    assert all(m["staleness/max"] <= 1 for m in r)
    for unit in ("samples", "tokens"):  # a response continued from its prefix counts once
        assert (
            r[-1][f"ledger/run/generated_{unit}"]
            == r[-1][f"ledger/run/trained_{unit}"] + r[-1][f"ledger/run/waiting_{unit}"]
        ), unit
    assert r[-1]["ledger/run/trained_tokens"] == sum(m["ledger/trained_tokens"] for m in r)


def test_colocate_async_runs_and_resumes_exactly(demo_sft_model, demo_server, tmp_path):
    """One step off-policy, end to end with real parts (FSDP2 trainer on Ray, the vLLM server):
    every batch after the first is sampled by the version before the one that trains on it.
    The step-N checkpoint holds batch N+1, generated while step N trained; nothing straddles a
    weight update, so the resumed run trains the same samples, at the same versions, with the
    same rewards and losses as the uninterrupted one, each sample once, and ends on the same
    weights."""
    resumed, whole = _resumed_and_whole("colocate_async", demo_sft_model, demo_server, tmp_path)
    state = torch.load(resumed / "checkpoints" / f"step_{N}" / "run_state.pt", weights_only=False)
    waiting = [s for _, samples in state["buffer"]["ready"] for s in samples]
    assert len(waiting) == 16  # batch N+1, sampled by version N-1 while step N trained
    assert {v for s in waiting for v, m in zip(s.versions, s.loss_mask, strict=True) if m} == {
        N - 1
    }
    w, r = read_metrics(whole), read_metrics(resumed)
    for rows in (w, r):
        assert [m["step"] for m in rows] == list(range(2 * N))
        assert [m["version"] for m in rows] == list(range(1, 2 * N + 1))
        assert all(m["sync/max_abs_dlogp"] <= 2e-3 for m in rows)  # every sync verified
        assert [m["staleness/max"] for m in rows] == [0] + [1] * (2 * N - 1)  # exactly one off
        # pi_old: the engine's for the on-policy first batch, recomputed for the stale ones
        assert [m["old_logprobs_engine"] for m in rows] == [1.0] + [0.0] * (2 * N - 1)
    story = _story(resumed)
    assert story == _story(whole)  # same samples, steps, versions and rewards
    assert len({row[1] for row in story if row[2]}) == len(story) == 2 * N * 16
    written_by = {
        (row["step"], row["version_min"], row["version_max"]) for row in read_samples(resumed)
    }
    assert written_by == {(step, max(step - 1, 0), max(step - 1, 0)) for step in range(2 * N)}
    for key in COMPARED:
        assert [m[key] for m in r] == pytest.approx([m[key] for m in w], rel=1e-4, abs=1e-6), key
    for unit in ("samples", "tokens"):  # balanced, and continued across the kill to the token
        assert (
            r[-1][f"ledger/run/generated_{unit}"]
            == r[-1][f"ledger/run/trained_{unit}"] + r[-1][f"ledger/run/waiting_{unit}"]
        ), unit
        for key in ("generated", "trained", "waiting"):
            assert r[-1][f"ledger/run/{key}_{unit}"] == w[-1][f"ledger/run/{key}_{unit}"], key
    _assert_same_final_weights(whole, resumed)


def _assert_same_final_weights(whole: Path, resumed: Path) -> None:
    final = "checkpoints/final/model.safetensors"
    a, b = load_file(whole / final), load_file(resumed / final)
    assert a.keys() == b.keys()
    for name in a:
        assert (a[name] - b[name]).abs().max() <= 1e-5, name
