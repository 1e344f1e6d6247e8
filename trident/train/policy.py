"""The FSDP2 policy trainer: one ``PolicyWorker`` per rank, each hosted by a Ray actor.

A training step, given the step's scored Samples (the same list on every rank), runs four stages:

1. recompute: each rank scores its shard with no gradient, with every model it holds (the
   policy about to be updated, the frozen reference, the critic, the teachers):
   :mod:`trident.train.recompute`;
2. advantages over the whole batch, the same on every rank: :mod:`trident.train.advantage`;
3. optimize: ``trainer.mini_batches`` optimizer steps, each accumulating micro-batches of at most
   ``trainer.micro_batch_tokens`` tokens whose loss is :func:`trident.algorithms.rl_loss.rl_loss`
   (global token/sequence counts, so 4x2 equals 8x1 and N ranks equal one);
4. reduce: the ranks' metric sums become the step's metrics.

The worker also saves and loads the training state; its weight push to the rollout servers is
its ``WeightSender`` (:mod:`trident.train.weight_sender`). What the advantage and the loss are
made of, and why: ``docs/algorithms.md``.
"""

from __future__ import annotations

import math
import os
import resource
import time
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trident import algorithms as alg
from trident.algorithms.rl_loss import LossSpec, add_sums, gradient_rows, rl_loss
from trident.config import TridentConfig
from trident.models.load import load_causal_lm, load_tokenizer
from trident.sample import Sample
from trident.train import fsdp, lora
from trident.train.advantage import Advantages
from trident.train.batch import Batch, collate
from trident.train.critic import ValueModel, token_values
from trident.train.recompute import (
    even_micro_batches,
    gather,
    recompute,
    select_rows,
    shard,
    token_logprobs,
)
from trident.train.weight_sender import WeightSender

__all__ = ["PolicyWorker", "engine_logprobs_are_old", "token_logprobs"]


class PolicyWorker:
    """One FSDP2 rank of the policy, and of the models it trains with: the frozen reference
    (KL), the critic (PPO) and the frozen teachers (on-policy distillation)."""

    def __init__(
        self, cfg: TridentConfig, rank: int, world_size: int, master_addr: str, master_port: int
    ) -> None:
        fsdp.init_distributed(rank, world_size, master_addr, master_port)
        # sync mode: the servers idle while the ranks train; otherwise they generate meanwhile
        servers = 0 if cfg.rollout.server_urls else cfg.rollout.num_servers
        computing = world_size + (servers if cfg.pipeline.mode != "sync" else 0)
        fsdp.set_cpu_threads(cfg.trainer.cpu_threads, sharing=computing)
        torch.manual_seed(cfg.run.seed)
        if cfg.run.deterministic:
            fsdp.deterministic_kernels()
        self.cfg, self.rank, self.world = cfg, rank, world_size
        a, tc = cfg.algo, cfg.trainer
        self.device = fsdp.device()
        self.tokenizer = load_tokenizer(cfg.model.path)
        dtype = cfg.model.dtype
        model = load_causal_lm(cfg.model.path, fsdp.MASTER_DTYPE, self.device)
        model = fsdp.checkpoint_activations(model, tc.activation_checkpointing)
        if cfg.model.lora is not None:  # adapters only train; base weights frozen
            model = lora.wrap(model, cfg.model.lora)
        self.model = fsdp.shard(model, dtype)
        self.ref = self._frozen(cfg.model.ref_path or cfg.model.path) if a.kl_coef > 0 else None
        # the advantages' state across steps: adaptive KL, running baselines, prompt ids
        self.adv = Advantages(a, cfg.model.teacher_paths, cfg.data.task)
        self.opt, self.sched = self._optimizer(self.model, tc.lr)
        self.critic = None
        if a.use_critic:
            critic = ValueModel(cfg.model.critic_path or cfg.model.path, fsdp.MASTER_DTYPE)
            fsdp.checkpoint_activations(critic.model, tc.activation_checkpointing)
            self.critic = fsdp.shard(critic.to(self.device), dtype)
            self.critic_opt, self.critic_sched = self._optimizer(self.critic, tc.critic_lr)
        # teachers by path (two tasks may share one); routing: teacher_paths key -> path
        self.teachers: dict[str, torch.nn.Module] = {}
        if a.distill_coef > 0:
            for path in sorted(set(cfg.model.teacher_paths.values())):
                _check_same_vocabulary(self.tokenizer, cfg.model.path, path)
                self.teachers[path] = self._frozen(path)
        self.sender: WeightSender | None = None  # the weight push, made by connect()
        self.served_version: int | None = None  # the version pushed, while the weights are it

    def _frozen(self, path: str) -> torch.nn.Module:
        model = load_causal_lm(path, self.cfg.model.dtype, self.device).eval()
        model.requires_grad_(False)
        return model

    def _optimizer(self, model: torch.nn.Module, lr: float):
        tc = self.cfg.trainer
        trained = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters
        opt = fsdp.adamw(trained, lr, tc.betas, tc.weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt,
            lambda s: fsdp.cosine_lr(s, self.cfg.pipeline.steps, tc.warmup_steps, tc.lr_schedule),
        )
        return opt, sched

    # -- the advantages' state ------------------------------------------------------------------

    @property
    def kl_coef(self) -> float:
        """beta of the KL to the reference: fixed, or the adaptive controller's current value."""
        return self.adv.kl_coef

    # -- training ------------------------------------------------------------------------------

    def train_step(self, samples: list[Sample]) -> dict[str, Any]:
        """One RL step on ``samples`` (identical on every rank): recompute → advantages →
        optimize → reduce. Returns rank-0-reduced metrics and, under ``per_sample``, each
        sample's [mean advantage, mean engine-vs-trainer |Δlogp|] over its loss tokens (for the
        lineage)."""
        t0 = time.perf_counter()
        pad = self.tokenizer.pad_token_id
        full = collate(samples, pad)
        mine, chunks = shard(len(samples), self.cfg.trainer.mini_batches, self.rank, self.world)
        batch = collate([samples[i] for i in mine], pad).to(self.device)
        # With only the policy's own logprobs to recompute, the first mini-batch's come from its
        # own forward pass, taken before any optimizer step: one forward fewer for those rows.
        # With the engine's standing for them (algo.old_logprobs), none is recomputed.
        engine_old = engine_logprobs_are_old(self.cfg, samples, self.served_version)
        fused = not engine_old and self.ref is None and self.critic is None and not self.teachers
        t_recompute = time.perf_counter()
        local = self._recompute(
            batch,
            [samples[i] for i in mine],
            skip=chunks[0] if fused else [],
            policy=not engine_old,
        )
        if engine_old:
            local["old"] = batch.engine_logp.clone()
        t1 = time.perf_counter()
        grids = self._gather(local, mine, full.mask.shape)
        adv_all, returns_all, step_metrics = self.adv.compute(samples, full.mask, grids)
        width = batch.mask.shape[1]
        adv = adv_all[mine][:, :width].to(self.device)
        returns = None if returns_all is None else returns_all[mine][:, :width].to(self.device)
        engine_mask = batch.mask.clone()  # the per-sample mismatch covers every generated token
        if self.cfg.algo.mask_truncated:  # DAPO: truncated samples count in group statistics only
            truncated = torch.tensor(
                [samples[i].status == "truncated" for i in mine], device=self.device
            )
            batch.mask[truncated] = 0.0
        sums: dict[str, float] = defaultdict(float)
        # the trainer's logprobs before the update, of the first mini-batch: pi_old when fused;
        # beside the engine's, the mismatch the engine's carry (NaN: rows not measured)
        before = local["old"] if not engine_old else torch.full_like(local["old"], math.nan)
        t2 = time.perf_counter()
        passed = []  # each mini-batch's rows passed forward (fused: all the first's, for pi_old)
        for k, chunk in enumerate(chunks):
            fill, whole = (before, fused) if k == 0 and (fused or engine_old) else (None, False)
            passed.append(
                self._optimizer_step(batch, chunk, adv, local, returns, sums, fill, whole)
            )
        t3 = time.perf_counter()
        self.served_version = None  # the weights moved on from the version the servers hold
        per_sample = _per_sample(
            mine, full.mask, adv_all, engine_mask, batch.engine_logp, before, self.world
        )
        self.sched.step()
        if self.critic is not None:
            self.critic_sched.step()
        self.adv.update_kl(step_metrics.pop("kl_seq", None), len(samples))
        timing = {  # rank 0's; the caller's time/train_s less these is the batch's transfer
            "time/recompute_s": t1 - t_recompute,
            "time/optimize_s": t3 - t2,
            "time/rank_s": time.perf_counter() - t0,
        } | _memory(self.opt, self.device, release=self.cfg.rollout.sleep_level > 0)
        lr = float(self.sched.get_last_lr()[0])
        metrics = _reduce_metrics(sums, lr, self.world, self.device)
        if engine_old:  # pi_old = the engine's: the mismatch is the first mini-batch's, measured
            rows = passed[0]
            metrics |= _mismatch(
                before[rows], batch.engine_logp[rows], engine_mask[rows], self.world
            )
        metrics["old_logprobs_engine"] = float(engine_old)
        return metrics | step_metrics | timing | {"per_sample": per_sample}

    def _recompute(
        self,
        batch: Batch,
        samples: list[Sample],
        skip: list[int] | None = None,
        policy: bool = True,
    ) -> dict[str, torch.Tensor]:
        """:func:`~trident.train.recompute.recompute` of this rank's rows with its models
        (``policy`` False: not the policy's own)."""
        paths = self.cfg.model.teacher_paths
        teacher_paths = [paths[self.adv.teacher_key(s)] for s in samples] if self.teachers else []
        return recompute(
            batch,
            self.model if policy else None,
            ref=self.ref,
            critic=self.critic,
            teachers=self.teachers,
            teacher_paths=teacher_paths,
            temperature=self.cfg.rollout.temperature or 1.0,
            token_budget=self.cfg.trainer.micro_batch_tokens,
            world=self.world,
            device=self.device,
            skip=skip or (),
            chunk_tokens=self.cfg.trainer.logprob_chunk_tokens,
            packed=self.cfg.trainer.packing,
            shared=self.cfg.trainer.share_prompts,
        )

    def _gather(
        self, local: dict[str, torch.Tensor], mine: list[int], shape: torch.Size
    ) -> dict[str, torch.Tensor]:
        """The whole batch's [B, T] grids (on CPU) of the quantities the advantages need."""
        return gather(local, self.adv.grids(local), mine, shape, self.world, self.device)

    def _optimizer_step(
        self,
        batch: Batch,
        rows: list[int],
        adv: torch.Tensor,
        local: dict[str, torch.Tensor],
        returns: torch.Tensor | None,
        sums: dict[str, float],
        fill: torch.Tensor | None = None,
        whole: bool = False,
    ) -> list[int]:
        """One optimizer step on ``rows`` (unless ``whole``, less those of zero gradient:
        ``trainer.skip_zero_advantage``); returns the rows passed. ``fill``: the grid their
        (pre-step) logprobs from these forward passes go into (``local["old"]`` if not yet)."""
        tc, spec = self.cfg.trainer, _loss_spec(self.cfg, self.kl_coef)
        temperature = self.cfg.rollout.temperature or 1.0
        old_logp, values_old = local["old"], local.get("values")
        ref_logp = None if self.cfg.algo.kl_in_reward else local.get("ref")  # a KL loss term
        tokens, seqs = alg.loss_denominators(batch.mask[rows])  # every row counts in these
        counts = torch.tensor([tokens, seqs], dtype=torch.float64, device=self.device)
        dist.all_reduce(counts)  # global denominators: N ranks equal one
        if tc.skip_zero_advantage and not whole and self.critic is None:
            rows = gradient_rows(rows, adv, batch.mask, spec, kl_term=ref_logp is not None)
        lengths = batch.attention_mask[rows].sum(1).tolist()
        budget, packed = tc.micro_batch_tokens, tc.packing
        # no row left: a zero-weight pass, and AdamW steps as it would have (momentum, decay)
        for part in even_micro_batches(lengths, budget, self.world, self.device, packed) or [None]:
            dummy = part is None  # zero-weight pass that keeps the FSDP collectives in step
            idx = [0] if part is None else [rows[i] for i in part]
            mb = select_rows(batch, idx)
            logp, entropy = token_logprobs(
                self.model, mb, temperature, with_entropy=True,
                chunk_tokens=tc.logprob_chunk_tokens, packed=packed, shared=tc.share_prompts,
                world=self.world,
            )  # fmt: skip
            assert entropy is not None  # asked for with_entropy
            mask, w = mb.mask * (0.0 if dummy else 1.0), mb.mask.shape[1]
            if fill is not None and not dummy:
                fill[idx, :w] = logp.detach()
            out = rl_loss(
                spec, logp, entropy, old_logp[idx, :w], adv[idx, :w], mask, mb.engine_logp,
                global_tokens=int(counts[0]), global_seqs=int(counts[1]),
                ref_logp=ref_logp[idx, :w] if ref_logp is not None else None,
                values=token_values(self.critic, mb) if self.critic is not None else None,
                old_values=values_old[idx, :w] if values_old is not None else None,
                returns=returns[idx, :w] if returns is not None else None,
            )  # fmt: skip
            # FSDP averages gradients over ranks; the losses are each rank's share of a sum
            (out.policy * self.world).backward()
            if out.value is not None:
                (out.value * self.world).backward()
            add_sums(sums, out.sums)  # a zero-weight pass adds zeros: every rank has the keys
        sums["grad_norm"] += fsdp.clip_and_step(self.model, self.opt, tc.grad_clip)
        if self.critic is not None:
            sums["critic_grad_norm"] += fsdp.clip_and_step(
                self.critic, self.critic_opt, tc.grad_clip
            )
        sums["optimizer_steps"] += 1
        return rows

    # -- weight push (trident.train.weight_sender) --------------------------------------------

    def connect(
        self, urls: list[str], backend: str, nodes: Mapping[str, str] | None = None
    ) -> None:
        """Called once, after the rollout servers are up: this rank's ``WeightSender`` for
        ``backend`` (resolved once per run), connected to ``urls``."""
        c = self.cfg
        self.sender = WeightSender(
            self.rank,
            self.model,
            self.tokenizer,
            c.sync,
            c.derived.run_dir,
            backend,
            engine_dtype=c.model.dtype,
            seed=c.run.seed,
            rejoins=c.rollout.max_restarts > 0,  # a restarted server is brought back
        )
        self.sender.connect(urls, nodes)

    def sync_weights(self, version: int, urls: list[str] | None = None) -> dict[str, float]:
        """``WeightSender.push`` of the current weights as ``version`` (collective); the
        trainer then holds the served version until its next optimizer step."""
        assert self.sender is not None  # connect() made it
        self.served_version = version
        return self.sender.push(version, urls)

    def rejoin(self, url: str) -> dict[str, float]:
        """``WeightSender.rejoin`` (rank 0 only)."""
        assert self.sender is not None  # connect() made it
        return self.sender.rejoin(url)

    def pid(self) -> int:
        return os.getpid()

    def save_hf(self, out_dir: str) -> str:
        """The policy as an HF checkpoint (a LoRA policy merged into its base). Collective."""
        return str(lora.save_hf(self.model, self.tokenizer, out_dir))

    # -- checkpoints ---------------------------------------------------------------------------

    def _stateful(self) -> dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]:
        parts: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]] = {
            "policy": (self.model, self.opt)
        }
        if self.critic is not None:
            parts["critic"] = (self.critic, self.critic_opt)
        return parts

    def save_state(self, out_dir: str) -> str:
        """The HF export in ``out_dir`` and everything training needs to continue exactly in
        ``out_dir/trainer``: policy and critic weights and optimizer moments (sharded, DCP), LR
        schedules, the adaptive-KL coefficient, running baselines, the RNG (collective)."""
        self.save_hf(out_dir)
        extra = {
            "sched": self.sched.state_dict(),
            "critic_sched": self.critic_sched.state_dict() if self.critic is not None else None,
            **self.adv.state_dict(),  # kl_ctl, baseline_state, prompt_ids
            "torch_rng": torch.get_rng_state(),
        }
        fsdp.save_training_state(Path(out_dir) / "trainer", self._stateful(), extra)
        return str(Path(out_dir))

    def load_state(self, ckpt_dir: str) -> None:
        """Continue from what ``save_state`` wrote (collective)."""
        extra = fsdp.load_training_state(Path(ckpt_dir) / "trainer", self._stateful())
        self.served_version = None  # until these weights are pushed
        self.sched.load_state_dict(extra["sched"])
        if self.critic is not None and extra["critic_sched"] is not None:
            self.critic_sched.load_state_dict(extra["critic_sched"])
        self.adv.load_state_dict(extra)
        torch.set_rng_state(extra["torch_rng"])

    def release(self) -> None:
        """Delete what this rank keeps outside its process: the weight sync's bucket files."""
        if self.sender is not None:
            self.sender.close()

    def shutdown(self) -> None:
        self.release()
        if dist.is_initialized():
            dist.destroy_process_group()


def engine_logprobs_are_old(
    cfg: TridentConfig, samples: list[Sample], served_version: int | None
) -> bool:
    """``algo.old_logprobs``: whether the engine's sampled-token logprobs stand for pi_old in a
    step on ``samples``, the trainer holding ``served_version`` (None: weights not pushed as
    they are). ``auto``: where they are pi_old up to the verified sync's numerical gap: every
    loss token sampled by the weights the trainer holds, float32 on both sides, no top-p
    truncation (the trainer scores the whole distribution). The samples are the same on every
    rank, so is the answer."""
    if cfg.algo.old_logprobs != "auto":
        return cfg.algo.old_logprobs == "engine"
    exact = cfg.sync.verify and cfg.model.dtype == "float32" and cfg.rollout.top_p == 1.0
    return (
        exact
        and served_version is not None
        and all(
            v == served_version
            for s in samples
            for v, m in zip(s.versions, s.loss_mask, strict=True)
            if m
        )
    )


def _mismatch(
    trainer: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor, world: int
) -> dict[str, float]:
    """``correction.mismatch_metrics`` over every rank's rows (collective when ``world`` > 1):
    token means weighted by each rank's tokens, the maximum of the maxima."""
    m = alg.mismatch_metrics(trainer, engine, mask)
    top = m.pop("mismatch_abs_logp_diff_max").double().reshape(1)
    keys = sorted(m)
    tokens = float((mask > 0).sum())
    sums = torch.tensor([float(m[k]) * tokens for k in keys] + [tokens], dtype=torch.float64)
    if world > 1:
        sums, top = sums.to(trainer.device), top.to(trainer.device)
        dist.all_reduce(sums)
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
    n = max(float(sums[-1]), 1.0)
    out = {k: float(v) / n for k, v in zip(keys, sums[:-1].tolist(), strict=True)}
    return out | {"mismatch_abs_logp_diff_max": float(top)}


def _per_sample(
    mine: list[int],
    full_mask: torch.Tensor,
    adv_all: torch.Tensor,
    m: torch.Tensor,
    engine_logp: torch.Tensor,
    old: torch.Tensor,
    world: int,
) -> list[list[float]]:
    """[mean advantage, mean |engine logp - trainer logp|] per sample over its loss tokens;
    each rank fills its own rows of the mismatch and one all_reduce sums them."""
    tokens = full_mask.sum(1).clamp(min=1)
    advantage = (adv_all * full_mask).sum(1) / tokens
    gap = torch.zeros(len(full_mask), device=old.device)
    rows = torch.tensor(mine, device=old.device, dtype=torch.long)
    # old: NaN at the loss tokens of rows not measured (algo.old_logprobs), which stay NaN
    diff = torch.where(m > 0, (old - engine_logp).abs(), 0.0)
    gap[rows] = diff.sum(1) / m.sum(1).clamp(min=1)
    if world > 1:
        dist.all_reduce(gap)
    return torch.stack([advantage.float().cpu(), gap.float().cpu()], 1).tolist()


def _loss_spec(cfg: TridentConfig, kl_coef: float) -> LossSpec:
    """The step's settings of :func:`~trident.algorithms.rl_loss.rl_loss`."""
    a = cfg.algo
    return LossSpec(
        policy_loss=a.policy_loss,
        clip_eps_low=a.clip_eps_low,
        clip_eps_high=a.clip_eps_high,
        dual_clip_c=a.dual_clip_c,
        aggregation=a.aggregation,
        norm_tokens=cfg.response_budget,  # Dr. GRPO's L: the run's response budget, every term
        is_level=a.is_level,
        is_mode=a.is_mode,
        is_cap=a.is_cap,
        is_lower=a.is_lower,
        entropy_coef=a.entropy_coef,
        kl_coef=kl_coef,
        kl_estimator=a.kl_estimator,
        value_clip=a.value_clip,
    )


def _memory(opt: torch.optim.Optimizer, device: torch.device, release: bool) -> dict[str, float]:
    """Rank 0's memory: its peak so far (resident set on CPU, allocated on a GPU) and its
    optimizer state (its shards; LoRA: the adapters' only), in GiB. ``release``: the engine on
    this GPU wakes next (``rollout.sleep_level``), so the allocator's cached blocks go back."""
    state = sum(
        (getattr(t, "to_local", lambda t=t: t)()).nbytes
        for per_param in opt.state.values()
        for t in per_param.values()
        if isinstance(t, torch.Tensor)
    )
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        if release:
            torch.cuda.empty_cache()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10  # KiB on Linux
    return {"memory/rank_peak_gib": peak / 2**30, "memory/optimizer_state_gib": state / 2**30}


def _reduce_metrics(
    sums: dict[str, float], lr: float, world: int, device: torch.device
) -> dict[str, float]:
    """The step's metrics from every rank's sums (collective): the losses per optimizer step,
    the gradient norms as they are (the same on every rank), maxima as maxima, and the rest as
    token means."""
    keys = sorted(sums)
    t = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=device)
    maxima = [k for k in keys if k.endswith("_max")]
    dist.all_reduce(t)
    maximum_values: list[float] = []
    if maxima:
        mx = torch.tensor([sums[k] for k in maxima], dtype=torch.float64, device=device)
        dist.all_reduce(mx, op=dist.ReduceOp.MAX)
        maximum_values = mx.tolist()
    total = dict(zip(keys, t.tolist(), strict=True))
    tokens = total.pop("tokens", 0.0) or math.nan  # no token trained (all skipped): no means
    steps = total.pop("optimizer_steps") / world
    out: dict[str, float] = {"lr": lr}
    for key in ("loss", "value_loss"):  # each rank's share of the batch loss: sum, per step
        if key in total:
            out[key] = total.pop(key) / steps
    for key in ("grad_norm", "critic_grad_norm"):  # the same global norm on every rank
        if key in total:
            out[key] = total.pop(key) / (steps * world)
    for k, v in total.items():
        out[k] = v / tokens
    out.update(zip(maxima, maximum_values, strict=True))
    return out


def _check_same_vocabulary(tokenizer, student_path: str, teacher_path: str) -> None:
    """Distillation compares logprobs of the same token ids: the vocabularies must be equal."""
    teacher_vocab = load_tokenizer(teacher_path).get_vocab()
    if teacher_vocab != tokenizer.get_vocab():
        raise ValueError(
            f"teacher {teacher_path} has a different tokenizer vocabulary than the student "
            f"{student_path}: on-policy distillation scores the student's token ids with the "
            "teacher, so both must share one tokenizer"
        )
