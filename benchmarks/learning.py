"""Benchmark: does each algorithm preset learn? Held-out greedy accuracy before and after RL.

Every preset trains from ONE shared warm-up, the demo's (``trident model init --preset tiny``,
then ``trident sft -c configs/demo.yaml``: the arithmetic is learned, the answers come in three
styles and the verifier accepts only ``Answer: N``), cached under ``runs/learning-warmup``
together with the copy of ``configs/demo.yaml`` it was built with. Each preset then runs
``trident train -c <that copy>`` for ``--steps`` steps (the demo's RL recipe; the preset's own
settings as the learning tests set them), and the script reads the held-out greedy accuracy the
run writes (``eval_before.json``, ``eval_after.json``) and its training accuracy
(``metrics.jsonl``).

On-policy distillation (``opd``) needs a teacher: as in the tests (``teacher_model``), the
warm-up trained 150 SFT steps further in the verifier's style only.

Writes ``benchmarks/results/learning.{json,md}``; rows of presets not rerun are kept.

Run: ``.venv/bin/python benchmarks/learning.py [--steps 12] [--algos grpo,ppo,opd]``
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from provenance import REPO, load_average, provenance

from trident.telemetry.metrics import read_metrics

RESULTS = REPO / "benchmarks" / "results"
WARMUP = REPO / "runs" / "learning-warmup"
RUNS = REPO / "runs" / "learning"
TRIDENT = [sys.executable, "-m", "trident.cli"]

# Each preset's overrides, as tests/test_algo_learning.py sets them ({teacher}: the teacher).
ALGOS: dict[str, list[str]] = {
    "grpo": [],
    "ppo": ["algo.name=ppo", "trainer.critic_lr=1e-3"],
    "opd": ["algo.name=opd", "model.teacher_paths.default={teacher}", "trainer.lr=5e-4"],
    "dapo": ["algo.name=dapo"],
    "gspo": ["algo.name=gspo"],
    "rloo": ["algo.name=rloo"],
    "reinforce_pp": ["algo.name=reinforce_pp"],
    "reinforce_pp_baseline": ["algo.name=reinforce_pp_baseline"],
    "dr_grpo": ["algo.name=dr_grpo"],
    "cispo": ["algo.name=cispo"],
}
# Every command: one trainer thread (as the tests run: on a loaded 2-core host two threads
# contend, and the checkpoint is the same byte for byte), no progress bar.
QUIET = ["trainer.cpu_threads=1", "telemetry.progress=false"]
# Every run: greedy held-out accuracy only (no pass@k samples), only the final checkpoint.
COMMON = [*QUIET, "eval.samples=1", "eval.pass_k=1", "checkpoint.every=0"]


def trident(*args: str, log: Path) -> None:
    """Run one ``trident`` command, its output to ``log``; raise with the log's tail on failure."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        done = subprocess.run([*TRIDENT, *args], cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"trident {' '.join(args[:2])} failed ({log}):\n{tail}")


def warm_up() -> tuple[Path, str]:
    """The demo's warm-up and the config copy it was built with, built once; (config, model)."""
    config, model = WARMUP / "demo.yaml", WARMUP / "sft" / "model"
    if (model / "config.json").exists() and config.exists():
        return config, str(model)
    shutil.rmtree(WARMUP, ignore_errors=True)
    WARMUP.mkdir(parents=True)
    shutil.copy(REPO / "configs" / "demo.yaml", config)
    trident("model", "init", "--preset", "tiny", str(WARMUP / "base"), log=WARMUP / "init.log")
    trident(
        "sft", "-c", str(config), f"model.path={WARMUP / 'base'}", f"run.dir={WARMUP}",
        "run.name=sft", f"sft.output={model}", *QUIET, log=WARMUP / "sft.log",
    )  # fmt: skip
    return config, str(model)


def teacher(model: str) -> str:
    """The distillation teacher: the warm-up plus 150 SFT steps in the required style only."""
    out = WARMUP / "teacher" / "model"
    if not (out / "config.json").exists():
        trident(
            "sft", f"model.path={model}", f"run.dir={WARMUP}", "run.name=teacher",
            f"sft.output={out}", "sft.steps=150", "sft.lr=1e-3", "sft.warmup_steps=5",
            *QUIET, log=WARMUP / "teacher.log",
        )  # fmt: skip
    return str(out)


def train(algo: str, steps: int, config: Path, model: str) -> dict[str, Any]:
    """One ``trident train`` run of ``algo``; its row of the table."""
    overrides = [o.format(teacher=teacher(model)) if "{teacher}" in o else o for o in ALGOS[algo]]
    load = load_average()
    t0 = time.perf_counter()
    trident(
        "train", "-c", str(config), f"model.path={model}", f"run.dir={RUNS}", f"run.name={algo}",
        "run.overwrite=true", f"pipeline.steps={steps}", *COMMON, *overrides,
        log=RUNS / f"{algo}.log",
    )  # fmt: skip
    minutes = (time.perf_counter() - t0) / 60
    run = RUNS / algo
    before = json.loads((run / "eval_before.json").read_text())
    after = json.loads((run / "eval_after.json").read_text())
    metrics = read_metrics(run)
    trained = [m["accuracy"] for m in metrics]
    return {
        "algo": algo,
        "overrides": overrides,
        "steps": len(metrics),
        "warmup_accuracy": before["accuracy"],
        "after_accuracy": after["accuracy"],
        "held_out_prompts": after["num_prompts"],
        "train_accuracy_first3": sum(trained[:3]) / len(trained[:3]),
        "train_accuracy_last3": sum(trained[-3:]) / len(trained[-3:]),
        "minutes": round(minutes, 2),
        "load_average": [load, load_average()],
    }


def markdown(report: dict[str, Any]) -> str:
    p, rows = report["provenance"], report["rows"]
    dates = sorted(r["date"] for r in rows)
    commits = ", ".join(f"`{c}`" for c in sorted({r["commit"] for r in rows}))
    lines = [
        "### Learning: held-out greedy accuracy before and after RL, per algorithm preset",
        "",
        f"Measured {dates[0]} to {dates[-1]} at commit {commits} on {p['host']['cpu']} "
        f"({p['host']['cores']} cores, shared with other jobs: the load column is the 1-minute "
        "load average as each run started). One warm-up for all: the demo's "
        f"(`configs/demo.yaml`, sha1 `{report['demo_yaml_sha1'][:12]}`, 1000 SFT steps); each "
        "preset then trains with the demo's RL recipe and the preset's settings "
        "(`benchmarks/learning.py`). Accuracy: greedy, on "
        f"{rows[0]['held_out_prompts']} held-out prompts; training accuracy: mean of the "
        "first / last 3 steps.",
        "",
        "| algo | steps | warm-up accuracy | after RL | training accuracy | minutes | load |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['algo']} | {r['steps']} | {r['warmup_accuracy']:.1%} | "
            f"{r['after_accuracy']:.1%} | {r['train_accuracy_first3']:.3f} → "
            f"{r['train_accuracy_last3']:.3f} | {r['minutes']:.1f} | {r['load_average'][0][0]} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--algos", default=",".join(ALGOS), help="comma-separated presets")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    algos = args.algos.split(",")
    if unknown := sorted(set(algos) - set(ALGOS)):
        parser.error(f"unknown presets {unknown}; known: {', '.join(ALGOS)}")

    config, model = warm_up()
    path = args.out / "learning.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    rows = {r["algo"]: r for r in old.get("rows", [])}
    report = {"provenance": provenance(config), "warmup": model}
    report["demo_yaml_sha1"] = next(iter(report["provenance"]["sha1"].values()))
    for algo in algos:
        rows[algo] = train(algo, args.steps, config, model)
        rows[algo] |= {k: report["provenance"][k] for k in ("commit", "diff_sha1", "date")}
        print(json.dumps(rows[algo]), flush=True)
        report["rows"] = [rows[a] for a in ALGOS if a in rows]
        report["provenance"]["load_average_end"] = load_average()
        args.out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
        (args.out / "learning.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
