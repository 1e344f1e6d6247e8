"""Per-sample lineage (``trident.telemetry.lineage``): what ``SampleLog`` writes is what
``read_samples`` and ``trident inspect`` give back, whatever the mode; files stay whole Parquet
tables between writes; a row's size is bounded by the text cut."""

import json
import random
import string
import time

import pyarrow.parquet as pq
import pytest
from conftest import run_cli

from trident.sample import Sample
from trident.telemetry.lineage import SampleLog, read_samples
from trident.telemetry.metrics import MetricsLogger


def make_sample(
    sid: str,
    reward: float | None,
    versions: tuple[int, ...] = (3, 3, 4),
    response: str = "Answer: 42",
    **metrics: float,
) -> Sample:
    """A sample with a 2-token prompt (version -1) and one model token per entry of
    ``versions``, then a 1-token tool output (not trained, version -1)."""
    n = len(versions)
    return Sample(
        id=sid,
        group_id=sid.rsplit("-", 1)[0],
        token_ids=list(range(n + 3)),
        loss_mask=[0, 0] + [1] * n + [0],
        logprobs=[0.0, 0.0] + [-0.5] * n + [0.0],
        versions=[-1, -1, *versions, -1],
        reward=reward,
        metrics=dict(metrics),
        metadata={
            "row": {"id": 17, "prompt": [{"role": "user", "content": "What is 12 + 30?"}]},
            "response": response,
        },
    )


def test_rows_hold_each_samples_story(tmp_path):
    log = SampleLog(tmp_path, "all", text_chars=1000)
    trained = [
        make_sample(
            "g1-0", 1.5, **{"reward/task": 1.0, "reward/format": 0.5}, advantage=0.7, mismatch=2e-7
        ),
        make_sample("g1-1", 0.0, versions=(5,), **{"reward/task": 0.0}, advantage=-0.7),
    ]
    dropped = [make_sample("g2-0", 1.0), make_sample("g2-1", 1.0)]
    log.write(3, trained, trained=True, reason=None, version=4)
    log.write(3, dropped, trained=False, reason="no_signal", version=3)

    rows = {r["sample_id"]: r for r in read_samples(tmp_path)}
    assert set(rows) == {"g1-0", "g1-1", "g2-0", "g2-1"}
    first = rows["g1-0"]
    assert (first["step"], first["group_id"], first["prompt_id"]) == (3, "g1", "17")
    assert first["prompt"] == "user: What is 12 + 30?"
    assert first["response"] == "Answer: 42"
    # the version range is over the trained tokens only: prompt and tool tokens carry -1
    assert (first["version_min"], first["version_max"], first["response_tokens"]) == (3, 4, 3)
    assert (rows["g1-1"]["version_min"], rows["g1-1"]["version_max"]) == (5, 5)
    assert first["reward"] == 1.5 and first["reward_parts"] == {"task": 1.0, "format": 0.5}
    assert (first["trained"], first["reason"], first["trained_step"], first["version"]) == (
        True,
        None,
        3,
        4,
    )
    assert (first["advantage"], first["mismatch"]) == (0.7, 2e-7)
    assert rows["g1-1"]["mismatch"] is None
    gone = rows["g2-0"]
    assert (gone["trained"], gone["reason"], gone["trained_step"], gone["version"]) == (
        False,
        "no_signal",
        None,
        3,
    )
    assert gone["advantage"] is None and gone["reward_parts"] == {}
    assert [r["sample_id"] for r in read_samples(tmp_path, step=3)][:2] == ["g1-0", "g1-1"]
    assert read_samples(tmp_path, step=4) == []


def test_each_write_leaves_a_whole_parquet_file(tmp_path):
    log = SampleLog(tmp_path)
    for k in range(3):
        path = log.write(0, [make_sample(f"g{k}-0", 0.0)], trained=False, reason="x", version=0)
        assert pq.read_table(path).num_rows == k + 1  # readable after every write
    assert not list((tmp_path / "samples").glob("*.tmp"))


def test_modes_and_text_cut(tmp_path):
    trained_only = SampleLog(tmp_path / "t", "trained")
    assert (
        trained_only.write(0, [make_sample("a-0", 1.0)], trained=False, reason="x", version=0)
        is None
    )
    trained_only.write(0, [make_sample("a-1", 1.0)], trained=True, reason=None, version=1)
    assert [r["sample_id"] for r in read_samples(tmp_path / "t")] == ["a-1"]

    none = SampleLog(tmp_path / "n", "none")
    assert none.write(0, [make_sample("b-0", 1.0)], trained=True, reason=None, version=1) is None
    assert not (tmp_path / "n" / "samples").exists()

    cut = SampleLog(tmp_path / "c", text_chars=10)
    cut.write(0, [make_sample("c-0", 1.0, response="x" * 25)], trained=True, reason=None, version=1)
    (row,) = read_samples(tmp_path / "c")
    assert row["response"] == "x" * 10 + "… [15 more chars]"
    assert row["prompt"].startswith("user: What") and row["prompt"].endswith("… [12 more chars]")

    with pytest.raises(ValueError, match="all, trained or none"):
        SampleLog(tmp_path, "some")


def test_size_per_sample_is_bounded(tmp_path):
    """Bytes per sample and write seconds per step, at 64 samples per step (two writes per step:
    48 trained, 16 dropped) with random 1,500-character responses (the worst case for compression)
    cut to 1,000. Printed, not asserted: timing belongs in benchmarks; the size bound is asserted."""
    steps, per_step, text_chars = 5, 64, 1000
    rng = random.Random(0)
    log = SampleLog(tmp_path, "all", text_chars=text_chars)
    seconds = []
    for k in range(steps):
        batch = [
            make_sample(
                f"s{k}_{i // 8}-{i % 8}",
                float(i % 2),
                versions=tuple([k] * 200),
                response="".join(rng.choices(string.ascii_letters + string.digits + " ", k=1500)),
                **{"reward/task": float(i % 2)},
                advantage=0.1 * i,
                mismatch=1e-7,
            )
            for i in range(per_step)
        ]
        t0 = time.perf_counter()
        log.write(k, batch[:48], trained=True, reason=None, version=k + 1)
        log.write(k, batch[48:], trained=False, reason="no_signal", version=k)
        seconds.append(time.perf_counter() - t0)
    total = sum(p.stat().st_size for p in (tmp_path / "samples").glob("*.parquet"))
    per_sample = total / (steps * per_step)
    print(
        f"\nlineage: {per_sample:.0f} bytes/sample, {sum(seconds[1:]) / (steps - 1) * 1e3:.1f} "
        f"ms/step (first step {seconds[0] * 1e3:.0f} ms: pyarrow's start-up; {per_step} "
        f"samples/step, texts cut to {text_chars} chars)"
    )
    assert len(read_samples(tmp_path)) == steps * per_step
    assert per_sample < 2 * text_chars + 500  # both texts cut, fixed fields ~150 B


@pytest.fixture(scope="module")
def lineage_run(tmp_path_factory):
    """A run directory as the harness leaves it: metrics.jsonl and two steps of samples."""
    run_dir = tmp_path_factory.mktemp("lineage") / "run"
    metrics = MetricsLogger(run_dir, tensorboard=False)
    log = SampleLog(run_dir)
    for step in range(2):
        metrics.log(
            step, {"reward_mean": 0.25 + step, "accuracy": 0.5, "loss": -0.01, "version": step + 1}
        )
        log.write(
            step,
            [
                make_sample(
                    f"p{step}-0",
                    1.5,
                    **{"reward/task": 1.0, "reward/format": 0.5},
                    advantage=0.7,
                    mismatch=2e-7,
                ),
                make_sample(f"p{step}-1", -1.0 + step, advantage=-0.7, mismatch=3e-5),
            ],
            trained=True,
            reason=None,
            version=step + 1,
        )
        log.write(
            step,
            [make_sample(f"q{step}-0", None)],
            trained=False,
            reason="infra_error",
            version=step,
        )
    metrics.close()
    return run_dir


def test_inspect_tells_a_samples_story(lineage_run):
    r = run_cli("inspect", str(lineage_run), "--sample", "p1-0", timeout=120)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for text in (
        "sample p1-0",
        "prompt 17",
        "user: What is 12 + 30?",
        "Answer: 42",
        "written by policy version 3..4",
        "reward: 1.5  (format 0.5, task 1)",
        "advantage +0.7",
        "trained at step 1 -> produced weights version 2",
        "step 1: reward_mean 1.25, accuracy 0.5, loss -0.01",
    ):
        assert text in out, (text, out)

    r = run_cli("inspect", str(lineage_run), "--sample", "q0-0", timeout=120)
    assert "not trained: infra_error (dropped at step 0, policy version 0)" in r.stdout
    assert "reward: none (not scored)" in r.stdout


def test_inspect_lists_a_step_and_the_worst(lineage_run):
    r = run_cli("inspect", str(lineage_run), "--step", "0", timeout=120)
    assert r.returncode == 0, r.stderr
    assert "step 0: 3 samples" in r.stdout and "reward_mean 0.25" in r.stdout
    assert all(s in r.stdout for s in ("p0-0", "p0-1", "q0-0", "no: infra_error", "→ v1"))
    assert "p1-0" not in r.stdout

    r = run_cli("inspect", str(lineage_run), "--worst", "2", timeout=120)
    lines = [line for line in r.stdout.splitlines() if line.startswith("│")]
    assert [line.split("│")[2].strip() for line in lines] == ["p0-1", "p1-1"]  # -1.0, then 0.0

    r = run_cli("inspect", str(lineage_run), "--worst", "1", "--by", "mismatch", timeout=120)
    assert "3e-05" in r.stdout and "p0-1" in r.stdout

    r = run_cli("inspect", str(lineage_run), "--sample", "nope", timeout=120)
    assert r.returncode == 2 and "no sample 'nope'" in r.stderr
    json.dumps(read_samples(lineage_run))  # plain values throughout
