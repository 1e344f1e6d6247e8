"""Real shapes on this machine: GRPO at Qwen2.5-0.5B's exact architecture, full and LoRA.

``trident model init --like qwen2.5-0.5b`` builds the model offline (494 M parameters, vocabulary
151,936, 24 layers, tied embeddings; random weights, trident's tokenizer; float32, in which
trident trains on CPU). Then two ``trident train`` runs on the demo's task, everything on this
machine at once (Ray, the trainer rank, the vLLM engine, the kept copy of the served weights in
``/dev/shm`` that brings a dead server back): ``--prompts`` x ``--samples`` per step, at most
``--max-tokens`` new tokens, ``--steps`` steps, ``sync`` mode, every sync verified:

- ``full``: full fine-tuning, with ``trainer.activation_checkpointing=true`` and
  ``trainer.logprob_chunk_tokens=256`` (``FULL``: with the defaults it does not fit);
- ``lora``: ``model.lora`` r=16 on every projection; each sync sends the adapters alone
  (``model.lora.sync=adapter``), which the engine (started with ``--enable-lora``) serves.

Recorded per run: seconds per step by stage (the run's own ``time/*`` metrics, mean over the
steps after the first), sync bytes and seconds, the largest |Δlogp| of the verifications, the
trainer rank's optimizer state and peak memory (its ``memory/*`` metrics), and the peak resident
memory of each process (sampled every 0.5 s from ``/proc``: the trainer rank, the engine core,
the API server, the driver) and of the machine (used = total - available, ``/dev/shm`` included).
Beside them, the peak memory of the logprob + entropy loss at this vocabulary for 1K/4K/8K tokens,
whole grid against vocabulary chunks (``benchmarks/logprob_memory.py``'s tracked figure).

    .venv/bin/python benchmarks/real_shapes.py            # ~10 min on 2 cores
    .venv/bin/python benchmarks/real_shapes.py --steps 1  # the check make test-slow runs

Writes ``benchmarks/results/real_shapes.{json,md}`` (``--out-dir``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from logprob_memory import TOKENS, tracked_gib
from provenance import REPO, provenance

sys.path.insert(0, str(REPO))

from tests.conftest import cmdline, tagged_env, tagged_processes  # noqa: E402
from trident.rollout.vllm_server import API_SERVER  # noqa: E402

GIB = 1 << 30
LORA = (
    "model.lora={r: 16, alpha: 32, target_modules: "
    "[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]}"
)
ROLES = {
    "trainer": "ray::PolicyWorker",
    "engine": "VLLM::EngineCore",
    "driver": "trident.cli train",
}
# sync mode: the trainer waits for the whole batch's rollout (generation and rewards)
# What makes full fine-tuning fit beside the engine and the kept copy (the defaults: the trainer
# rank alone reached 13.6 GB in its first step, and Ray's memory monitor stopped the run).
FULL = ("trainer.activation_checkpointing=true", "trainer.logprob_chunk_tokens=256")
STAGES = {
    "step_s": "time/step_s",
    "rollout_s": "time/wait_s",
    "train_s": "time/train_s",
    "sync_s": "time/sync_s",
}


def _meminfo() -> dict[str, int]:
    info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return {k: int(v.split()[0]) << 10 for k, v in info.items() if v.strip().endswith("kB")}


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    except OSError:
        pass
    return 0


class Peaks(threading.Thread):
    """Peak resident memory of each role's processes (``ROLES``; the API server is the vLLM
    process that is not the engine core) and of the machine, every 0.5 s."""

    def __init__(self, tag: str) -> None:
        super().__init__(daemon=True)
        self.tag, self.done = tag, threading.Event()
        self.peak: dict[str, int] = {}

    def run(self) -> None:
        while not self.done.wait(0.5):
            now: dict[str, int] = {}
            for pid in tagged_processes(self.tag):
                line = cmdline(pid)
                role = next((r for r, key in ROLES.items() if key in line), None)
                if role is None and API_SERVER in line:
                    role = "api_server"
                if role is not None:
                    now[role] = now.get(role, 0) + _rss(pid)
            info = _meminfo()
            now["machine"] = info["MemTotal"] - info["MemAvailable"]
            for role, used in now.items():
                self.peak[role] = max(self.peak.get(role, 0), used)


def build_model(out: Path) -> Path:
    model = out / "qwen2.5-0.5b"
    if not (model / "config.json").exists():
        cmd = [sys.executable, "-m", "trident.cli", "model", "init", str(model)]
        cmd += ["--like", "qwen2.5-0.5b", "--dtype", "float32"]
        subprocess.run(cmd, check=True, cwd=REPO)
    return model


def train(model: Path, out: Path, name: str, args: argparse.Namespace, *extra: str) -> dict:
    """One ``trident train`` run, its processes' peak memory sampled meanwhile."""
    tag = uuid.uuid4().hex
    cmd = [
        sys.executable, "-m", "trident.cli", "train", "--config", str(REPO / "configs/demo.yaml"),
        f"model.path={model}", f"run.dir={out}", f"run.name={name}", "run.overwrite=true",
        f"pipeline.steps={args.steps}", f"pipeline.prompts_per_step={args.prompts}",
        f"rollout.n={args.samples}", f"rollout.max_tokens={args.max_tokens}",
        "pipeline.mode=sync", "eval.before_after=false", "telemetry.progress=false",
        "checkpoint.every=0", *extra,
    ]  # fmt: skip
    peaks = Peaks(tag)
    peaks.start()
    t0 = time.monotonic()
    log = out / f"{name}.log"
    with log.open("w") as f:
        rc = subprocess.run(cmd, env=tagged_env(tag), stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
    wall = time.monotonic() - t0
    peaks.done.set()
    peaks.join()
    if rc.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-5:]
        return {"name": name, "failed": rc.returncode, "error": tail, "wall_s": wall}
    rows = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]
    # the final checkpoint (weights and optimizer state: ~10 GB for full fine-tuning) is not
    # what is measured here; a disk filled by repeated runs is
    shutil.rmtree(out / name / "checkpoints", ignore_errors=True)
    steady = rows[1:] or rows  # the first step also warms the engine and the allocator

    def mean(key: str) -> float | None:
        values = [r[key] for r in steady if key in r]
        return round(statistics.mean(values), 3) if values else None

    return {
        "name": name,
        "wall_s": round(wall, 1),
        "steps": len(rows),
        **{name: mean(key) for name, key in STAGES.items()},
        "sync_gb": round(rows[-1].get("sync/bytes", 0) / 1e9, 3),
        "sync_max_abs_dlogp": max(
            (r["sync/max_abs_dlogp"] for r in rows if "sync/max_abs_dlogp" in r), default=None
        ),
        "optimizer_state_gib": round(rows[-1].get("memory/optimizer_state_gib", 0.0), 3),
        "rank_peak_gib": round(max(r.get("memory/rank_peak_gib", 0.0) for r in rows), 2),
        "peak_gib": {role: round(v / GIB, 2) for role, v in sorted(peaks.peak.items())},
        "reward_mean": [round(r["reward_mean"], 3) for r in rows],
    }


def markdown(result: dict[str, Any]) -> str:
    a, p = result["args"], result["provenance"]
    host = p["host"]
    lines = [
        "# Real shapes: Qwen2.5-0.5B's architecture on this machine",
        "",
        f"Commit `{p['commit']}`, {p['date']}, {host['cpu']}, {host['cores']} cores, "
        f"{result['memory_gib']} GiB. `benchmarks/real_shapes.py`: {a['prompts']} prompts x "
        f"{a['samples']} samples per step, <= {a['max_tokens']} new tokens, {a['steps']} steps, "
        "sync mode, float32, everything on this machine at once. Seconds: mean over the steps "
        "after the first.",
        "",
        "| run | step s | rollout s | train s | sync s | sync GB | max abs dlogp | optimizer "
        "state GiB | trainer peak GiB | engine peak GiB | API server GiB | driver GiB | machine "
        "peak GiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["runs"]:
        if "failed" in r:
            lines.append(f"| {r['name']} | failed (exit {r['failed']}): {' '.join(r['error'])} |")
            continue
        pk = r["peak_gib"]
        lines.append(
            f"| {r['name']} | {r['step_s']} | {r['rollout_s']} | {r['train_s']} | {r['sync_s']} "
            f"| {r['sync_gb']} | {r['sync_max_abs_dlogp']:.1e} | {r['optimizer_state_gib']} "
            f"| {pk.get('trainer', 0)} | {pk.get('engine', 0)} | {pk.get('api_server', 0)} "
            f"| {pk.get('driver', 0)} | {pk.get('machine', 0)} |"
        )
    full, lora = (next((r for r in result["runs"] if r["name"] == n), {}) for n in ("full", "lora"))
    if full.get("optimizer_state_gib") and lora.get("optimizer_state_gib") is not None:
        ratio = lora["optimizer_state_gib"] / full["optimizer_state_gib"]
        lines += ["", f"LoRA's optimizer state is {ratio:.1%} of full fine-tuning's."]
    lines += [
        "",
        "Peak memory of the logprob + entropy loss at vocabulary 151,936 (forward + backward, "
        "above its inputs; `benchmarks/logprob_memory.py`'s tracked figure, float32):",
        "",
        "| tokens | whole grid GiB | chunks of 1024 GiB | ratio |",
        "|---:|---:|---:|---:|",
    ]
    for row in result["logprob_memory"]:
        g, c = row["grid_gib"], row["chunked_gib"]
        lines.append(f"| {row['tokens']} | {g:.2f} | {c:.2f} | {c / g:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--runs", nargs="+", default=["full", "lora"], choices=["full", "lora"])
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "real_shapes")
    parser.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    model = build_model(args.work)
    runs = []
    for name in args.runs:
        print(f"[real_shapes] {name}: {args.steps} steps", flush=True)
        runs.append(train(model, args.work, name, args, *([LORA] if name == "lora" else FULL)))
        print(f"[real_shapes] {json.dumps(runs[-1])}", flush=True)
    import torch

    memory = [
        {
            "tokens": t,
            "grid_gib": tracked_gib(t, 0, torch.float32),
            "chunked_gib": tracked_gib(t, 1024, torch.float32),
        }
        for t in TOKENS
    ]
    result = {
        "provenance": provenance(),
        "memory_gib": round(_meminfo()["MemTotal"] / GIB, 1),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "runs": runs,
        "logprob_memory": memory,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "real_shapes.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out_dir / "real_shapes.md").write_text(markdown(result))
    print(markdown(result))
    if any("failed" in r for r in runs):
        sys.exit(1)


if __name__ == "__main__":
    main()
