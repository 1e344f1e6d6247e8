"""Where `make demo` lands, across SFT seeds (the seeds stand in for hosts).

The deterministic warm-up of ``scripts/demo`` ends at a different point on each host's float
kernels, and a different SFT seed moves it the same way. This runs ``scripts/demo`` itself (the
same three commands, from ``configs/demo.yaml``) once per seed, each in its own run directory
(``TRIDENT_DEMO_RUNS=runs/demo_seeds/seed-N``, ``TRIDENT_DEMO_SEED=N``), and records per seed the
held-out greedy accuracy of the warm-up and after RL (``demo-rl/eval_before.json`` and
``eval_after.json``, written by ``trident train``), the minutes of SFT and of RL (with both evals),
and the load average around the run (the 2-core machine is shared, and load inflates minutes).

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python benchmarks/demo_seeds.py --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import time
from pathlib import Path
from typing import Any

from provenance import REPO, provenance

STEP = re.compile(r"== (\d)/3 .*\((\d+)s\)|== done.*\((\d+)s\)")


def packages() -> dict[str, Any]:
    """Beside ``provenance``'s host: whether the CPU has AVX-512 (the warm-up's float kernels
    differ with it) and the versions of the packages that matter."""
    import torch
    import transformers
    import vllm

    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return {
        "avx512": " avx512f" in cpuinfo,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "vllm": vllm.__version__,
    }


def run_seed(seed: int, runs: Path) -> dict[str, Any]:
    """``scripts/demo`` with the warm-up seeded by ``seed``: accuracies, minutes, load."""
    out = runs / f"seed-{seed}"
    env = os.environ | {"TRIDENT_DEMO_RUNS": str(out), "TRIDENT_DEMO_SEED": str(seed)}
    env["PATH"] = f"{REPO / '.venv' / 'bin'}{os.pathsep}{env['PATH']}"
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(
        [str(REPO / "scripts" / "demo")], cwd=REPO, env=env, capture_output=True, text=True
    )
    wall = time.perf_counter() - t0
    out.mkdir(parents=True, exist_ok=True)
    (out / "demo.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        raise SystemExit(f"seed {seed}: scripts/demo failed, see {out / 'demo.log'}")
    marks: dict[str, int] = {}  # seconds since the start at which each step began, and done
    for m in STEP.finditer(proc.stdout):
        marks[m.group(1) or "done"] = int(m.group(2) or m.group(3))
    before, after = (
        json.loads((out / "demo-rl" / f"eval_{key}.json").read_text())
        for key in ("before", "after")
    )
    pass_k = next(k for k in before if k.startswith("pass@"))
    return {
        "seed": seed,
        "warmup_accuracy": before["accuracy"],
        "after_rl_accuracy": after["accuracy"],
        f"warmup_{pass_k}": before[pass_k],
        f"after_rl_{pass_k}": after[pass_k],
        "sft_final_loss": last_sft_loss(out / "demo-sft" / "sft_metrics.jsonl"),
        "init_min": round(marks["2"] / 60, 2),
        "sft_min": round((marks["3"] - marks["2"]) / 60, 2),
        "rl_min": round((marks["done"] - marks["3"]) / 60, 2),
        "total_min": round(wall / 60, 2),
        "load_1min_before": round(load_before, 2),
        "load_1min_after": round(os.getloadavg()[0], 2),
        "run_dir": str(out.relative_to(REPO) if out.is_relative_to(REPO) else out),
    }


def last_sft_loss(path: Path) -> float:
    return round(json.loads(path.read_text().splitlines()[-1])["loss"], 4)


def markdown(result: dict[str, Any]) -> str:
    rows, h = result["seeds"], result["host"]
    lo = min(r["after_rl_accuracy"] for r in rows)
    hi = max(r["after_rl_accuracy"] for r in rows)
    lines = [
        f"# `make demo` across SFT seeds ({result['date']}, commit `{result['commit']}`)",
        "",
        f"Host: {h['cpu']} ({'AVX-512' if h['avx512'] else 'no AVX-512'}), {h['cores']} cores; "
        f"torch {h['torch']}, transformers {h['transformers']}, vllm {h['vllm']}. "
        "Written by `benchmarks/demo_seeds.py`; each seed is one run of `scripts/demo` "
        "(configs/demo.yaml) with `TRIDENT_DEMO_SEED`. Accuracy: greedy, 200 held-out prompts.",
        "",
        "| seed | warm-up greedy | warm-up pass@4 | after RL greedy | after RL pass@4 "
        "| SFT min | RL min | total min | load (1-min avg, before / after) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['seed']} | {r['warmup_accuracy']:.1%} | {r['warmup_pass@4']:.1%} "
            f"| {r['after_rl_accuracy']:.1%} | {r['after_rl_pass@4']:.1%} | {r['sft_min']:.2f} "
            f"| {r['rl_min']:.2f} | {r['total_min']:.2f} "
            f"| {r['load_1min_before']} / {r['load_1min_after']} |"
        )
    lines += ["", f"After RL: {lo:.1%}–{hi:.1%} held-out greedy accuracy over the seeds.", ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0,1,2", help="comma-separated SFT seeds")
    p.add_argument("--runs", default=str(REPO / "runs" / "demo_seeds"), help="run directories")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "demo_seeds"))
    p.add_argument("--doc", default=str(REPO / "docs" / "results" / "demo.md"), help="the page")
    args = p.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    measured = provenance(REPO / "configs" / "demo.yaml")
    result: dict[str, Any] = {
        "date": measured["date"],
        "commit": measured["commit"],
        "host": measured["host"] | packages(),
        "config": "configs/demo.yaml",
        "seeds": [],
    }
    for seed in seeds:
        result["seeds"].append(run_seed(seed, Path(args.runs)))
        print(json.dumps(result["seeds"][-1]))
    Path(args.out + ".json").write_text(json.dumps(result, indent=2) + "\n")
    Path(args.out + ".md").write_text(markdown(result))
    source = (
        "Source: [`benchmarks/results/demo_seeds.json`](../../benchmarks/results/demo_seeds.json)"
    )
    Path(args.doc).parent.mkdir(parents=True, exist_ok=True)
    Path(args.doc).write_text(
        markdown(result) + f"\n{source}, written by `benchmarks/demo_seeds.py`.\n"
    )
    print(markdown(result))


if __name__ == "__main__":
    main()
