"""One ``MetricsLogger`` per run: every step's metrics go to ``metrics.jsonl`` (one JSON object
per line, the source of truth), TensorBoard events, and W&B when a project is configured."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


class MetricsLogger:
    def __init__(
        self,
        run_dir: str | Path,
        tensorboard: bool = True,
        wandb_project: str = "",
        config: dict | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = (self.run_dir / "metrics.jsonl").open("a", buffering=1)
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        self._wandb = None
        if wandb_project:
            import wandb

            self._wandb = wandb.init(
                project=wandb_project, dir=str(self.run_dir), config=config or {}
            )

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._jsonl.write(json.dumps(record) + "\n")
        for key, value in record.items():
            if (
                self._tb is not None
                and key != "step"
                and isinstance(value, int | float)
                and math.isfinite(value)
            ):
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(record, step=step)

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return value


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
