"""One ``MetricsLogger`` per run: every step's metrics go to ``metrics.jsonl`` (one JSON object
per line, the source of truth) and to the trackers the config names beside it: TensorBoard
events, Weights & Biases (``telemetry.wandb_project``) and MLflow (``telemetry.mlflow_uri``).

Every tracker gets the same record as the JSONL line, at the same step; TensorBoard and MLflow
take numbers only, so they get its finite numeric values (W&B takes the record whole). W&B and
MLflow are optional packages (``pip install 'trident[wandb]'`` / ``'trident[mlflow]'``),
imported only when configured. The MLflow run is created through ``MlflowClient`` (no fluent
global "active run"), in the experiment ``trident``, named after the run directory.

A resumed run (``resume_step``: the first step it logs again, the checkpoint's) continues its
trackers rather than starting new ones: TensorBoard purges the events from ``resume_step`` on
(``SummaryWriter(purge_step=...)``), and W&B and MLflow continue the run whose ids the first
attempt wrote to ``trackers.json`` in the run directory (W&B with ``resume="allow"``; MLflow's
run set back to RUNNING, its params not logged again: MLflow refuses a changed value).
Simplification: W&B drops a step not above the last one it took, so the steps trained again
keep the values the killed attempt logged; MLflow keeps both values in a metric's history, the
later one (by timestamp) the resumed run's. ``metrics.jsonl`` is cut back on resume
(``trident.pipeline.checkpoint``) and holds each step once.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path
from typing import Any, Protocol

MLFLOW_EXPERIMENT = "trident"
TRACKER_IDS = "trackers.json"  # in the run directory: the W&B and MLflow run ids, for a resume


class Sink(Protocol):
    """A tracker beside ``metrics.jsonl``."""

    def log(self, step: int, record: dict[str, Any]) -> None:
        """Called once per step with the record written to ``metrics.jsonl``."""

    def close(self) -> None:
        """Called once, when the run ends (also on failure)."""


class MetricsLogger:
    def __init__(
        self,
        run_dir: str | Path,
        tensorboard: bool = True,
        wandb_project: str = "",
        config: dict | None = None,
        mlflow_uri: str = "",
        resume_step: int | None = None,
    ) -> None:
        """``resume_step``: the run resumes from a checkpoint and logs again from this step
        (module docstring)."""
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = (self.run_dir / "metrics.jsonl").open("a", buffering=1)
        self.sinks: list[Sink] = []
        ids = self.run_dir / TRACKER_IDS
        known = json.loads(ids.read_text()) if resume_step is not None and ids.exists() else {}
        if tensorboard:
            self.sinks.append(TensorBoardSink(self.run_dir / "tensorboard", resume_step))
        if wandb_project:
            wandb = WandbSink(wandb_project, self.run_dir, config or {}, known.get("wandb"))
            self.sinks.append(wandb)
            known["wandb"] = wandb.run.id
        if mlflow_uri:
            mlflow = MlflowSink(mlflow_uri, self.run_dir.name, config or {}, known.get("mlflow"))
            self.sinks.append(mlflow)
            known["mlflow"] = mlflow.run_id
        if known:
            ids.write_text(json.dumps(known) + "\n")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._jsonl.write(json.dumps(record) + "\n")
        for sink in self.sinks:
            sink.log(step, record)

    def close(self) -> None:
        self._jsonl.close()
        for sink in self.sinks:
            sink.close()


class TensorBoardSink:
    def __init__(self, log_dir: Path, resume_step: int | None = None) -> None:
        """``resume_step``: events at this step and after are purged (logged again)."""
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(log_dir), purge_step=resume_step)

    def log(self, step: int, record: dict[str, Any]) -> None:
        for key, value in numeric(record).items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A W&B run in ``project``; its files go under ``run_dir/wandb`` (``WANDB_MODE=offline``
    keeps them there, for ``wandb sync`` later)."""

    def __init__(
        self, project: str, run_dir: Path, config: dict, run_id: str | None = None
    ) -> None:
        """``run_id``: the run to continue (a resume), else a new one."""
        import wandb

        self.run = wandb.init(
            project=project,
            name=run_dir.name,
            dir=str(run_dir),
            config=config,
            id=run_id,
            resume="allow" if run_id else None,
        )

    def log(self, step: int, record: dict[str, Any]) -> None:
        self.run.log(record, step=step)

    def close(self) -> None:
        import wandb

        self.run.finish()
        # finish() can return before W&B's service process has written the run's log (seen with
        # wandb 0.31: an offline log still 7 bytes long); teardown waits for that process to exit
        wandb.teardown()


class MlflowSink:
    """An MLflow run at ``tracking_uri`` (a server URL, or ``file:/path`` for a local store);
    the config goes in as flattened params."""

    def __init__(
        self, tracking_uri: str, run_name: str, config: dict, run_id: str | None = None
    ) -> None:
        """``run_id``: the run to continue (a resume), else a new one."""
        from mlflow import MlflowClient
        from mlflow.entities import Param

        self.client = MlflowClient(tracking_uri=tracking_uri)
        if run_id is not None:
            self.client.update_run(run_id, status="RUNNING")
            self.run_id = run_id
            return
        experiment = self.client.get_experiment_by_name(MLFLOW_EXPERIMENT)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self.client.create_experiment(MLFLOW_EXPERIMENT)
        )
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        params = [Param(k, str(v)[:6000]) for k, v in _flatten(config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def log(self, step: int, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, step) for k, v in numeric(record).items()]
        for i in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics per batch
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def numeric(record: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a record, without ``step``: what a scalar tracker can take."""
    return {
        k: v
        for k, v in record.items()
        if k != "step" and isinstance(v, int | float) and math.isfinite(v)
    }


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out |= _flatten(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return value


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of ``metrics.jsonl``. A last line without its newline is a record still being
    written (the run is going) and is left out; a malformed line elsewhere raises."""
    text = (Path(run_dir) / "metrics.jsonl").read_text()
    lines = text.split("\n")
    partial = lines.pop()  # "" when the file ends with a newline
    records = [json.loads(line) for line in lines if line.strip()]
    if partial.strip():
        with contextlib.suppress(json.JSONDecodeError):  # cut short: still being written
            records.append(json.loads(partial))
    return records
