"""Checkpoints of a run, and what a run directory that already exists means.

A checkpoint ``runs/<name>/checkpoints/<step_K | final>/`` holds:

- the policy as an HF checkpoint (``config.json``, ``model.safetensors``, the tokenizer) at its
  top level, so users load it with ``from_pretrained`` as before;
- ``trainer/``: the full training state (``PolicyWorker.save_state``: sharded weights and
  optimizer moments with ``torch.distributed.checkpoint``, LR schedules, the KL controller,
  running baselines, RNG);
- ``run_state.pt``: the harness's state (``RunHarness.state_dict``: the step, the weight version,
  the prompt cursor and draw count, the token ledger and the samples scored since its last
  count, the groups waiting in the buffer and the groups being generated, with their partial
  responses);
- ``manifest.json``, written last.

Atomicity (``train/atomic.py``): everything is written into ``checkpoints/.tmp-<name>/`` and
renamed into place after the manifest; a checkpoint without a manifest (a run killed while
writing it) is never picked.

Run directories (``run.resume``, ``run.overwrite``): ``never`` refuses a directory that already
holds a run unless ``run.overwrite``; ``auto`` continues from the newest complete checkpoint, or
starts fresh when there is none; a path continues from that checkpoint. On resume
``metrics.jsonl`` is cut back to the steps before the checkpoint, so the log of a resumed run is
the log of a run that never stopped.

trident deletes nothing it did not write for this attempt. Whatever a new attempt would replace
goes to ``attempts/<time>/`` inside the run directory, at the same relative paths, and one line
on stderr says where:

- starting over (``run.overwrite=true``, or ``--resume`` with no complete checkpoint): everything
  the directory holds (logs, ``metrics.jsonl``, ``samples/``, TensorBoard, hang dumps, evals,
  checkpoints), earlier ``attempts/`` excepted, which stay where they are. Overwrite moves too:
  the user asked for a fresh run, not for the evidence of the old one to go, and a rename costs
  no time and no extra disk (``rm -r <run dir>/attempts`` frees it);
- resuming: the log as it was (``metrics.jsonl``, copied before the cut), ``config.yaml``, the
  lineage of the steps trained again (``samples/step_*.parquet``) and any complete checkpoint
  after the one resumed from.

Hang dumps (``hang-<time>/``) and the servers' logs (``logs/``, appended to) stay in place on a
resume and on an automatic restart (``run.max_restarts``), which resumes the same way.
"""

from __future__ import annotations

import itertools
import json
import shutil
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from trident.config import ConfigError, TridentConfig
from trident.train.atomic import MANIFEST, is_complete, write_dir
from trident.train.atomic import read_manifest as manifest

ATTEMPTS = "attempts"  # what earlier attempts left in a run directory (module docstring)
RUN_STATE = "run_state.pt"


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

    async def fill(tmp: Path) -> None:
        await save_trainer(tmp)
        import torch  # here: ``trident train`` prepares the run directory before it imports torch

        torch.save(run_state, tmp / RUN_STATE)

    final = await write_dir(
        root / name, fill, {"step": run_state["step"], "version": run_state["version"]}
    )
    if keep_last:
        periodic = sorted(
            (p for p in root.glob("step_*") if is_complete(p)), key=lambda p: manifest(p)["step"]
        )
        for old in periodic[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def read_run_state(path: Path) -> dict[str, Any]:
    import torch

    return torch.load(path / RUN_STATE, weights_only=False)


def prepare_run_dir(cfg: TridentConfig) -> Path | None:
    """Apply ``run.resume`` / ``run.overwrite`` to the run directory before anything starts;
    returns the checkpoint to continue from, or None for a fresh run. A directory that holds a
    run and may not be touched fails with one line saying what to pass. Nothing is deleted: what
    a fresh start or a resume replaces is set aside (module docstring)."""
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
            _start_over(run_dir, "run.overwrite=true")
        return None
    if mode == "auto":
        ckpt = newest(run_dir)
        if ckpt is None:
            if holds_run:
                _start_over(run_dir, "--resume found no complete checkpoint")
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
    _keep_redone(run_dir, ckpt, done)
    return ckpt


def new_dir(path: Path) -> Path:
    """Create ``path`` (or ``path-2``, ``path-3``, ... when it exists) and return it."""
    for n in itertools.count(1):
        candidate = path if n == 1 else path.with_name(f"{path.name}-{n}")
        try:
            candidate.mkdir(parents=True)
            return candidate
        except FileExistsError:
            continue
    raise AssertionError("unreachable")


def _set_aside(run_dir: Path, move: list[Path], copy: list[Path]) -> Path:
    """``move`` and ``copy`` (paths in ``run_dir``) into a new ``attempts/<time>/``, at the same
    relative paths; returns it. A rename: no data is copied but ``copy``'s."""
    dest = new_dir(run_dir / ATTEMPTS / time.strftime("%Y%m%d-%H%M%S"))
    for path in copy:
        shutil.copy2(path, dest / path.relative_to(run_dir))
    for path in move:
        target = dest / path.relative_to(run_dir)
        target.parent.mkdir(parents=True, exist_ok=True)
        path.rename(target)
    return dest


def _start_over(run_dir: Path, why: str) -> None:
    """A fresh run in ``run_dir``: everything it holds (but earlier attempts) set aside."""
    old = [p for p in sorted(run_dir.iterdir()) if p.name != ATTEMPTS]
    dest = _set_aside(run_dir, move=old, copy=[])
    print(
        f"{why}: starting over in {run_dir}; the previous attempt's files "
        f"({', '.join(p.name for p in old)}) are kept in {dest}",
        file=sys.stderr,
        flush=True,
    )


def _keep_redone(run_dir: Path, ckpt: Path, done: int) -> None:
    """Before steps ``done``... are trained again: the previous attempt's record of them set
    aside (the whole log as it was, the config, those steps' lineage, checkpoints after
    ``done``), then the log cut back to the steps before ``done`` (a partial last line goes)."""
    log = run_dir / "metrics.jsonl"
    lines = log.read_text().splitlines() if log.exists() else []
    kept = [line for line in lines if _step(line, done) < done]
    later = [p for p in (run_dir / "samples").glob("step_*.parquet") if int(p.stem[5:]) >= done]
    root = run_dir / "checkpoints"
    if root.is_dir():
        later += [
            p for p in sorted(root.iterdir()) if is_complete(p) and manifest(p)["step"] > done
        ]
    if kept == lines and not later:
        return
    copy = [p for p in (log, run_dir / "config.yaml") if p.exists()]
    dest = _set_aside(run_dir, move=later, copy=copy)
    if log.exists():
        log.write_text("".join(f"{line}\n" for line in kept))
    print(
        f"resuming {run_dir} from {ckpt} (step {done}): the previous attempt's record of the "
        f"steps from {done} on ({', '.join(p.name for p in copy + later)}) is kept in {dest}",
        file=sys.stderr,
        flush=True,
    )


def _step(line: str, default: int) -> int:
    """A log line's step (``default`` for a line that is not a complete record)."""
    try:
        return int(json.loads(line).get("step", default))
    except (json.JSONDecodeError, AttributeError, TypeError, ValueError):
        return default
