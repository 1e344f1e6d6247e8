"""The parts of ``scripts/gpu_trainer_check.py``: the synthetic rollouts, the FLOP count, the
matmul peak, the same-work floor, and the measurements made once (checkpoint round trip, the
weight stream's stand-ins, ``trident sft``, logprob memory). Each returns a JSON-ready dict.

FLOPs (model FLOPs, for MFU): N counts the matmul parameters (per layer q, k, v, o and the
three MLP projections, plus the output head once), T the real tokens, and a step costs
6·N·T + 6·L·(heads·head_dim)·Σ sᵢ² (causal attention: QKᵀ and AV at 2·s²·width each, halved,
x3 for forward and backward). LoRA trains no base weight: 4·N·T plus the same attention.
HFU adds what the code computes beyond that: padding slots (6·N per slot), activation
checkpointing's second forward (2·N·T plus the attention forward) and the chunked head's
recompute of the logits in backward (2·V·d·T). Its simplification: the attention of padded and
packed rows is counted as causal over the real tokens, whatever the kernel does with the mask.
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from trident.algorithms.advantages import grpo_advantages
from trident.models.load import load_causal_lm
from trident.sample import Sample
from trident.train.batch import collate, micro_batches, pack
from trident.train.fsdp import adamw
from trident.train.recompute import select_rows

REPO = Path(__file__).resolve().parents[1]
GIB = 1 << 30


def torch_device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


# -- inputs --------------------------------------------------------------------------------------


def synthetic_rollouts(
    vocab: int,
    prompts: int = 8,
    n: int = 8,
    prompt_tokens: tuple[int, int] = (128, 384),
    median_response: int = 614,
    max_len: int = 1024,
    seed: int = 0,
) -> list[Sample]:
    """GRPO rollouts of realistic shape: ``prompts`` groups of ``n`` samples sharing one prompt,
    log-normal response lengths (σ 0.5) capped so a sample stays within ``max_len``, random
    token ids, Gaussian rewards (every group has signal), engine logprobs −ln V (what a
    near-uniform random model gives)."""
    rng = random.Random(seed)
    samples = []
    for p in range(prompts):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(*prompt_tokens))]
        for k in range(n):
            length = round(rng.lognormvariate(math.log(median_response), 0.5))
            length = max(1, min(max_len - len(prompt), length))
            response = [rng.randrange(vocab) for _ in range(length)]
            pl = len(prompt)
            samples.append(
                Sample(
                    id=f"p{p}-{k}", group_id=f"p{p}", token_ids=prompt + response,
                    loss_mask=[0] * pl + [1] * length,
                    logprobs=[0.0] * pl + [-math.log(vocab)] * length,
                    versions=[-1] * pl + [0] * length, reward=rng.gauss(0.0, 1.0),
                )
            )  # fmt: skip
    return samples


def rollout_figures(samples: list[Sample], micro_batch_tokens: int) -> dict[str, float]:
    """The batch's sizes: tokens, the share a shared-prompt pass computes, padded slots."""
    lengths = [len(s.token_ids) for s in samples]
    padded = micro_batches(lengths, micro_batch_tokens)
    prompts = {s.group_id: s.prompt_len for s in samples}
    repeated = sum(s.prompt_len for s in samples) - sum(prompts.values())
    return {
        "samples": len(samples),
        "tokens": sum(lengths),
        "shared_prompt_share": 1 - repeated / sum(lengths),
        "response_tokens": sum(s.num_response_tokens for s in samples),
        "distinct_prompt_tokens": sum(prompts.values()),
        "padded_micro_batches": len(padded),
        "padded_slots": sum(len(g) * max(lengths[i] for i in g) for g in padded),
    }


# -- FLOPs and the matmul peak -------------------------------------------------------------------


def _dims(config: Any) -> tuple[int, int, int, int, int, int]:
    d, layers = config.hidden_size, config.num_hidden_layers
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or d // heads
    return d, layers, heads * head_dim, kv * head_dim, config.intermediate_size, config.vocab_size


def matmul_parameters(config: Any) -> int:
    """N: the parameters that multiply (projections and the head), embeddings and norms not."""
    d, layers, width, kv_width, f, vocab = _dims(config)
    return layers * (2 * d * width + 2 * d * kv_width + 3 * d * f) + vocab * d


def step_flops(
    config: Any,
    lengths: list[int],
    *,
    lora: bool = False,
    ac: bool = False,
    chunked_head: bool = True,
    slots: int | None = None,
) -> dict[str, float]:
    """Model FLOPs (for MFU) and hardware FLOPs (for HFU) of one step on samples of ``lengths``
    (``slots``: the positions a padded layout computes)."""
    d, layers, width, _, _, vocab = _dims(config)
    n, tokens = matmul_parameters(config), sum(lengths)
    # QKᵀ and AV: 4·s²·width forward, halved by the causal mask, x3 with the backward
    attention = 6 * layers * width * sum(s * s for s in lengths)
    model = (4 if lora else 6) * n * tokens + attention
    hardware = model + (4 if lora else 6) * n * max(0, (slots or tokens) - tokens)
    if ac:
        hardware += 2 * n * tokens + attention / 3
    if chunked_head:
        hardware += 2 * vocab * d * tokens
    return {"model_flops": model, "hardware_flops": hardware}


def matmul_peak(device: torch.device, dtype: torch.dtype, size: int) -> dict[str, Any]:
    """The rate of a ``size``³ matmul on random data: the MFU denominator, measured here."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    synchronize(device)
    runs, start = 0, time.perf_counter()
    while runs < 50 and (runs < 5 or time.perf_counter() - start < 2.0):
        a @ b
        runs += 1
        if runs % 5 == 0:
            synchronize(device)
    synchronize(device)
    seconds = (time.perf_counter() - start) / runs
    return {"size": size, "dtype": str(dtype).removeprefix("torch."), "runs": runs,
            "tflops": 2 * size**3 / seconds / 1e12}  # fmt: skip


# -- timing --------------------------------------------------------------------------------------


def timed_steps(
    step: Callable[[], dict[str, float]], device: torch.device, warmup: int = 1, timed: int = 3
) -> dict[str, Any]:
    """``warmup`` steps, then ``timed`` timed ones: the median seconds and the first step's loss
    and gradient norm (every case's first step starts from the same weights and batch)."""
    first: dict[str, float] = {}
    for _ in range(warmup):
        first = first or step()
    seconds = []
    for _ in range(timed):
        synchronize(device)
        start = time.perf_counter()
        out = step()
        synchronize(device)
        seconds.append(time.perf_counter() - start)
        first = first or out
    return {"step_s": statistics.median(seconds), "steps_s": seconds,
            "loss": float(first["loss"]), "grad_norm": float(first["grad_norm"])}  # fmt: skip


# -- the same-work floor -------------------------------------------------------------------------


def floor_step(
    model_path: str,
    samples: list[Sample],
    *,
    pad_id: int,
    micro_batch_tokens: int,
    packed: bool,
    half: bool,
    lr: float,
    grad_clip: float,
    device: torch.device,
) -> Callable[[], dict[str, float]]:
    """A step of the same work in plain PyTorch: the HF model's forward (float32 weights,
    bf16 autocast when ``half``) with the whole logits grid, −Σ A·logp / tokens over the loss
    tokens with GRPO's advantages, backward, the gradient norm clipped, one fused AdamW step;
    on the micro-batches trident's padded (or ``packed``) case makes. No FSDP, ratio, clip,
    entropy or chunking."""
    net = load_causal_lm(model_path, "float32", device)
    params = [p for p in net.parameters() if p.requires_grad]
    opt = adamw(params, lr)
    batch = collate(samples, pad_id)
    groups = {g: i for i, g in enumerate(dict.fromkeys(s.group_id for s in samples))}
    rewards = torch.tensor([float(s.reward or 0.0) for s in samples])
    weights = grpo_advantages(rewards, torch.tensor([groups[s.group_id] for s in samples]),
                              batch.mask) * batch.mask  # fmt: skip
    tokens = float(batch.mask.sum())
    lengths = batch.attention_mask.sum(1).tolist()
    parts = micro_batches(lengths, micro_batch_tokens, packed=packed)

    def loss(rows: list[int]) -> torch.Tensor:
        mb, w = select_rows(batch, rows).to(device), weights[rows].to(device)
        with torch.autocast(device.type, torch.bfloat16, enabled=half):
            if packed:
                ids, positions, where, at = pack(mb)
                logits = net(input_ids=ids, position_ids=positions, use_cache=False).logits
                logits, targets = logits.flatten(0, 1)[at], ids.flatten()[at + 1]
                w = w[:, : where.shape[1]][where.bool()]
            else:
                logits = net(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                             use_cache=False).logits[:, :-1]  # fmt: skip
                targets, w = mb.input_ids[:, 1:], w[:, : mb.mask.shape[1]]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None])[..., 0]
        return -(logp * w).sum() / tokens

    def step() -> dict[str, float]:
        total = 0.0
        for rows in parts:
            value = loss(rows)
            value.backward()
            total += float(value.detach())
        norm = float(torch.nn.utils.clip_grad_norm_(params, grad_clip))
        opt.step()
        opt.zero_grad(set_to_none=True)
        return {"loss": total, "grad_norm": norm}

    return step


# -- once: checkpoint round trip, weight stream, IPC, sft, logprob memory ------------------------


def directory_gb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e9


def same_training_state(a: Any, b: Any) -> dict[str, bool]:
    """Whether two workers hold bit-equal parameters and AdamW moments (full tensors)."""
    from trident.weights.tensors import full_tensor

    pairs = list(zip(a.model.parameters(), b.model.parameters(), strict=True))
    params = all(torch.equal(full_tensor(p), full_tensor(q)) for p, q in pairs)
    moments = True
    for p, q in pairs:
        sp, sq = a.opt.state.get(p, {}), b.opt.state.get(q, {})
        if set(sp) != set(sq):
            moments = False
        for key in ("exp_avg", "exp_avg_sq", "step"):
            if key in sp and not torch.equal(full_tensor(sp[key]), full_tensor(sq[key])):
                moments = False
    return {"params_bit_equal": params, "moments_bit_equal": moments}


def weight_stream(model: torch.nn.Module, tied: bool, dtype: torch.dtype) -> dict[str, Any]:
    """trident's sender without an engine: the weights cast to the engine's ``dtype`` and
    gathered (``hf_named_tensors``), cut into 256 MB buckets, each written to shared memory with
    its checksum (``write_bucket``, as ``ShmTransport`` does), then read back and checksummed
    (``vllm_plugin.checksum(map_file(...))``, the engine side's check)."""
    from trident.weights.buckets import DEFAULT_BUCKET_BYTES, iter_buckets, write_bucket
    from trident.weights.sync import hf_named_tensors
    from trident.weights.vllm_plugin import checksum, map_file

    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    with tempfile.TemporaryDirectory(dir=shm, prefix="trident-check-") as tmp:
        start = time.perf_counter()
        named = hf_named_tensors(model, tied, dtype=dtype)
        files = [write_bucket(bucket, Path(tmp) / f"bucket{i}.safetensors")
                 for i, bucket in enumerate(iter_buckets(named, DEFAULT_BUCKET_BYTES))]  # fmt: skip
        written = time.perf_counter() - start
        same = []
        for f in files:
            mapped = map_file(f.path)
            same.append(checksum(mapped) == f.checksum)
            mapped.close()
        read = time.perf_counter() - start - written
    return {"buckets": len(files), "gb": sum(f.nbytes for f in files) / 1e9,
            "write_s": written, "read_back_s": read, "checksums_equal": all(same),
            "dir": str(shm)}  # fmt: skip


def _ipc_receiver(conn: Any) -> None:
    """The second process: rebuild each tensor from its CUDA IPC handle, answer its sum."""
    while (message := conn.recv()) is not None:
        rebuild, args = message
        conn.send(float(rebuild(*args).double().sum()))


def ipc_round_trip(model: torch.nn.Module, tied: bool, dtype: torch.dtype) -> dict[str, Any]:
    """The same stream handed to a spawned process by CUDA IPC (``reduce_tensor`` → its pickled
    handle → the receiver's rebuild, the data plane of vLLM's IPC weight transfer on one GPU):
    the per-tensor sums must agree."""
    from torch.multiprocessing.reductions import reduce_tensor

    from trident.weights.sync import hf_named_tensors
    from trident.weights.tensors import full_tensor

    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device here: CUDA IPC needs one"}
    context = mp.get_context("spawn")
    here, there = context.Pipe()
    receiver = context.Process(target=_ipc_receiver, args=(there,), daemon=True)
    start = time.perf_counter()
    receiver.start()
    try:
        started = time.perf_counter() - start
        agree, count, nbytes = True, 0, 0
        for _, tensor in hf_named_tensors(model, tied, dtype=dtype):
            t = full_tensor(tensor).contiguous()
            here.send(reduce_tensor(t))
            agree = agree and here.recv() == float(t.double().sum())
            count, nbytes = count + 1, nbytes + t.numel() * t.element_size()
        here.send(None)
        receiver.join(60)
    finally:
        if receiver.is_alive():
            receiver.kill()
    return {"tensors": count, "gb": nbytes / 1e9, "receiver_start_s": started,
            "seconds": time.perf_counter() - start, "sums_equal": agree}  # fmt: skip


def sft_run(
    model_path: str, work: Path, steps: int, overrides: list[str], timeout_s: float
) -> dict[str, Any]:
    """``trident sft`` as a user runs it, in a subprocess: return code, steps, losses."""
    cmd = [sys.executable, "-m", "trident.cli", "sft", f"model.path={model_path}",
           f"run.dir={work}", "run.name=sft", f"sft.steps={steps}", "telemetry.progress=false",
           *overrides]  # fmt: skip
    start = time.perf_counter()
    try:
        r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"out of the check's budget after {timeout_s:.0f} s"}
    seconds = time.perf_counter() - start
    metrics = work / "sft" / "sft_metrics.jsonl"
    rows = (
        [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    )
    out: dict[str, Any] = {"returncode": r.returncode, "seconds": seconds, "steps": len(rows),
                           "overrides": overrides}  # fmt: skip
    if rows:
        out |= {"first_loss": rows[0]["loss"], "last_loss": rows[-1]["loss"]}
    if r.returncode != 0:
        out["error"] = (r.stderr.strip().splitlines() or ["?"])[-1][:300]
    return out


def logprob_memory(tokens: list[int], device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Peak memory of the logprob + entropy loss, whole grid against 1,024-token chunks, with
    ``benchmarks/logprob_memory.py``'s inputs and loss: measured above the inputs on CUDA
    (``max_memory_allocated``; an OOM is reported as such); on a CPU, counted on fake tensors
    (its ``tracked_gib``)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import logprob_memory as bench

    rows = []
    for n in tokens:
        row: dict[str, Any] = {"tokens": n}
        for name, chunk in (("grid", 0), ("chunked", 1024)):
            if device.type != "cuda":
                row[f"{name}_tracked_gib"] = bench.tracked_gib(n, chunk, dtype)
                continue
            try:
                x = bench.inputs(n, "cuda", dtype)
                synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)
                bench.loss_backward(x, chunk)
                synchronize(device)
                row[f"{name}_gib"] = (torch.cuda.max_memory_allocated(device) - before) / GIB
            except torch.cuda.OutOfMemoryError:
                row[f"{name}_gib"] = "OOM"
            x = None
            torch.cuda.empty_cache()
        rows.append(row)
    return rows
