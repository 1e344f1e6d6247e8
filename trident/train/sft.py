"""Supervised fine-tuning: the warm-up that RL starts from.

Data: rows with ``prompt`` + ``response``, rows of a built-in task (the response is the task's
solution, or one of ``sft.answer_formats``), or rows with ``messages`` (a whole chat; every
assistant turn is trained on).
Tokens are laid out exactly as rollout will see them: the chat-template prompt with the generation
prompt, then the response ids and EOS. Loss is cross-entropy on response tokens only, averaged
over the rank's response tokens (ranks hold equal shares of each batch, and FSDP2 averages
gradients across ranks). AdamW, linear warm-up, cosine decay; FSDP2 over ``sft.num_ranks``
processes; the result is an HF-format checkpoint.
"""

from __future__ import annotations

import json
import os
import random
import time
import zlib
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from trident.config import TridentConfig
from trident.data.loaders import DataError, load_split
from trident.data.tasks import get_task
from trident.models.load import encode_chat, load_causal_lm, load_tokenizer, prompt_messages
from trident.train import fsdp
from trident.weights.tensors import full_tensor

Example = tuple[list[int], list[int]]  # token ids, loss mask


def encode_example(
    tokenizer, row: dict, task_name: str = "", answer_formats: Sequence[str] = ()
) -> Example:
    """Token ids and loss mask of one SFT row (see the module docstring for the row shapes)."""
    if "messages" in row:
        return _encode_conversation(tokenizer, row["messages"], row.get("tools"))
    if "response" in row:
        response = row["response"]
    elif task_name and answer_formats:
        # str(): a chat prompt (a list of messages) picks its style from its text too
        fmt = answer_formats[zlib.crc32(str(row["prompt"]).encode()) % len(answer_formats)]
        response = fmt.format(**row)
    elif task_name:
        response = get_task(task_name).solution(row)
    else:
        raise DataError(f"row {row.get('id', '?')}: SFT needs a 'response' or 'messages' column")
    prompt_ids = encode_chat(tokenizer, prompt_messages(row["prompt"]))
    response_ids = tokenizer.encode(response, add_special_tokens=False) + [tokenizer.eos_token_id]
    return prompt_ids + response_ids, [0] * len(prompt_ids) + [1] * len(response_ids)


def _encode_conversation(
    tokenizer, messages: list[dict], tools: list[dict] | None = None
) -> Example:
    ids: list[int] = []
    mask: list[int] = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = encode_chat(tokenizer, messages[:i], add_generation_prompt=True, tools=tools)
        after = encode_chat(tokenizer, messages[: i + 1], add_generation_prompt=False, tools=tools)
        common = 0
        while common < min(len(before), len(after)) and before[common] == after[common]:
            common += 1
        # Tokens already laid down keep their mask; the new assistant span is trained on.
        mask = mask[:common] + [0] * (common - len(mask)) + [1] * (len(after) - common)
        ids = after
    if not ids:
        raise DataError("a 'messages' row has no assistant turn to train on")
    return ids, mask


def collate(examples: list[Example], pad_id: int, max_len: int) -> dict[str, torch.Tensor]:
    examples = [(ids[:max_len], mask[:max_len]) for ids, mask in examples]
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (ids, mask) in enumerate(examples):
        t = torch.tensor(ids)
        input_ids[i, : len(ids)] = t
        attention[i, : len(ids)] = 1
        labels[i, : len(ids)] = torch.where(torch.tensor(mask, dtype=torch.bool), t, -100)
    return {"input_ids": input_ids, "attention_mask": attention, "labels": labels}


def response_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logits, labels = logits[:, :-1].float(), batch["labels"][:, 1:]
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100
    )


def _sft_rank(
    rank: int, world_size: int, port: int, cfg: TridentConfig, examples: list[Example], out_dir: str
) -> None:
    os.environ["LOCAL_RANK"] = str(rank)  # one process per device on this host (fsdp.device)
    fsdp.init_distributed(rank, world_size, "127.0.0.1", port)
    fsdp.set_cpu_threads(cfg.trainer.cpu_threads, sharing=world_size)
    torch.manual_seed(cfg.run.seed)
    tokenizer = load_tokenizer(cfg.model.path)
    dtype = cfg.model.dtype
    model = load_causal_lm(cfg.model.path, fsdp.MASTER_DTYPE, fsdp.device())
    model = fsdp.checkpoint_activations(model, cfg.trainer.activation_checkpointing)
    model = fsdp.shard(model, dtype)
    model.train()
    sc = cfg.sft
    # torch's default AdamW, not the RL trainer's fused one (fsdp.adamw): the same update, other
    # rounding, and on the demo's toy task the warm-up's answer style hangs on it (fused: loss
    # 0.26 against 0.62 after 1000 steps, but greedy accuracy 19% against 23-49%, below where the
    # demo's and the learning tests' bands were measured from).
    opt = torch.optim.AdamW(model.parameters(), lr=sc.lr, weight_decay=sc.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: fsdp.cosine_lr(s, sc.steps, sc.warmup_steps)
    )
    rng = random.Random(cfg.run.seed)
    per_rank = max(1, sc.batch_size // world_size)
    metrics_path = Path(out_dir).parent / "sft_metrics.jsonl"
    progress = _progress(rank == 0 and cfg.telemetry.progress, sc.steps)
    t0 = time.time()
    with metrics_path.open("w", buffering=1) if rank == 0 else open(os.devnull, "w") as log:
        for step in range(sc.steps):
            batch_rows = rng.sample(range(len(examples)), min(sc.batch_size, len(examples)))
            mine = [examples[i] for i in batch_rows[rank * per_rank : (rank + 1) * per_rank]]
            batch = {
                k: v.to(fsdp.device())
                for k, v in collate(mine, tokenizer.pad_token_id, sc.max_seq_len).items()
            }
            loss = response_loss(model, batch)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            record = {
                "step": step,
                "loss": loss.item(),
                "grad_norm": float(full_tensor(grad_norm)),
                "lr": sched.get_last_lr()[0],
                "time_s": round(time.time() - t0, 2),
            }
            log.write(json.dumps(record) + "\n")
            progress(step, record)
    fsdp.save_hf(model, tokenizer, out_dir)
    dist.destroy_process_group()


def _progress(enabled: bool, total: int):
    if not enabled:
        return lambda step, record: None
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    bar = Progress(
        TextColumn("sft"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("loss {task.fields[loss]:.4f}"),
        TimeRemainingColumn(),
        transient=False,
    )
    task = bar.add_task("sft", total=total, loss=float("nan"))
    bar.start()

    def update(step: int, record: dict) -> None:
        bar.update(task, completed=step + 1, loss=record["loss"])
        if step + 1 == total:
            bar.stop()

    return update


def run_sft(cfg: TridentConfig) -> Path:
    """Fine-tune ``cfg.model.path`` on ``cfg.data``; returns the checkpoint directory."""
    from torch.multiprocessing.spawn import spawn

    from trident.cluster.net import free_port

    # Data problems surface here, before any process group or model exists.
    tokenizer = load_tokenizer(cfg.model.path)
    rows = load_split(cfg.data, "train", cfg.run.seed)
    task = "" if cfg.data.train_path else cfg.data.task
    examples = [encode_example(tokenizer, r, task, cfg.sft.answer_formats) for r in rows]
    out_dir = cfg.sft.output or f"{cfg.derived.run_dir}/model"
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    args = (cfg.sft.num_ranks, free_port(), cfg, examples, out_dir)
    if cfg.sft.num_ranks == 1:
        _sft_rank(0, *args)
    else:
        spawn(_sft_rank, args=args, nprocs=cfg.sft.num_ranks)
    return Path(out_dir)
