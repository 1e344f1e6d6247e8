"""Running a training job: Ray, the rollout servers, the trainer, and the driver that
``pipeline.mode`` selects; checkpoints; the run directory. Everything started here is stopped on
normal exit, exception and Ctrl-C."""

from __future__ import annotations

import asyncio
import importlib
import json
import shutil
from pathlib import Path
from typing import Any

from trident.cluster.ray_cluster import RolloutFleet, init_ray
from trident.config import save_config
from trident.telemetry.metrics import MetricsLogger
from trident.train.group import TrainerGroup

# pipeline.mode -> the driver coroutine ``train(cfg, fleet, trainer, log) -> results``
DRIVERS = {
    "sync": "trident.pipeline.sync:train_sync",
    "colocate_async": "trident.pipeline.colocate_async:train",
    "separate_async": "trident.pipeline.separate_async:train",
}

# trainer-side sync backend -> the server's --weight-transfer-config backend
SERVER_BACKENDS = {"shm": "trident_shm", "nccl": "nccl", "ipc": "ipc"}


def weight_backend(cfg: Any) -> str:
    if cfg.sync.backend != "auto":
        return cfg.sync.backend
    import torch

    return "nccl" if torch.cuda.is_available() else "shm"


def save_checkpoint(trainer: TrainerGroup, run_dir: Path, name: str, keep_last: int | None) -> str:
    out = trainer.call("save_hf", str(run_dir / "checkpoints" / name))
    if keep_last:
        periodic = sorted(
            (run_dir / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1])
        )
        for old in periodic[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return out


def run_train(cfg: Any) -> dict[str, Any]:
    """``trident train``: start Ray, the servers and the trainer; run; stop everything."""
    import ray

    module, name = DRIVERS[cfg.pipeline.mode].split(":")
    driver = getattr(importlib.import_module(module), name)
    run_dir = Path(cfg.derived.run_dir)
    save_config(cfg, run_dir)  # the run directory is complete whatever started the run
    log = MetricsLogger(
        run_dir, cfg.telemetry.tensorboard, cfg.telemetry.wandb_project, cfg.model_dump(mode="json")
    )
    started_ray = not ray.is_initialized()
    init_ray(cfg.cluster)
    try:
        with (
            RolloutFleet(
                cfg, cfg.model.path, run_dir, weight_transfer=SERVER_BACKENDS[weight_backend(cfg)]
            ) as fleet,
            TrainerGroup(cfg) as trainer,
        ):
            results = asyncio.run(driver(cfg, fleet, trainer, log))
    finally:
        log.close()
        if started_ray and not cfg.cluster.address:
            ray.shutdown()
    for key in ("before", "after"):
        if key in results:
            (run_dir / f"eval_{key}.json").write_text(json.dumps(results[key], indent=2) + "\n")
    return results
