"""The trackers beside ``metrics.jsonl`` receive the same keys and values at the same steps:
W&B in its own offline mode (read back from the run's ``.wandb`` log), MLflow on a local file
store (read back with ``MlflowClient``). Each is skipped when its optional package is absent."""

import json
from pathlib import Path

import pytest

from trident.telemetry.metrics import MLFLOW_EXPERIMENT, MetricsLogger, numeric, read_metrics

STEPS = [
    {"reward_mean": 0.25, "accuracy": 0.5, "mismatch/abs_logp_mean": 1.5e-7, "sync/bytes": 3_600_000},
    {"reward_mean": 0.75, "accuracy": 1.0, "mismatch/abs_logp_mean": 2.5e-7, "sync/bytes": 3_600_000, "staleness/frac_1": 0.3},
    {"reward_mean": 1.25, "accuracy": 1.0, "time/train_s": 0.125, "sync/bytes": 3_600_000},
]  # fmt: skip


def _log(run_dir: Path, **sinks: str) -> list[dict]:
    log = MetricsLogger(run_dir, tensorboard=False, config={"algo": {"name": "grpo"}}, **sinks)
    for step, metrics in enumerate(STEPS):
        log.log(step, metrics)
    log.close()
    return read_metrics(run_dir)


def test_wandb_offline_run_gets_what_metrics_jsonl_gets(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install 'trident[wandb]')")
    from wandb.proto import wandb_internal_pb2

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    expected = _log(tmp_path / "run", wandb_project="trident-test")
    (log_file,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    history = []
    for data in _leveldb_records(log_file.read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            items = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json)
                for i in record.history.item
            }
            history.append({k: v for k, v in items.items() if not k.startswith("_")})
    assert history == expected


def _leveldb_records(data: bytes) -> list[bytes]:
    """The records of a W&B transaction log: a 7-byte ``:W&B`` header, then LevelDB's log
    format (32 KiB blocks of chunks, each with a 7-byte header: crc32, length, type)."""
    assert data[:4] == b":W&B", data[:7]
    block, pos, chunk, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        kind = data[pos + 6]
        if left < 7 or kind == 0:  # the tail of a block is zero padding
            pos += left
            continue
        length = int.from_bytes(data[pos + 4 : pos + 6], "little")
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            records.append(chunk)
            chunk = b""
    return records


def test_mlflow_file_store_gets_what_metrics_jsonl_gets(tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="mlflow is not installed (pip install 'trident[mlflow]')")
    from mlflow import MlflowClient

    # MLflow 3 refuses the file store unless asked (it wants a database backend, which needs
    # SQLAlchemy: the full `mlflow` package, not mlflow-skinny)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = f"file:{tmp_path / 'mlruns'}"
    expected = _log(tmp_path / "run", mlflow_uri=uri)

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(MLFLOW_EXPERIMENT)
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    assert run.data.params["algo.name"] == "grpo"
    got: dict[int, dict[str, float]] = {}
    for key in run.data.metrics:
        for m in client.get_metric_history(run.info.run_id, key):
            got.setdefault(m.step, {})[key] = m.value
    assert got == {r["step"]: numeric(r) for r in expected}
