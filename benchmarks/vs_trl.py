"""trident against TRL's ``GRPOTrainer`` on the same recipe, side by side in one run.

    make bench-trl        # = pip install -e '.[bench]' (TRL) + python benchmarks/vs_trl.py
    python benchmarks/vs_trl.py [--recipe demo|long|compute|all] [--model SFT_DIR] [--target 0.9]

Both sides start from the same checkpoint and train on the same recipe, ``configs/demo.yaml``:
32 prompts × 8 samples per RL step at temperature 1, reward = the task's verifier + 0.5 × the
format reward, lr 3e-4 (the long recipe: 1e-6) on trident's schedule (``trainer.warmup_steps``
and ``lr_schedule`` per RL step; TRL's optimizer is set to the same rate at each step), 2
optimizer steps per batch, no KL, the same token-mean PPO-clip loss (TRL's ``loss_type="dapo"``), group-normalised
advantages. Three recipes:

- ``demo``: 30 steps of the demo, at most 12 new tokens, from the demo's SFT warm-up (built here
  unless ``--model`` names one); held-out accuracy is measured.
- ``long``: generation dominates. The demo's warm-up is fine-tuned further to write a scratch
  line of random digits before its answer, of log-normal length (median 40 tokens, capped at
  240), so responses have RL's long tail; up to 256 new tokens, 12 steps, timing only. Its
  answers after the scratch line are almost never right, so there is nothing to learn: at the
  demo's rate each side's lengths drifted at random (TRL's from 58 to 10 tokens in one run,
  from 41 to 38 in the next), and the drift, not the long tail, decided the ratio. It trains
  at lr 1e-6, on both sides, so the warm-up's lengths hold through the 12 steps (the compute
  is the same at any rate).
- ``compute``: the RL compute is real. The ``small`` preset (~25 M parameters) as initialised,
  whose responses all run to their 32-token cap, 16 prompts × 8 samples a step, 12 steps,
  timing only. In bfloat16 on both sides where the host multiplies it in hardware (a GPU, or a
  CPU with AMX), as users of such a host train: float32 weights and optimizer, bfloat16
  compute (trident ``model.dtype=bfloat16``, TRL ``bf16=True``); float32 elsewhere.

  Both timing recipes add a third reward, ``digit_share`` (the share of a response's characters
  that are digits), to the demo's: with the task's and the format's alone every group's rewards
  are equal, every advantage is 0, and trident skips those samples' passes where TRL computes
  zero gradients, so the recipes would time no training at all.

TRL gets the prompts already rendered by trident's chat template (so the tokens are the same)
and trident's own reward functions; on a CPU box it generates with HF ``generate`` (TRL's vLLM
path needs CUDA) and uses every core for one process, as its users run it there. On a GPU box
(``torch.cuda.is_available()``) both sides take one GPU in bf16: trident colocated (trainer and
engine share the device, with ``TRIDENT_GPU``'s settings), TRL with its vLLM colocate mode,
each engine at 40% of the GPU's memory.

Each side runs as its own process, timed from its launch:

- **command → first step**: from the ``Popen`` of its process until the first RL step begins
  (interpreter, imports, Ray, the vLLM server and the trainer for trident; interpreter,
  imports, model and dataset for TRL);
- **s/step**: the wall time between the ends of consecutive RL steps (everything in the loop:
  generation, reward, training, weight sync, logging, and the checkpoints saved for the
  held-out evaluation on both sides), the mean after the first ``WARMUP`` steps (the median of
  all beside it);
- trident's per-stage breakdown (its ``time/*`` metrics, mean per step after the first
  ``WARMUP``): rollout (the step's wait for samples), train, weight sync (push + verify), and
  the rest of the loop; inside train, the logprob recompute, the optimizer steps and the rest
  (the batch's transfer to the rank, collation, metrics); inside weight sync, write + update,
  the probe verification and the rest (draining requests, health check, prefix-cache reset);
- the train stage's naive, TRL-equivalent floor: every sample's padded row of trident's run
  trained in plain PyTorch (``train_floor``), in this process (the system allocator) and, on a
  CPU, again under jemalloc as trident's ranks run (``train_floor_jemalloc``), each interleaved
  step by step with trident's rank code (``PolicyWorker.train_step``) on the same lengths. It
  does not measure trident's overhead: it does work trident skips (rows whose advantages are 0,
  every copy of a shared prompt, π_old recomputed where trident takes the engine's), so trident's
  rank code over it counts the work removed as well as any overhead;
- TRL's split (mean per step after the first ``WARMUP``): generation + scoring
  (``_generate_and_score_completions``) vs the rest;
- **held-out accuracy**: greedy answers on the 200 test prompts scored by trident's verifier,
  the same HF-``generate`` evaluation of both sides' saved weights, every 5 steps; and the
  training time (sum of step times) until it first reaches ``--target``.

Writes ``benchmarks/results/vs_trl.{json,md}``; ratios are what to read (a busy machine slows
both sides).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from trident.cluster.net import free_port
from trident.cluster.process import jemalloc_env
from trident.config import load_config
from trident.data.loaders import load_split
from trident.data.tasks import get_task
from trident.models.load import encode_chat, load_causal_lm, load_tokenizer, prompt_messages
from trident.rewards import format_reward
from trident.sample import Sample
from trident.telemetry.lineage import read_samples
from trident.train.batch import micro_batches
from trident.train.fsdp import adamw, cosine_lr
from trident.train.policy import PolicyWorker

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
RECIPE = REPO / "configs" / "demo.yaml"
EVAL_EVERY = 5
WARMUP = 3  # steps left out of the stage means and the floor (allocator warm-up, first compiles)
GPU = torch.cuda.is_available()
# trident on one GPU: the settings of scripts/gpu_check (bf16 leaves the probe a wider tolerance).
TRIDENT_GPU = [
    "model.dtype=bfloat16", "cluster.placement=colocated", "sync.backend=auto",
    "rollout.gpu_memory_utilization=0.4", "sync.tolerance=0.1",
]  # fmt: skip


# -- shared: the recipe, the prompts, the evaluation ---------------------------------------------

# The timing-only recipes run as TRL does, without deterministic kernels or seeded sampling
# (trident's default; the demo config turns them on so that its accuracy reproduces, and the demo
# recipe keeps them: its held-out accuracy is compared).
NOT_DETERMINISTIC = ["run.deterministic=false"]
# The timing recipes' answers are never right (long) or not words (compute): with the demo's
# rewards every group's are equal, every advantage 0, and trident skips those samples' passes
# (trainer.skip_zero_advantage) where TRL computes zero gradients. A reward that tells every
# group's samples apart (digit_share) makes both sides train on real gradients.
DIGITS = "benchmarks.vs_trl:digit_share"
SIGNAL = [
    f"reward.fns=[{{name: task, weight: 1.0}}, {{name: format, weight: 0.5}}, {{name: '{DIGITS}', weight: 1.0}}]"
]
RECIPES: dict[str, dict[str, Any]] = {
    "demo": {"steps": 30, "overrides": [], "evaluate": True},
    "long": {
        "steps": 12,
        "overrides": ["rollout.max_tokens=256", "trainer.lr=1e-6", *NOT_DETERMINISTIC, *SIGNAL],
        "evaluate": False,
    },
    "compute": {
        "steps": 12,
        "overrides": [
            "rollout.max_tokens=32",
            "pipeline.prompts_per_step=16",
            *NOT_DETERMINISTIC,
            *SIGNAL,
        ],
        "evaluate": False,
        "bf16_where_native": True,
    },
}


def digit_share(response: str, **_: Any) -> float:
    """The share of the response's characters that are digits (the timing recipes' third
    reward): it differs between any two samples of a scratch line or of random text."""
    return sum(c.isdigit() for c in response) / max(len(response), 1)


def native_bf16() -> bool:
    """Whether this host multiplies bfloat16 in hardware: a GPU, or a CPU with AMX (on a 2-core
    Xeon with AMX, a [4096, 512] x [512, 1536] matmul ran at 912 GFLOP/s in bfloat16, 219 in
    float32)."""
    if GPU:
        return True
    try:
        return "amx_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def recipe(name: str) -> dict[str, Any]:
    """A recipe's numbers, read from the demo config and the recipe's overrides (both sides use
    exactly these)."""
    spec = RECIPES[name]
    bf16 = GPU or (spec.get("bf16_where_native", False) and native_bf16())
    overrides = [*spec["overrides"], *(["model.dtype=bfloat16"] if bf16 else [])]
    cfg = load_config([RECIPE], [f"pipeline.steps={spec['steps']}", *overrides])
    return {
        "name": name,
        **spec,
        "overrides": overrides,
        "dtype": cfg.model.dtype,
        "prompts_per_step": cfg.pipeline.prompts_per_step,
        "n": cfg.rollout.n,
        "max_tokens": cfg.rollout.max_tokens,
        "temperature": cfg.rollout.temperature,
        "lr": cfg.trainer.lr,
        "warmup_steps": cfg.trainer.warmup_steps,
        "lr_schedule": cfg.trainer.lr_schedule,
        "mini_batches": cfg.trainer.mini_batches,
        "micro_batch_tokens": cfg.trainer.micro_batch_tokens,
        "clip_eps": cfg.algo.clip_eps_low,
        "reward_weights": {f.name: f.weight for f in cfg.reward.fns},
    }


def rendered_rows(model: str, split: str) -> list[dict[str, Any]]:
    """The recipe's rows with the prompt as the exact text trident's rollout sends (the chat
    template applied, the generation prompt added)."""
    cfg = load_config([RECIPE], [f"model.path={model}"])
    tok = load_tokenizer(model)
    rows = load_split(cfg.data, split, cfg.run.seed)
    return [
        {**r, "prompt": tok.decode(encode_chat(tok, prompt_messages(r["prompt"])))} for r in rows
    ]


def verifier_score(response: str, row: dict[str, Any]) -> float:
    return get_task(row["task"]).verify(response, row)


def heldout_accuracy(model_dir: str | Path, rows: list[dict[str, Any]], max_tokens: int) -> float:
    """Greedy answers to ``rows`` (already rendered), scored by trident's verifier."""
    model, tok = load_causal_lm(str(model_dir)).eval(), load_tokenizer(str(model_dir))
    correct = 0
    with torch.no_grad():
        for i in range(0, len(rows), 50):
            chunk = [tok.encode(r["prompt"], add_special_tokens=False) for r in rows[i : i + 50]]
            width = max(map(len, chunk))
            ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in chunk])
            attn = (ids != tok.pad_token_id).long()
            for k, p in enumerate(chunk):  # a pad id inside a prompt is still a prompt token
                attn[k, width - len(p) :] = 1
            out = model.generate(
                input_ids=ids, attention_mask=attn, do_sample=False, max_new_tokens=max_tokens,
                pad_token_id=tok.pad_token_id,
            )  # fmt: skip
            texts = tok.batch_decode(out[:, width:], skip_special_tokens=True)
            correct += sum(
                verifier_score(t, r) >= 1.0 for t, r in zip(texts, rows[i : i + 50], strict=True)
            )
    return correct / len(rows)


def time_to_target(accuracy: dict[int, float], step_ends: list[float], target: float):
    """Training seconds (from the first step's start) until the first evaluated step at or
    above ``target``; None if none reached it."""
    for step in sorted(accuracy):
        if accuracy[step] >= target:
            return step_ends[step - 1]
    return None


# -- trident -------------------------------------------------------------------------------------


def trident_overrides(model: str, r: dict[str, Any]) -> list[str]:
    """The recipe as trident's config overrides (its run and its rank code beside the floor)."""
    return [f"model.path={model}", f"pipeline.steps={r['steps']}", *r["overrides"],
            *(TRIDENT_GPU if GPU else [])]  # fmt: skip


def run_trident(model: str, work: Path, r: dict[str, Any]) -> dict[str, Any]:
    """``trident train`` on the recipe; step times from when each metrics row appears."""
    name, steps = f"trident-{r['name']}", r["steps"]
    run_dir = work / name
    cmd = [
        sys.executable, "-m", "trident.cli", "train", "-c", str(RECIPE), *trident_overrides(model, r),
        f"run.dir={work}", f"run.name={name}", "run.overwrite=true",
        "eval.before_after=false", "telemetry.progress=false",
    ]  # fmt: skip
    if r["evaluate"]:
        cmd += [f"checkpoint.every={EVAL_EVERY}", f"checkpoint.keep_last={steps // EVAL_EVERY + 1}"]
    shutil.rmtree(run_dir, ignore_errors=True)  # a previous run's metrics would look like steps
    metrics, seen, arrivals = run_dir / "metrics.jsonl", 0, []
    launch = time.monotonic()
    with (work / f"{name}.log").open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        while proc.poll() is None or (metrics.exists() and _lines(metrics) > seen):
            n = _lines(metrics) if metrics.exists() else 0
            arrivals += [time.monotonic() - launch] * (n - seen)
            seen = n
            time.sleep(0.05)
    total = time.monotonic() - launch
    if proc.returncode != 0:
        raise SystemExit(f"trident train failed; see {work / f'{name}.log'}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    first_start = arrivals[0] - rows[0]["time/step_s"]
    ends = [a - first_start for a in arrivals]
    periods = _periods(ends)
    steady = rows[WARMUP:]

    def mean(key: str) -> float:
        return statistics.mean(m[key] for m in steady)

    stage = {"rollout": mean("time/wait_s"), "train": mean("time/train_s")}
    stage["weight sync"] = mean("time/sync_s")
    stage["rest of the loop"] = statistics.mean(periods[WARMUP:]) - sum(stage.values())

    parts = {  # inside the train and weight-sync stages (rank 0's timers)
        "train: logprob recompute": mean("time/recompute_s"),
        "train: optimizer steps": mean("time/optimize_s"),
        "train: batch transfer, collation, metrics": mean("time/train_s") - mean("time/rank_s"),
        "sync: write + update": mean("sync/total_s"),
        "sync: probe verification": mean("sync/verify_s"),
        "sync: drain, health check, cache reset": mean("time/sync_s")
        - mean("sync/total_s")
        - mean("sync/verify_s"),
    }
    ckpts = {
        s: run_dir / "checkpoints" / (f"step_{s}" if s < steps else "final")
        for s in (_eval_steps(steps) if r["evaluate"] else [])
    }
    return {
        "first_step_s": first_start,
        **_step_times(periods),
        "step_ends": ends,
        "total_s": total,
        "response_tokens_mean": statistics.median(m["response_len_mean"] for m in rows),
        "response_tokens_per_step": [m["response_len_mean"] for m in rows],
        "stages": stage,
        "parts": parts,
        "checkpoints": {s: str(p) for s, p in ckpts.items()},
    }


def train_floor(model: str, run_dir: Path, r: dict[str, Any]) -> dict[str, float]:
    """What the train stage costs in plain PyTorch, on this host, for every sample's padded row of
    trident's run, as TRL trains them (rebuilt from its sample log: each row's prompt tokens + response tokens, the
    recipe's mini-batches ``samples[k::M]``, each split into micro-batches as trident's trainer
    splits it, ``micro_batches`` by ``trainer.micro_batch_tokens``): the no-grad forward of the
    mini-batches after the first (their pre-step logprobs), then per mini-batch the forward and
    backward of each micro-batch and one (fused) AdamW step, with the loss -Σ A·logp / tokens; in a
    bfloat16 recipe, float32 weights under ``torch.autocast``. One process, no FSDP, no ratio,
    clipping or metrics: a naive floor for TRL-equivalent work, not for trident's, which skips
    rows whose advantages are 0, runs each shared prompt once and takes π_old from the engine.
    Median over the run's steps after the first ``WARMUP``.

    Interleaved with it, step by step in this process: trident's own rank code on the same
    lengths and rewards (``PolicyWorker.train_step``, one rank, FSDP2, the recipe's settings;
    random token ids), whose median over the floor's compares the two free of the host's drift
    between runs (±10-30% over minutes on the 2-core hosts measured); since the floor does more
    work, that ratio is not trident's overhead."""
    device = torch.device("cuda" if GPU else "cpu")
    net = load_causal_lm(model, "float32", device)
    half = r["dtype"] == "bfloat16"
    tok = load_tokenizer(model)
    opt = adamw(net.parameters(), 1e-6)  # fused, as TRL's; a tiny lr: the weights barely move
    vocab = net.config.vocab_size
    cfg = load_config([RECIPE], trident_overrides(model, r))
    worker = PolicyWorker(cfg, 0, 1, "127.0.0.1", free_port())
    trident_kernels = torch.are_deterministic_algorithms_enabled()  # run.deterministic's
    prompt_ids: dict[str, list[int]] = {}
    recompute, optimize, trident_recompute, trident_optimize = [], [], [], []
    for step in range(WARMUP, r["steps"]):
        lengths, samples = [], []
        for i, row in enumerate(read_samples(run_dir, step)):
            if row["prompt"] not in prompt_ids:
                prompt_ids[row["prompt"]] = encode_chat(tok, prompt_messages(row["prompt"]))
            prompt, n = prompt_ids[row["prompt"]], row["response_tokens"]
            lengths.append(len(prompt) + n)
            samples.append(
                Sample(
                    id=f"{step}-{i}", group_id=row["group_id"], reward=row["reward"],
                    token_ids=prompt + torch.randint(0, vocab, (n,)).tolist(),
                    loss_mask=[0] * len(prompt) + [1] * n,
                    logprobs=[0.0] * len(prompt) + [-1.0] * n,
                    versions=[-1] * len(prompt) + [step] * n,
                    metadata={"row": {"prompt": row["prompt"], "task": cfg.data.task}},
                )
            )  # fmt: skip
        grids: list[list[tuple[torch.Tensor, ...]]] = []  # [mini-batch][micro-batch]
        for k in range(r["mini_batches"]):
            part = lengths[k :: r["mini_batches"]]
            grids.append([])
            for idx in micro_batches(part, r["micro_batch_tokens"]):
                widths = torch.tensor([part[i] for i in idx])
                ids = torch.randint(0, vocab, (len(idx), int(widths.max())))
                attn = (torch.arange(ids.shape[1])[None, :] < widths[:, None]).long()
                adv = torch.randn(len(idx), ids.shape[1] - 1)
                grids[-1].append((ids.to(device), attn.to(device), adv.to(device)))

        def logp(ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
            with torch.autocast(device.type, torch.bfloat16, enabled=half):
                logits = net(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
            return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)

        torch.use_deterministic_algorithms(False)
        _synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            for ids, attn, _ in itertools.chain(*grids[1:]):
                logp(ids, attn)
        _synchronize()
        t1 = time.perf_counter()
        for mini in grids:
            tokens = sum(float(attn[:, 1:].sum()) for _, attn, _ in mini)
            for ids, attn, adv in mini:
                (-(logp(ids, attn) * adv * attn[:, 1:]).sum() / tokens).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        _synchronize()
        recompute.append(t1 - t0)
        optimize.append(time.perf_counter() - t1)
        torch.use_deterministic_algorithms(trident_kernels)
        worker.served_version = step  # as after the sync that served these samples
        m = worker.train_step(samples)
        trident_recompute.append(m["time/recompute_s"])
        trident_optimize.append(m["time/optimize_s"])
    worker.shutdown()
    torch.use_deterministic_algorithms(False)
    return {
        "train floor: recompute": statistics.median(recompute),
        "train floor: forward + backward + AdamW": statistics.median(optimize),
        "trident interleaved: recompute": statistics.median(trident_recompute),
        "trident interleaved: optimizer steps": statistics.median(trident_optimize),
    }


def train_floor_jemalloc(model: str, work: Path, r: dict[str, Any]) -> dict[str, float] | None:
    """``train_floor`` in a process of its own under the allocator trident's ranks run with on a
    CPU (``jemalloc_env``), None where there is none: the floor a trident rank would pay, beside
    the plain process's above (the system allocator, as a TRL run has it)."""
    env = jemalloc_env(model) if not GPU else {}
    if not env:
        return None
    spec, out = work / f"floor-{r['name']}.recipe.json", work / f"floor-{r['name']}.json"
    spec.write_text(json.dumps(r))
    cmd = [sys.executable, __file__, "--floor-worker", model, str(work), str(spec), str(out)]
    subprocess.run(cmd, check=True, cwd=REPO, env={**os.environ, **env})
    return json.loads(out.read_text())


def _synchronize() -> None:
    if GPU:
        torch.cuda.synchronize()


def _lines(path: Path) -> int:
    return path.read_bytes().count(b"\n")


# -- TRL -----------------------------------------------------------------------------------------


def run_trl(model: str, work: Path, r: dict[str, Any]) -> dict[str, Any]:
    """TRL in its own process (``--trl-worker``), timed from its launch like trident."""
    name = f"trl-{r['name']}"
    spec, out = work / f"{name}.recipe.json", work / f"{name}.json"
    spec.write_text(json.dumps(r))
    launch = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the host
    cmd = [sys.executable, __file__, "--trl-worker", model, str(work), str(spec), str(out)]
    cmd.append(repr(launch))
    with (work / f"{name}.log").open("w") as log:
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO).returncode
    if code != 0:
        raise SystemExit(f"the TRL run failed; see {work / f'{name}.log'}")
    return json.loads(out.read_text()) | {"total_s": time.monotonic() - launch}


def trl_worker(model: str, work: Path, spec: Path, out: Path, launch: float) -> None:
    """TRL's ``GRPOTrainer`` on the recipe; ``launch``: when ``run_trl`` started this process."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    r = json.loads(spec.read_text())
    steps, saves = r["steps"], work / f"trl-{r['name']}"
    rows = rendered_rows(model, "train")
    dataset = Dataset.from_list(rows)
    weights = r["reward_weights"]

    columns = [c for c in dataset.column_names if c != "prompt"]

    def task(completions: list[str], **kw: Any) -> list[float]:
        """trident's verifier, given the row's columns (TRL passes them as lists)."""
        return [
            verifier_score(c, {k: kw[k][i] for k in columns}) for i, c in enumerate(completions)
        ]

    def fmt(completions: list[str], **_: Any) -> list[float]:
        return [format_reward(c) for c in completions]

    def digits(completions: list[str], **_: Any) -> list[float]:
        return [digit_share(c) for c in completions]

    funcs = {"task": task, "format": fmt, DIGITS: digits}

    per_rl_step = r["prompts_per_step"] * r["n"]
    if GPU:  # TRL's vLLM colocate mode runs its engine in this process's torch.distributed group
        for key, value in {
            "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29531",
        }.items():  # fmt: skip
            os.environ.setdefault(key, value)
    # On CPU: the recipe's dtype (float32, or bf16 autocast where the CPU has AMX), without
    # activation checkpointing, as trident trains; bf16 on a CPU without bf16 instructions is
    # emulated (measured on an AVX2-only host: 9.5 s / RL step vs 0.5 s). On a GPU: bf16 and
    # TRL's vLLM, as trident's side.
    device: dict[str, Any] = (
        {
            "use_vllm": True,
            "vllm_mode": "colocate",
            "vllm_gpu_memory_utilization": 0.4,
            "bf16": True,
        }
        if GPU
        else {"use_cpu": True, "use_vllm": False, "bf16": r["dtype"] == "bfloat16"}
    )
    config = GRPOConfig(
        output_dir=str(saves), report_to="none", save_strategy="no",
        logging_steps=1, max_steps=steps * r["mini_batches"], seed=0, disable_tqdm=True,
        per_device_train_batch_size=per_rl_step // r["mini_batches"],
        steps_per_generation=r["mini_batches"], num_generations=r["n"], num_iterations=1,
        max_completion_length=r["max_tokens"], temperature=r["temperature"], top_p=1.0,
        learning_rate=r["lr"], lr_scheduler_type="constant", weight_decay=0.0, adam_beta1=0.9,
        adam_beta2=0.999, max_grad_norm=1.0, beta=0.0, epsilon=r["clip_eps"],
        loss_type="dapo", scale_rewards="group", reward_weights=list(weights.values()),
        dataloader_num_workers=0, gradient_checkpointing=False, **device,
    )  # fmt: skip
    timing: dict[str, Any] = {"step_ends": [], "generate_s": [], "lengths": [], "lrs": []}

    class Timed(GRPOTrainer):
        def _generate_and_score_completions(self, *args: Any, **kwargs: Any):
            t = time.monotonic()
            result = super()._generate_and_score_completions(*args, **kwargs)
            timing["generate_s"].append(time.monotonic() - t)
            return result

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):  # noqa: ANN001
            timing["first_step_s"] = time.monotonic() - launch
            timing["t0"] = time.monotonic()

        def on_step_begin(self, args, state, control, **kw):  # noqa: ANN001
            # trident's schedule, per RL step: both mini-batches of a step at one rate
            rl_step = state.global_step // r["mini_batches"]
            scale = cosine_lr(rl_step, steps, r["warmup_steps"], r["lr_schedule"])
            for group in trainer.optimizer.param_groups:
                group["lr"] = r["lr"] * scale

        def on_optimizer_step(self, args, state, control, **kw):  # noqa: ANN001
            # the rate the step took (TRL logs its scheduler's, which this callback overrides)
            timing["lrs"].append(trainer.optimizer.param_groups[0]["lr"])

        def on_step_end(self, args, state, control, **kw):  # noqa: ANN001
            if state.global_step % r["mini_batches"]:
                return
            rl_step = state.global_step // r["mini_batches"]
            if r["evaluate"] and (rl_step % EVAL_EVERY == 0 or rl_step == steps):
                trainer.save_model(str(saves / f"step_{rl_step}"))  # in the step, as trident's
            timing["step_ends"].append(time.monotonic() - timing["t0"])

        def on_log(self, args, state, control, logs=None, **kw):  # noqa: ANN001
            if logs and "completions/mean_length" in logs:
                timing["lengths"].append(float(logs["completions/mean_length"]))

    trainer = Timed(
        model=model, reward_funcs=[funcs[name] for name in weights], args=config, train_dataset=dataset,
        processing_class=load_tokenizer(model), callbacks=[Clock()],
    )  # fmt: skip
    trainer.train()
    ends = timing["step_ends"]
    periods = _periods(ends)
    generate = timing["generate_s"][WARMUP:]  # one per RL step
    result = {
        "first_step_s": timing["first_step_s"],
        **_step_times(periods),
        "step_ends": ends,
        "stages": {
            "generation + scoring": statistics.mean(generate),
            "rest of the step": statistics.mean(periods[WARMUP:]) - statistics.mean(generate),
        },
        "response_tokens_mean": statistics.median(timing["lengths"]),
        "response_tokens_per_step": timing["lengths"],
        "lr_per_optimizer_step": timing["lrs"],
        "checkpoints": {
            s: str(saves / f"step_{s}") for s in (_eval_steps(steps) if r["evaluate"] else [])
        },
        "threads": torch.get_num_threads(),
    }
    out.write_text(json.dumps(result))


def _periods(ends: list[float]) -> list[float]:
    """Each step's wall time, from the step ends (seconds after the first step's start)."""
    return [ends[0], *(b - a for a, b in itertools.pairwise(ends))]


def _step_times(periods: list[float]) -> dict[str, float]:
    """The headline (mean per RL step after the first ``WARMUP``) and the median of all."""
    return {
        "step_s": statistics.mean(periods[WARMUP:]),
        "step_median_s": statistics.median(periods),
    }


def _eval_steps(steps: int) -> list[int]:
    return [*range(EVAL_EVERY, steps, EVAL_EVERY), steps]


# -- the run -------------------------------------------------------------------------------------


def warmed_up_model(work: Path) -> str:
    """The demo's SFT warm-up (``scripts/demo``'s first two steps), built once per work dir."""
    sft = work / "demo-sft" / "model"
    if not (sft / "model.safetensors").exists():
        trident = [sys.executable, "-m", "trident.cli"]
        base = work / "demo-base"
        subprocess.run([*trident, "model", "init", "--preset", "tiny", str(base)], check=True)
        subprocess.run(
            [*trident, "sft", "-c", str(RECIPE), f"model.path={base}", f"run.dir={work}",
             "run.name=demo-sft", f"sft.output={sft}", "run.overwrite=true"],
            check=True, cwd=REPO,
        )  # fmt: skip
    return str(sft)


def small_model(work: Path) -> str:
    """The ``small`` preset (~25 M parameters) with its initial weights: its responses run to
    the recipe's cap (the reward is 0 throughout; the recipe is for timing)."""
    path = work / "small-init"
    if not (path / "model.safetensors").exists():
        init = [sys.executable, "-m", "trident.cli", "model", "init", "--preset", "small"]
        subprocess.run([*init, str(path)], check=True, cwd=REPO)
    return str(path)


def long_warmed_up_model(work: Path, demo_sft: str) -> str:
    """The demo's warm-up fine-tuned to write a scratch line of random digits (log-normal
    length: median 40 tokens, capped at 240) before ``Answer: N``, so sampled responses have a
    long tail of lengths; built once per work dir."""
    sft = work / "long-sft" / "model"
    if not (sft / "model.safetensors").exists():
        rng = random.Random(0)
        cfg = load_config([RECIPE], [])
        data = work / "long-sft.jsonl"
        with data.open("w") as f:
            for row in load_split(cfg.data, "train", cfg.run.seed):
                digits = min(120, int(rng.lognormvariate(math.log(20), 0.9)))
                scratch = " ".join(rng.choice("0123456789") for _ in range(digits))
                response = f"{scratch}\nAnswer: {row['answer']}"
                line = {"prompt": row["prompt"], "answer": row["answer"], "response": response}
                f.write(json.dumps(line) + "\n")
        subprocess.run(
            [sys.executable, "-m", "trident.cli", "sft", "-c", str(RECIPE),
             f"model.path={demo_sft}", f"data.train_path={data}", "sft.steps=300",
             "sft.max_seq_len=320", f"run.dir={work}", "run.name=long-sft",
             f"sft.output={sft}", "run.overwrite=true"],
            check=True, cwd=REPO,
        )  # fmt: skip
    return str(sft)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--trl-worker":
        model, work, spec, out, launch = sys.argv[2:7]
        return trl_worker(model, Path(work), Path(spec), Path(out), float(launch))
    if len(sys.argv) > 1 and sys.argv[1] == "--floor-worker":
        model, work, spec, out = sys.argv[2:6]
        r = json.loads(Path(spec).read_text())
        floor = train_floor(model, Path(work) / f"trident-{r['name']}", r)
        Path(out).write_text(json.dumps(floor))
        return None
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", choices=[*RECIPES, "all"], default="all")
    ap.add_argument("--model", help="the demo's SFT checkpoint (default: built here)")
    ap.add_argument("--target", type=float, default=0.9, help="held-out accuracy to reach")
    ap.add_argument("--work", default=str(REPO / "runs" / "bench-vs-trl"))
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    demo_sft = args.model or warmed_up_model(work)
    results = []
    for name in RECIPES if args.recipe == "all" else [args.recipe]:
        r = recipe(name)
        model = {
            "demo": lambda: demo_sft,
            "long": lambda: long_warmed_up_model(work, demo_sft),
            "compute": lambda: small_model(work),
        }[name]()
        sides = {"trident": run_trident(model, work, r), "TRL": run_trl(model, work, r)}
        sides["trident"]["floor"] = train_floor(model, work / f"trident-{name}", r)
        sides["trident"]["floor (jemalloc)"] = train_floor_jemalloc(model, work, r)
        res: dict[str, Any] = {"recipe": r, "model": model, "sides": sides}
        if r["evaluate"]:
            test = rendered_rows(model, "test")
            res["start_accuracy"] = heldout_accuracy(model, test, r["max_tokens"])
            for side in sides.values():
                side["accuracy"] = {
                    int(s): heldout_accuracy(p, test, r["max_tokens"])
                    for s, p in side["checkpoints"].items()
                }
                side["time_to_target_s"] = time_to_target(
                    side["accuracy"], side["step_ends"], args.target
                )
        t, h = sides["trident"], sides["TRL"]
        res["ratios"] = {
            "s / RL step": h["step_s"] / t["step_s"],
            "command → first step": h["first_step_s"] / t["first_step_s"],
            "command → exit": h["total_s"] / t["total_s"],
        }
        results.append(res)
    result = {
        "benchmark": "vs_trl",
        "config": "configs/demo.yaml",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, cuda={torch.cuda.is_available()}",
        "target": args.target,
        "recipes": results,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "vs_trl.json").write_text(json.dumps(result, indent=2) + "\n")
    md = "\n".join(_markdown(res, result) for res in results)
    (RESULTS / "vs_trl.md").write_text(md)
    print(md)


def _markdown(res: dict[str, Any], result: dict[str, Any]) -> str:
    r, sides = res["recipe"], res["sides"]

    def cell(x: float | None) -> str:
        return "not reached" if x is None else f"{x:.1f} s"

    head = (
        f"**{r['name']}** recipe: {r['steps']} steps × {r['prompts_per_step']} prompts × "
        f"{r['n']} samples, ≤ {r['max_tokens']} new tokens, lr {r['lr']:g}, {r['dtype']} "
        f"({result['machine']})."
    )
    cols = [
        "command → first step",
        f"s / RL step (mean after {WARMUP}; median)",
        "response tokens (mean)",
    ]
    if r["evaluate"]:
        head += f" Held-out greedy accuracy at the start: {res['start_accuracy']:.1%}."
        cols += [f"training time to {result['target']:.0%} held-out", "held-out at the end"]
    lines = [head, "", "| | " + " | ".join([*cols, "command → exit"]) + " |"]
    lines.append("|---|" + "---:|" * (len(cols) + 1))
    for name, s in sides.items():
        step = f"{s['step_s']:.2f} s; {s['step_median_s']:.2f} s"
        row = [cell(s["first_step_s"]), step, f"{s['response_tokens_mean']:.1f}"]
        if r["evaluate"]:
            row += [cell(s["time_to_target_s"]), f"{s['accuracy'][r['steps']]:.1%}"]
        lines.append(f"| {name} | " + " | ".join([*row, cell(s["total_s"])]) + " |")
    lines += ["", "TRL / trident (> 1: trident is faster): "]
    lines[-1] += ", ".join(f"{k} **{v:.2f}×**" for k, v in res["ratios"].items()) + "."
    for name, s in sides.items():
        stages = ", ".join(f"{k} {v:.2f} s" for k, v in s["stages"].items())
        lines += [
            "",
            f"{name}, mean seconds per RL step after the first {WARMUP}, by stage: {stages}.",
        ]
        if "parts" in s:
            parts = ", ".join(f"{k} {v:.2f} s" for k, v in s["parts"].items())
            lines += ["", f"{name}, inside those stages: {parts}."]
        for label, key in (("the system allocator", "floor"), ("jemalloc", "floor (jemalloc)")):
            if s.get(key):
                lines += ["", _floor_line(name, s["stages"]["train"], label, s[key])]
    if r["evaluate"]:
        acc = {name: s["accuracy"] for name, s in sides.items()}
        lines += ["", "| held-out accuracy at step | " + " | ".join(acc) + " |"]
        lines += ["|---:|" + "---:|" * len(acc)]
        for step in sorted(next(iter(acc.values()))):
            lines.append(f"| {step} | " + " | ".join(f"{a[step]:.1%}" for a in acc.values()) + " |")
    return "\n".join(lines) + "\n"


def _floor_line(name: str, train: float, allocator: str, f: dict[str, float]) -> str:
    """One allocator's floor (``train_floor``) beside trident's rank code and train stage."""
    floor = f["train floor: recompute"] + f["train floor: forward + backward + AdamW"]
    rank = f["trident interleaved: recompute"] + f["trident interleaved: optimizer steps"]
    steps = f["trident interleaved: optimizer steps"] / f["train floor: forward + backward + AdamW"]
    return (
        f"Train stage, one process ({allocator}), median per step after the first {WARMUP}: the "
        f"floor, plain PyTorch on the token grids {name} trained (no FSDP, no loss terms beyond "
        f"A·logp, no metrics), recompute {f['train floor: recompute']:.2f} s + forward, backward "
        f"and AdamW {f['train floor: forward + backward + AdamW']:.2f} s; interleaved with it, "
        f"{name}'s rank code on the same lengths, recompute "
        f"{f['trident interleaved: recompute']:.2f} s + optimizer steps "
        f"{f['trident interleaved: optimizer steps']:.2f} s: **{rank / floor:.2f}×** the floor "
        f"(optimizer steps alone {steps:.2f}×). {name}'s train stage in its run, minutes "
        f"earlier: {train / floor:.2f}× this floor."
    )


if __name__ == "__main__":
    main()
