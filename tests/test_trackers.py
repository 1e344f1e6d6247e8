"""The trackers beside ``metrics.jsonl`` receive the same keys and values at the same steps, in a
real ``trident train`` run with the tracker keys set (conftest's ``short_run``:
``telemetry.wandb_project`` with ``WANDB_MODE=offline``, ``telemetry.mlflow_uri`` a ``file:``
store): W&B read back from the run's ``.wandb`` log, MLflow with ``MlflowClient``. Each is
skipped when its optional package is absent."""

import json

import pytest
from conftest import SHORT_RUN_STEPS

from trident.telemetry.metrics import (
    MLFLOW_EXPERIMENT,
    TRACKER_IDS,
    MetricsLogger,
    numeric,
    read_metrics,
)

# a few of the keys every GRPO step logs: reward, engine/trainer agreement, sync, stage times
STEP_KEYS = {
    "step",
    "reward_mean",
    "loss",
    "mismatch_abs_logp_diff_mean",
    "sync/bytes",
    "time/train_s",
}


def _expected(short_run) -> list[dict]:
    expected = read_metrics(short_run)
    assert [m["step"] for m in expected] == list(range(SHORT_RUN_STEPS))
    assert all(set(m) >= STEP_KEYS for m in expected), [sorted(m) for m in expected]
    return expected


def test_wandb_offline_run_gets_what_metrics_jsonl_gets(short_run):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install 'trident[wandb]')")
    from wandb.proto import wandb_internal_pb2

    expected = _expected(short_run)
    (log_file,) = (short_run / "wandb").glob("offline-run-*/run-*.wandb")
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
    assert len(history) == SHORT_RUN_STEPS
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


def test_mlflow_file_store_gets_what_metrics_jsonl_gets(short_run, monkeypatch):
    pytest.importorskip("mlflow", reason="mlflow is not installed (pip install 'trident[mlflow]')")
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # as for the run (conftest)
    expected = _expected(short_run)
    client = MlflowClient(tracking_uri=f"file:{short_run.parent / 'mlruns'}")
    experiment = client.get_experiment_by_name(MLFLOW_EXPERIMENT)
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "short" and run.info.status == "FINISHED"
    assert run.data.params["algo.name"] == "grpo"  # the run's config, flattened
    assert run.data.params["pipeline.steps"] == str(SHORT_RUN_STEPS)
    got: dict[int, dict[str, float]] = {}
    for key in run.data.metrics:
        for m in client.get_metric_history(run.info.run_id, key):
            got.setdefault(m.step, {})[key] = m.value
    assert sorted(got) == list(range(SHORT_RUN_STEPS))
    assert got == {r["step"]: numeric(r) for r in expected}


def test_a_resumed_run_continues_its_trackers(tmp_path, monkeypatch):
    """Steps 0-4 logged, then a resume from the checkpoint at step 3 logs 3-5 again, through
    ``MetricsLogger`` directly: W&B continues the same run id, MLflow the same run (the resumed
    values the latest at each step, the config as first logged), and TensorBoard shows each step
    once, the resumed run's value from step 3 on."""
    pytest.importorskip("wandb", reason="wandb is not installed (pip install 'trident[wandb]')")
    pytest.importorskip("mlflow", reason="mlflow is not installed (pip install 'trident[mlflow]')")
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri, run_dir = f"file:{tmp_path / 'mlruns'}", tmp_path / "run"
    first = MetricsLogger(run_dir, True, "trident-test", {"seed": 1}, uri)
    for step in range(5):
        first.log(step, {"x": float(step)})
    first.close()
    ids = json.loads((run_dir / TRACKER_IDS).read_text())
    resumed = MetricsLogger(run_dir, True, "trident-test", {"seed": 2}, uri, resume_step=3)
    assert json.loads((run_dir / TRACKER_IDS).read_text()) == ids
    for step in range(3, 6):
        resumed.log(step, {"x": 10.0 + step})
    resumed.close()
    want = {0: 0.0, 1: 1.0, 2: 2.0, 3: 13.0, 4: 14.0, 5: 15.0}

    logs = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert [p.name for p in logs] == [f"run-{ids['wandb']}.wandb"] * 2  # one run, two attempts

    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name(MLFLOW_EXPERIMENT).experiment_id])
    assert run.info.run_id == ids["mlflow"] and run.info.status == "FINISHED"
    assert run.data.params["seed"] == "1"
    latest: dict[int, tuple[int, float]] = {}
    for m in client.get_metric_history(run.info.run_id, "x"):
        if m.step not in latest or m.timestamp >= latest[m.step][0]:
            latest[m.step] = (m.timestamp, m.value)
    assert {step: value for step, (_, value) in latest.items()} == want

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert {e.step: e.value for e in events.Scalars("x")} == want
    assert [e.step for e in events.Scalars("x")] == list(want)  # each step once
