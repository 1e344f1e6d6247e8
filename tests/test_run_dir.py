"""What a run directory that already holds a run becomes: trident deletes nothing it did not
write for this attempt. Starting over (``--resume`` without a complete checkpoint, or
``run.overwrite=true``) moves the previous attempt's files to ``attempts/<time>/``; resuming sets
aside the log and lineage of the steps it trains again; the log line says where. The files are
the ones a run writes (logs, metrics, samples, TensorBoard, a hang dump, checkpoints), written
here by hand: ``prepare_run_dir`` runs before anything starts."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest

from trident.config import ConfigError, load_config
from trident.pipeline.checkpoint import prepare_run_dir
from trident.pipeline.watchdog import Watchdog
from trident.telemetry.trace import Trace


def config(tmp_path: Path, *overrides: str):
    return load_config([], [f"run.dir={tmp_path}", "run.name=r", "pipeline.steps=4", *overrides])


def write_run(run_dir: Path, steps: int, checkpoints: dict[str, int]) -> dict[str, str]:
    """A run directory as a run killed after ``steps`` logged steps leaves it (a partial last
    log line, a hang dump, ``checkpoints``: name -> steps done, complete, and a half-written
    one); returns every file's relative path -> content."""
    records = [json.dumps({"step": k, "loss": 1.0 / (k + 1)}) for k in range(steps)]
    files = {
        "config.yaml": "run:\n  name: r\n",
        "metrics.jsonl": "".join(f"{r}\n" for r in records) + '{"step": ',
        "logs/vllm_server_0.log": "INFO started\nERROR engine core died\n",
        "tensorboard/events.out.tfevents.1": "tb",
        "hang-20250101-000000/driver.txt": "Thread 0x1 (most recent call first)\n",
        "checkpoints/.tmp-step_9/trainer/shard": "half",
    }
    files |= {f"samples/step_{k}.parquet": f"lineage {k}" for k in range(steps)}
    for name, done in checkpoints.items():
        files[f"checkpoints/{name}/manifest.json"] = json.dumps({"step": done, "version": done})
        files[f"checkpoints/{name}/model.safetensors"] = f"weights {done}"
    for rel, text in files.items():
        (run_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / rel).write_text(text)
    return files


def kept_in(err: str) -> Path:
    """The folder the log line names."""
    (line,) = [line for line in err.splitlines() if "kept in" in line]
    match = re.search(r"kept in (\S+)$", line)
    assert match, line
    return Path(match.group(1))


def tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize(
    "overrides, checkpoints",
    [
        (["run.resume=auto"], {}),  # --resume with nothing complete to continue from
        (["run.overwrite=true"], {"step_2": 2}),  # a fresh run asked for
    ],
    ids=["resume-without-checkpoint", "overwrite"],
)
def test_starting_over_keeps_the_previous_attempt(tmp_path, capsys, overrides, checkpoints):
    run_dir = tmp_path / "r"
    files = write_run(run_dir, 3, checkpoints)
    assert prepare_run_dir(config(tmp_path, *overrides)) is None
    kept = kept_in(capsys.readouterr().err)
    assert kept.parent == run_dir / "attempts"
    assert tree(kept) == files  # every file, byte for byte, where the line says
    assert [p.name for p in run_dir.iterdir()] == ["attempts"]  # the new run starts empty

    # the next start over keeps this one's files beside the first attempt's, which stay put
    second = {"metrics.jsonl": '{"step": 0}\n', "hang-20250102-000000/driver.txt": "stacks"}
    for rel, text in second.items():
        (run_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / rel).write_text(text)
    prepare_run_dir(config(tmp_path, *overrides))
    again = kept_in(capsys.readouterr().err)
    assert again != kept and again.parent == run_dir / "attempts"
    assert tree(again) == second and tree(kept) == files


def test_resuming_sets_aside_the_record_of_the_steps_trained_again(tmp_path, capsys):
    run_dir = tmp_path / "r"
    files = write_run(run_dir, 4, {"step_2": 2, "step_3": 3})
    ckpt = run_dir / "checkpoints" / "step_2"
    assert prepare_run_dir(config(tmp_path, f"run.resume={ckpt}")) == ckpt
    kept = kept_in(capsys.readouterr().err)
    assert kept.parent == run_dir / "attempts"
    # the log reads as one run up to the checkpoint ...
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").open()]
    assert steps == [0, 1]
    # ... and the previous attempt's log, lineage and later checkpoint are kept as they were
    moved = ["samples/step_2.parquet", "samples/step_3.parquet"]
    moved += ["checkpoints/step_3/manifest.json", "checkpoints/step_3/model.safetensors"]
    assert tree(kept) == {rel: files[rel] for rel in ["metrics.jsonl", "config.yaml", *moved]}
    # what the resumed run continues from or does not rewrite stays in place
    here = tree(run_dir)
    for rel in ["logs/vllm_server_0.log", "hang-20250101-000000/driver.txt",
                "samples/step_1.parquet", "checkpoints/step_2/model.safetensors"]:  # fmt: skip
        assert here[rel] == files[rel], rel
    assert not any(rel in here for rel in moved)


def test_resuming_at_the_checkpoint_moves_nothing(tmp_path, capsys):
    """Killed right after the checkpoint: no step to train again, nothing to set aside."""
    run_dir = tmp_path / "r"
    write_run(run_dir, 2, {"step_2": 2})
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    assert prepare_run_dir(config(tmp_path, "run.resume=auto")) == run_dir / "checkpoints/step_2"
    assert "kept in" not in capsys.readouterr().err
    assert not (run_dir / "attempts").exists()


def test_a_run_directory_is_refused_without_resume_or_overwrite(tmp_path):
    run_dir = tmp_path / "r"
    files = write_run(run_dir, 1, {})
    with pytest.raises(ConfigError, match="already holds a run: pass --resume"):
        prepare_run_dir(config(tmp_path))
    assert tree(run_dir) == files


def test_a_second_hang_dump_in_the_same_second_keeps_the_first(tmp_path):
    async def dump_twice() -> list[Path]:
        watchdog = Watchdog(60, tmp_path, Trace())
        return [watchdog.dump(), watchdog.dump()]

    first, second = asyncio.run(dump_twice())
    assert first != second and first.parent == second.parent == tmp_path
    assert (first / "driver.txt").is_file() and (second / "driver.txt").is_file()
