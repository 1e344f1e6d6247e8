#!/usr/bin/env python3
"""The trainer alone on a GPU, with neither vLLM nor Ray: trident's rank code in this one process
(``PolicyWorker`` at world size 1, FSDP2, bf16 over float32 masters) on synthetic GRPO rollouts
at Qwen2.5-0.5B and 1.5B shapes (then 7B, LoRA r16 + activation checkpointing, if 150 s of the
budget remain), beside a same-work floor in plain PyTorch, against the card's own bf16 matmul
peak measured in the same call.

Per shape, each case builds a fresh worker from the same random-init checkpoint and runs one
warm-up step and three timed ones (the median is reported): trident padded, packed, shared
prompts, packed + activation checkpointing, LoRA r16 (packed), padded with
``run.deterministic=true`` (pass/fail: torch's deterministic mode on CUDA raises unless
``CUBLAS_WORKSPACE_CONFIG`` is set, which trident does), and the floor padded and packed on the same
micro-batches (``trainer_check_parts.floor_step``). Per case: step seconds, tokens/s, peak memory,
MFU and HFU (FLOPs as ``trainer_check_parts`` counts them), the first step's loss and gradient
norm (the same weights and batch in every case: trident's cases agree on both within bf16
tolerance, and the floors' gradient norm equals trident's, the step being the same gradient:
``algo.is_level=none`` so no importance weight differs). Once, on the first shape: a checkpoint
round trip (``save_state`` → a fresh worker's ``load_state``: parameters and AdamW moments
bit-equal), the weight stream to shared memory and read back with checksums, the same stream by
CUDA IPC to a second process, ``trident sft`` for 20 steps (a subprocess), logprob memory at
1K-16K tokens (whole grid against chunks).

Every case checks ``--budget-s`` before it starts (default 450 s of script time: with the wheel
install and the machine's start it fits one 8-minute call). One JSON and one table, printed
last, go to ``--out`` (default ``$OUT``, else ``benchmarks/results/``).

    python scripts/gpu_trainer_check.py --out "$OUT"     # on the GPU machine (docs/gpu.md)
    python scripts/gpu_trainer_check.py --smoke --out DIR  # tiny shapes, float32, CPU: seconds
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # per-file loading bars, per case

import torch  # noqa: E402
import trainer_check_parts as parts  # noqa: E402

from trident.config import load_config  # noqa: E402
from trident.models.factory import LIKE, hf_config, init_from_config  # noqa: E402
from trident.models.load import load_tokenizer  # noqa: E402
from trident.train.policy import PolicyWorker  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
LARGE_MIN_LEFT_S = 150  # the 7B case runs only with this much of the budget left

# name, config.json fields, lora + AC only (the 7B: its full fine-tuning state is 122 GB)
GPU_SHAPES = [
    ("qwen2.5-0.5b", LIKE["qwen2.5-0.5b"], False),
    ("qwen2.5-1.5b", LIKE["qwen2.5-1.5b"], False),
    ("qwen2.5-7b", LIKE["qwen2.5-7b"], True),
]
_TINY = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=4096)  # fmt: skip
SMOKE_SHAPES = [
    ("tiny (qwen2.5 layout)", {**LIKE["qwen2.5-0.5b"], **_TINY}, False),
    ("tiny, untied (qwen2.5-7b layout)", {**LIKE["qwen2.5-7b"], **_TINY}, True),
]

LORA = "model.lora={r: 16, alpha: 32}"
NO_PACKING = ["trainer.packing=false", "trainer.share_prompts=false"]
PACKED = ["trainer.packing=true", "trainer.share_prompts=false"]
TRIDENT_CASES = [
    ("padded", NO_PACKING),
    ("packed", PACKED),
    ("shared prompts", ["trainer.packing=false", "trainer.share_prompts=true"]),
    ("packed + AC", [*PACKED, "trainer.activation_checkpointing=true"]),
    ("LoRA r16, packed", [*PACKED, LORA]),
    ("padded, run.deterministic", [*NO_PACKING, "run.deterministic=true"]),
]
LARGE_CASE = ("LoRA r16, packed + AC", [*PACKED, LORA, "trainer.activation_checkpointing=true"])


class Budget:
    """The script's time: every case asks before it starts."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.start = seconds, time.monotonic()

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.start)

    def refuses(self, need_s: float = 0.0) -> str | None:
        left = self.left()
        return f"skipped: {left:.0f} s of the budget left" if left <= need_s else None


class Shape:
    """One model shape's checkpoint, rollouts and the settings every case of it shares."""

    def __init__(self, name: str, spec: dict, work: Path, smoke: bool):
        self.name, self.smoke = name, smoke
        self.device = device = torch.device("cpu") if smoke else parts.torch_device()
        self.dtype = "float32" if smoke else "bfloat16"
        self.path = str(work / re.sub(r"\W+", "_", name))
        start = time.perf_counter()
        with torch.device(device):  # random init on the GPU: seconds, not a minute at 7B
            init_from_config(self.path, spec, dtype=self.dtype, seed=0)
        _free_memory()
        self.init_s = time.perf_counter() - start
        self.config = hf_config(spec)
        self.pad_id = int(load_tokenizer(self.path).pad_token_id)
        vocab = self.config.vocab_size
        if smoke:
            self.samples = parts.synthetic_rollouts(vocab, 4, 4, (8, 24), 24, 64)
            self.micro_batch_tokens = 256
        else:
            self.samples = parts.synthetic_rollouts(vocab)
            self.micro_batch_tokens = 8192
        self.lengths = [len(s.token_ids) for s in self.samples]
        self.rollouts = parts.rollout_figures(self.samples, self.micro_batch_tokens)
        self.base = [
            f"model.path={self.path}", f"model.dtype={self.dtype}", f"run.dir={work / 'runs'}",
            "telemetry.progress=false", f"trainer.micro_batch_tokens={self.micro_batch_tokens}",
            "trainer.mini_batches=1", "algo.is_level=none",
        ]  # fmt: skip
        if smoke:  # one thread: a shared CPU's cores spin against each other otherwise
            self.base.append("trainer.cpu_threads=1")

    def describe(self) -> dict[str, Any]:
        return {"checkpoint_dtype": self.dtype, "init_s": self.init_s,
                "matmul_parameters": parts.matmul_parameters(self.config),
                "rollouts": self.rollouts, "micro_batch_tokens": self.micro_batch_tokens,
                "config": {k: getattr(self.config, k) for k in (
                    "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "vocab_size",
                    "tie_word_embeddings")}}  # fmt: skip

    def worker(self, overrides: list[str]) -> PolicyWorker:
        return PolicyWorker(load_config([], [*self.base, *overrides]), 0, 1, "127.0.0.1", 0)

    def flops(self, overrides: list[str], padded: bool, floor: bool = False) -> dict[str, float]:
        return parts.step_flops(
            self.config, self.lengths, lora=LORA in overrides,
            ac="trainer.activation_checkpointing=true" in overrides, chunked_head=not floor,
            slots=self.rollouts["padded_slots"] if padded else None,
        )  # fmt: skip


def _free_memory() -> None:
    """Give back what the last case held (its references must be dropped first)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _figures(shape: Shape, timing: dict, flops: dict, peak_tflops: float) -> dict[str, Any]:
    rate = peak_tflops * 1e12
    return timing | {
        "tokens_per_s": shape.rollouts["tokens"] / timing["step_s"],
        "peak_gib": parts.peak_gib(shape.device),
        "mfu": flops["model_flops"] / timing["step_s"] / rate,
        "hfu": flops["hardware_flops"] / timing["step_s"] / rate,
        **flops,
    }


def trident_case(shape: Shape, overrides: list[str], peak: float) -> dict[str, Any]:
    """One case of trident's rank code; the worker is returned beside the row for reuse."""
    parts.reset_peak(shape.device)
    try:
        worker = shape.worker(overrides)
        timing = parts.timed_steps(lambda: worker.train_step(shape.samples), shape.device)
    finally:
        if "run.deterministic=true" in overrides:  # the process's later cases run without it
            torch.use_deterministic_algorithms(False)
    shared = "trainer.share_prompts=true" in overrides
    padded = "trainer.packing=false" in overrides and not shared
    row = _figures(shape, timing, shape.flops(overrides, padded), peak)
    if "run.deterministic=true" in overrides:  # trident sets it (train/policy.py), not this script
        row["cublas_workspace_config"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if shared:  # FLOPs are counted on every token, as for the others
        row["note"] = (
            f"each prompt runs once per group: {shape.rollouts['shared_prompt_share']:.0%} of "
            "the tokens counted are computed"
        )
    return row | {"worker": worker}


def floor_case(shape: Shape, packed: bool, peak: float) -> dict[str, Any]:
    """The same work in plain PyTorch; at half the micro-batch budget if the grid does not fit."""
    budget, note = shape.micro_batch_tokens, None
    cfg = load_config([], shape.base)
    while True:
        parts.reset_peak(shape.device)
        try:
            step = parts.floor_step(
                shape.path, shape.samples, pad_id=shape.pad_id, micro_batch_tokens=budget,
                packed=packed, half=shape.dtype == "bfloat16", lr=cfg.trainer.lr,
                grad_clip=cfg.trainer.grad_clip, device=shape.device,
            )  # fmt: skip
            timing = parts.timed_steps(step, shape.device)
            break
        except torch.cuda.OutOfMemoryError:
            if budget <= 1024:
                raise
        step = None  # out of the except block: its traceback no longer holds the model
        _free_memory()
        budget //= 2
        note = f"out of memory at {budget * 2} tokens: micro-batches of {budget}"
    row = _figures(shape, timing, shape.flops([], padded=not packed, floor=True), peak)
    return row | {"micro_batch_tokens": budget, "note": note}


def run_shape(
    shape: Shape, large: bool, peak: float, budget: Budget, once: bool = False
) -> tuple[list[dict], dict | None]:
    """Every case of one shape (``large``: the LoRA + AC case alone); with ``once``, the
    checkpoint round trip and the weight stream on the packed worker (the second item)."""
    rows: list[dict[str, Any]] = []
    measured_once = None
    cases = [LARGE_CASE] if large else TRIDENT_CASES
    floors = [] if large else [("floor, padded", NO_PACKING), ("floor, packed", PACKED)]
    for name, overrides in [*cases, *floors]:
        row: dict[str, Any] = {"shape": shape.name, "case": name}
        skipped = budget.refuses(0 if shape.smoke else 10)
        if skipped:
            rows.append(row | {"error": skipped})
            continue
        try:
            if name.startswith("floor"):
                row |= floor_case(shape, "trainer.packing=true" in overrides, peak)
            else:
                row |= trident_case(shape, list(overrides), peak)
        except Exception as e:  # a case that fails is a finding: the others still run
            row["error"] = _error(e)
        worker = row.pop("worker", None)
        rows.append(row)
        if worker is not None and once and name == "packed" and not budget.refuses():
            measured_once = once_on(shape, worker, list(overrides))
        if worker is not None:
            worker.release()
        worker = None
        _free_memory()
    _agreement(rows, tolerance=1e-3 if shape.smoke else 5e-2)
    return rows, measured_once


def _agreement(rows: list[dict], tolerance: float) -> None:
    """Each case's first-step loss and gradient norm against trident padded's (the floors:
    the gradient norm only, their loss being −Σ A·logp, not the clipped ratio's)."""
    ref = next((r for r in rows if r.get("case") == "padded" and "loss" in r), None)
    for r in rows:
        if ref is None or "grad_norm" not in r or r["case"].startswith("LoRA"):
            continue
        keys = ["grad_norm"] if r["case"].startswith("floor") else ["loss", "grad_norm"]
        r["agrees"] = all(math.isclose(r[k], ref[k], rel_tol=tolerance, abs_tol=1e-6)
                          for k in keys)  # fmt: skip


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"


def once_on(shape: Shape, worker: PolicyWorker, overrides: list[str]) -> dict:
    """The weight stream to shared memory, the IPC stand-in and the checkpoint round trip, each
    a finding of its own if it fails."""
    out: dict[str, Any] = {"shape": shape.name}
    # the head goes out as the embedding when tied (as WeightSender sends it)
    tied = bool(getattr(worker.model.config, "tie_word_embeddings", False))
    measures = {
        "stream": lambda: parts.weight_stream(worker.model, tied, torch.bfloat16),
        "ipc": lambda: parts.ipc_round_trip(worker.model, tied, torch.bfloat16),
        "round_trip": lambda: round_trip(shape, worker, overrides),
    }
    for key, measure in measures.items():
        try:
            out[key] = measure()
        except Exception as e:
            out[key] = {"error": _error(e)}
    return out


def round_trip(shape: Shape, worker: PolicyWorker, overrides: list[str]) -> dict[str, Any]:
    """``save_state``, then a fresh worker's ``load_state``: parameters and AdamW moments
    bit-equal, and the next step's gradient norm the same on both."""
    ckpt = Path(shape.path).parent / "round_trip"
    try:
        start = time.perf_counter()
        worker.save_state(str(ckpt))
        saved = time.perf_counter() - start
        fresh = shape.worker(overrides)
        start = time.perf_counter()
        fresh.load_state(str(ckpt))
        loaded = time.perf_counter() - start
        same = parts.same_training_state(worker, fresh)
        # the next step from both: its gradient norm depends on every weight (its loss does not:
        # the ratio is 1 at a step's start); on a GPU, atomics in backward may move its last bits
        norms = [w.train_step(shape.samples)["grad_norm"] for w in (worker, fresh)]
        fresh.release()
        return same | {
            "save_s": saved, "load_s": loaded, "gb": parts.directory_gb(ckpt),
            "next_step_grad_norms": norms, "next_step_bit_equal": norms[0] == norms[1],
        }  # fmt: skip
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)


def environment(device: torch.device) -> dict[str, Any]:
    """The card, driver and library versions this ran with."""
    import transformers

    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "transformers": transformers.__version__}  # fmt: skip
    try:
        import peft

        env["peft"] = peft.__version__
    except ImportError:
        env["peft"] = None
    if device.type == "cuda":
        env["device"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
        smi = shutil.which("nvidia-smi")
        if smi:
            query = [smi, "--query-gpu=driver_version,memory.total", "--format=csv,noheader"]
            env["driver"] = subprocess.run(query, capture_output=True, text=True).stdout.strip()
    else:
        env["device"] = f"cpu ({platform.processor() or platform.machine()})"
    try:
        sys.path.insert(0, str(REPO / "benchmarks"))
        from provenance import provenance

        env["provenance"] = provenance()
    except (OSError, ImportError) as e:  # no git on the machine
        env["provenance"] = {"error": str(e)}
    return env


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=450.0, help="script time for all cases")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, float32, on CPU: seconds")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "benchmarks/results"))
    ap.add_argument("--sft-steps", type=int, default=None, help="default 20 (--smoke: 2)")
    args = ap.parse_args()
    budget = Budget(args.budget_s)
    device = torch.device("cpu") if args.smoke else parts.torch_device()
    if args.smoke:
        torch.set_num_threads(1)  # as the smoke run's workers (trainer.cpu_threads=1)
    if device.type != "cuda" and not args.smoke:
        print("gpu_trainer_check: no CUDA device; --smoke checks the script on CPU")
        return 2
    half = torch.float32 if args.smoke else torch.bfloat16
    peak = parts.matmul_peak(device, half, 512 if args.smoke else 8192)
    result: dict[str, Any] = {"smoke": args.smoke, "budget_s": args.budget_s,
                              "environment": environment(device), "matmul_peak": peak,
                              "shapes": {}, "cases": [], "once": None}  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shapes = SMOKE_SHAPES if args.smoke else GPU_SHAPES
    with tempfile.TemporaryDirectory(prefix="trident-trainer-check-") as tmp:
        work = Path(tmp)
        first = measure_shape(result, shapes[0], work, args.smoke, budget, once=True)
        if first is not None:
            steps = args.sft_steps or (2 if args.smoke else 20)
            result["sft"] = _guarded(lambda: sft(first, work, steps, budget))
        tokens = [256] if args.smoke else [1024, 4096, 8192, 16384]
        refused = budget.refuses()
        result["logprob_memory"] = (
            {"error": refused}
            if refused
            else _guarded(lambda: parts.logprob_memory(tokens, device, half))
        )
        save(result, out, budget)  # what is measured so far, should a later shape kill the call
        for entry in shapes[1:]:
            measure_shape(result, entry, work, args.smoke, budget)
            save(result, out, budget)
    table = render(result)
    (out / "gpu_trainer_check.md").write_text(table + "\n")
    print(table)
    failed = [r for r in result["cases"] if not r.get("error", "skipped").startswith("skipped")]
    return 1 if failed else 0


def measure_shape(
    result: dict[str, Any],
    entry: tuple,
    work: Path,
    smoke: bool,
    budget: Budget,
    once: bool = False,
) -> Shape | None:
    """One shape's checkpoint and cases into ``result``; None if it could not be built."""
    name, spec, large = entry
    need = LARGE_MIN_LEFT_S if large and not smoke else 0
    refused = budget.refuses(need)
    if refused:
        result["cases"].append({"shape": name, "case": "all", "error": refused})
        return None
    try:
        shape = Shape(name, spec, work, smoke)
    except Exception as e:  # e.g. out of memory or disk: the next shapes still run
        result["cases"].append({"shape": name, "case": "all", "error": _error(e)})
        _free_memory()
        return None
    result["shapes"][name] = shape.describe()
    rows, measured_once = run_shape(shape, large, result["matmul_peak"]["tflops"], budget, once)
    result["cases"] += rows
    if once:
        result["once"] = measured_once
    return shape


def _guarded(measure: Any) -> Any:
    try:
        return measure()
    except Exception as e:
        return {"error": _error(e)}


def save(result: dict[str, Any], out: Path, budget: Budget) -> None:
    result["elapsed_s"] = result["budget_s"] - budget.left()
    (out / "gpu_trainer_check.json").write_text(json.dumps(result, indent=2, default=str) + "\n")


def sft(shape: Shape, work: Path, steps: int, budget: Budget) -> dict[str, Any]:
    """``trident sft`` on the first shape, as a user runs it (defaults otherwise; the smoke run
    takes small batches)."""
    skipped = budget.refuses(0 if shape.smoke else 20)
    if skipped:
        return {"error": skipped}
    overrides = [f"model.dtype={shape.dtype}"]
    if shape.smoke:
        overrides += ["sft.batch_size=8", "sft.max_seq_len=64", "trainer.cpu_threads=1"]
    return parts.sft_run(shape.path, work / "sft_run", steps, overrides, budget.left())


def _number(x: Any, spec: str) -> str:
    return "–" if x is None else format(x, spec) if isinstance(x, int | float) else str(x)


def render(result: dict[str, Any]) -> str:
    """The one table (markdown), and the rows measured once under it."""
    env, peak = result["environment"], result["matmul_peak"]
    driver = f", driver {env['driver']}" if env.get("driver") else ""
    lines = [
        f"gpu_trainer_check on {env['device']} (torch {env['torch']}, transformers "
        f"{env['transformers']}, peft {env['peft']}{driver}); "
        f"{peak['size']}³ {peak['dtype']} matmul: {peak['tflops']:.3g} TFLOP/s; "
        f"{result['elapsed_s']:.0f} s of the {result['budget_s']:.0f} s budget",
        "",
        "| shape | case | step s | tokens/s | peak GiB | MFU | HFU | loss | grad norm | agrees "
        "| × floor |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    floors = {(r["shape"], r["case"]): r.get("step_s") for r in result["cases"]}
    for r in result["cases"]:
        if "step_s" not in r:
            lines.append(f"| {r['shape']} | {r['case']} | {r.get('error', '?')} |")
            continue
        packed = "packed" in r["case"]
        floor = floors.get((r["shape"], "floor, packed" if packed else "floor, padded"))
        ratio = r["step_s"] / floor if floor and not r["case"].startswith("floor") else None
        lines.append(
            f"| {r['shape']} | {r['case']} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} "
            f"| {_number(r['peak_gib'], '.1f')} | {r['mfu']:.1%} | {r['hfu']:.1%} "
            f"| {r['loss']:.4f} | {r['grad_norm']:.4f} | {_number(r.get('agrees'), '')} "
            f"| {_number(ratio, '.2f')} |"
        )
    once = result.get("once") or {}
    lines += ["", f"once, on {once.get('shape', '–')}:"]
    for key in ("round_trip", "stream", "ipc"):
        if key in once:
            lines.append(f"- {key}: {json.dumps(once[key], default=str)}")
    lines.append(f"- trident sft: {json.dumps(result.get('sft'), default=str)}")
    lines.append(f"- logprob memory: {json.dumps(result['logprob_memory'], default=str)}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
