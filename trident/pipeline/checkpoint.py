"""Checkpoints of a run, and what a run directory that already exists means.

A checkpoint ``runs/<name>/checkpoints/<step_K | final>/`` holds:

- the policy as an HF checkpoint (``config.json``, ``model.safetensors``, the tokenizer) at its
  top level, so users load it with ``from_pretrained`` as before;
- ``trainer/``: the full training state (``PolicyWorker.save_state``: sharded weights and
  optimizer moments with ``torch.distributed.checkpoint``, LR schedules, the KL controller,
  running baselines, RNG);
- ``run_state.pt``: the harness's state (``RunHarness.state_dict``: the step, the weight version,
  the prompt cursor and draw count, the token ledger, the groups waiting in the buffer and the
  groups being generated, with their partial responses);
- ``manifest.json``, written last.

Atomicity: everything is written into ``checkpoints/.tmp-<name>/`` and renamed into place after
the manifest; a checkpoint without a manifest (a run killed while writing it) is never picked.

Run directories (``run.resume``, ``run.overwrite``): ``never`` refuses a directory that already
holds a run unless ``run.overwrite`` (then it is emptied); ``auto`` continues from the newest
complete checkpoint, or starts fresh when there is none; a path continues from that checkpoint.
On resume ``metrics.jsonl`` is cut back to the steps before the checkpoint, so the log of a
resumed run is the log of a run that never stopped.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch

from trident.config import ConfigError, TridentConfig

MANIFEST = "manifest.json"
RUN_STATE = "run_state.pt"


def is_complete(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def manifest(path: Path) -> dict[str, Any]:
    return json.loads((path / MANIFEST).read_text())


def newest(run_dir: Path) -> Path | None:
    """The complete checkpoint with the most steps done (``final`` included), or None."""
    root = run_dir / "checkpoints"
    found = [p for p in root.iterdir() if is_complete(p)] if root.is_dir() else []
    return max(found, key=lambda p: manifest(p)["step"], default=None)


async def write(
    run_dir: Path,
    name: str,
    save_trainer: Callable[[Path], Awaitable[None]],
    run_state: dict[str, Any],
    keep_last: int | None = None,
) -> Path:
    """Write checkpoint ``name`` atomically (module docstring); with ``keep_last``, keep only
    the newest ``keep_last`` periodic (``step_*``) checkpoints."""
    root = run_dir / "checkpoints"
    tmp, final = root / f".tmp-{name}", root / name
    shutil.rmtree(tmp, ignore_errors=True)
    await save_trainer(tmp)
    torch.save(run_state, tmp / RUN_STATE)
    (tmp / MANIFEST).write_text(
        json.dumps({"step": run_state["step"], "version": run_state["version"]}) + "\n"
    )
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    if keep_last:
        periodic = sorted(
            (p for p in root.glob("step_*") if is_complete(p)), key=lambda p: manifest(p)["step"]
        )
        for old in periodic[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def read_run_state(path: Path) -> dict[str, Any]:
    return torch.load(path / RUN_STATE, weights_only=False)


def prepare_run_dir(cfg: TridentConfig) -> Path | None:
    """Apply ``run.resume`` / ``run.overwrite`` to the run directory before anything starts;
    returns the checkpoint to continue from, or None for a fresh run. A directory that holds a
    run and may not be touched fails with one line saying what to pass."""
    run_dir = Path(cfg.derived.run_dir)
    holds_run = (run_dir / "metrics.jsonl").exists() or (run_dir / "checkpoints").exists()
    mode = cfg.run.resume
    if mode == "never":
        if holds_run and not cfg.run.overwrite:
            raise ConfigError(
                f"run directory {run_dir} already holds a run: pass --resume (run.resume=auto) "
                "to continue it, or run.overwrite=true to start over"
            )
        if holds_run:
            shutil.rmtree(run_dir)
        return None
    if mode == "auto":
        ckpt = newest(run_dir)
        if ckpt is None:
            if holds_run:
                shutil.rmtree(run_dir)  # nothing to continue from: the partial log goes too
            return None
    else:
        ckpt = Path(mode)
        if not is_complete(ckpt):
            raise ConfigError(
                f"run.resume={mode}: not a complete trident checkpoint (no {MANIFEST})"
            )
    done = manifest(ckpt)["step"]
    if done >= cfg.pipeline.steps:
        raise ConfigError(
            f"checkpoint {ckpt} is after step {done} of pipeline.steps={cfg.pipeline.steps}: "
            "the run is finished (raise pipeline.steps to train further)"
        )
    _cut_log(run_dir / "metrics.jsonl", done)
    for later in (run_dir / "samples").glob("step_*.parquet"):  # lineage of steps redone
        if int(later.stem.split("_")[1]) >= done:
            later.unlink()
    return ckpt


def _cut_log(path: Path, steps_done: int) -> None:
    """Keep the log lines of steps before ``steps_done`` (a partial last line goes too)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("step", steps_done) < steps_done:
            kept.append(line)
    path.write_text("".join(f"{line}\n" for line in kept))
