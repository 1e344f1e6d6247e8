"""The FSDP2 policy trainer: one ``PolicyWorker`` per rank, each hosted by a Ray actor.

A training step, given the step's scored Samples (the same list on every rank):

1. each rank takes its shard (every world-th sample of each mini-batch; ``samples[rank::world]``
   when ``trainer.mini_batches`` is 1) and recomputes, with no gradient, the
   per-token quantities of the models it holds: the logprobs of the policy that is about to be
   updated (the PPO "old" policy; in sync mode it is the sampler's weights, so the
   engine-vs-trainer gap measured here is pure numerical mismatch), of the frozen reference
   (``algo.kl_coef`` > 0), of each sample's teacher (``algo.distill_coef`` > 0) and the critic's
   values (``algo.use_critic``);
2. the quantities the advantage needs are assembled into [B, T] grids of the whole batch (every
   rank fills its rows of a zero grid, one ``all_reduce`` sums them), and every rank computes the
   same advantages over the whole batch (``algorithms.compute_advantages``). So group statistics
   see whole groups, GAE's whitening and REINFORCE++'s batch normalisation use global statistics,
   and N ranks compute exactly what one rank would. The grids are [B, T] floats: a few MB even at
   a 512 x 8k batch, far below a forward pass;
3. ``trainer.mini_batches`` optimizer steps, each accumulating micro-batches of at most
   ``trainer.micro_batch_tokens`` tokens. Losses use global token/sequence counts, so 4x2 equals
   8x1 and N ranks equal one. Every rank runs the same number of micro-batches (a rank with
   fewer splits its largest ones, or runs a zero-weight one), since each FSDP2 forward and
   backward is a collective;
4. importance weights correct the engine/trainer mismatch (TIS/MIS, ``algo.is_*``).

What the advantage of a token is made of (``algo.*``):

- **Reward estimator** (``advantage``, weighted by ``reward_coef``): see
  :mod:`trident.algorithms.advantages`. With ``running_baseline`` the per-prompt EMA baselines
  live on the worker across steps, keyed by the prompt's text, identical on every rank.
- **PPO with a learned critic** (``use_critic``, ``advantage=gae``; Schulman et al. 2017, GAE from
  Schulman et al. 2016): a separate value model (:mod:`trident.train.critic`) gives V(s_t) for
  every response token; delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1},
  whitened over the batch's tokens (``norm_std``), and the critic regresses on R_t = A_t + V_t
  (before whitening) with PPO's clipped value loss
  0.5 max((V - R)^2, (V_old + clip(V - V_old, +-value_clip) - R)^2), token-mean, in the same
  mini-batches as the policy, with its own AdamW (``trainer.critic_lr``). Metrics:
  ``value_loss``, ``value_mean`` (V_old over response tokens), ``explained_variance``
  = 1 - Var(R - V_old) / Var(R) (verl's ``vf_explained_var``).
- **KL in the reward** (``kl_in_reward``; Ziegler et al. 2019, "Fine-Tuning Language Models from
  Human Preferences"; REINFORCE++, Hu 2025): the token reward is
  r_t = R * 1[t = last] - beta * KL_t with KL_t = ``kl_estimate(log pi_old, log pi_ref)`` (k1 =
  log pi_old - log pi_ref for the ``reinforce_pp`` preset), so the penalty flows through the
  estimator (return-to-go, GAE, or the group statistics of the sequence sums) and the loss has no
  KL term. Without it, beta * KL (of the policy being updated) is added to the loss, GRPO style.
- **Adaptive KL** (``kl_target``; Ziegler et al. 2019): beta starts at ``kl_coef`` and after each
  step becomes beta (1 + clip(KL / target - 1, -0.2, 0.2) B / horizon), with KL the mean over the
  batch's B samples of the summed per-token KL of the sampling policy to the reference (Ziegler's
  per-sample KL; TRL's PPO measures the same). Metric ``kl_coef`` is the beta of the step.
- **On-policy distillation** (``distill_coef``, ``model.teacher_paths``; Agarwal et al. 2024,
  "On-Policy Distillation of Language Models" (GKD) with student samples and reverse KL;
  Thinking Machines, "On-Policy Distillation", 2025): the student samples, the frozen teacher of
  the sample's task (``row["task"]``, else ``data.task``; ``default`` when the task has none)
  scores the sampled tokens, and the token's advantage gets
  ``- distill_coef * (log pi_old(y_t) - log pi_teacher(y_t))``, the negative per-token reverse
  KL (k1), with discount zero (a token is credited with its own log-ratio only, as Thinking
  Machines do). Why an advantage and not a ``k1`` loss term: the samples are drawn from the
  student, so the gradient of KL(pi || pi_T) = E_{y ~ pi}[log pi(y) - log pi_T(y)] is the
  score-function term E[grad log pi(y) (log pi(y) - log pi_T(y))]; a loss term
  mean_t(log pi(y_t) - log pi_T(y_t)) differentiated through log pi only has gradient
  E[grad log pi] = 0 in expectation, i.e. no teacher signal at all. As an advantage the
  distillation signal also goes through the same PPO clip and importance correction as the
  reward, so it stays valid off-policy (async modes). ``reward_coef=0`` (the ``opd`` preset) is
  pure distillation. Metric ``distill_kl`` (the mean per-token k1 reverse KL), and
  ``distill_kl/<key>`` per ``model.teacher_paths`` key when there are several teachers.

Logits are divided by the sampling temperature, so the trainer's policy is the distribution the
engine sampled from (the server reports processed logprobs); the reference and teachers are
scored at the same temperature, so every KL compares the same kind of distribution.
``top_p`` < 1 is not modelled. The reference and teacher models are frozen and replicated on
every rank (not sharded).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from trident import algorithms as alg
from trident.config import TridentConfig
from trident.models.load import load_causal_lm, load_tokenizer
from trident.sample import Sample
from trident.train import fsdp
from trident.train.batch import Batch, collate, micro_batches
from trident.train.critic import ValueModel, token_values
from trident.weights.tensors import full_tensor

if TYPE_CHECKING:
    from trident.weights.sync import Backend, WeightSync


def token_logprobs(
    model: torch.nn.Module, batch: Batch, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token logprobs [B, T-1] of ``batch.input_ids[:, 1:]`` (and entropies if asked)."""
    logits = (
        model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float()
    )
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    if not with_entropy:
        return logp, None
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


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
            torch.use_deterministic_algorithms(True)
        self.cfg, self.rank, self.world = cfg, rank, world_size
        a, tc = cfg.algo, cfg.trainer
        self.device = fsdp.device()
        self.tokenizer = load_tokenizer(cfg.model.path)
        dtype = cfg.model.dtype
        model = load_causal_lm(cfg.model.path, fsdp.master_dtype(dtype), self.device)
        self.model = fsdp.shard(model, dtype)
        self.tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        self.ref = self._frozen(cfg.model.ref_path or cfg.model.path) if a.kl_coef > 0 else None
        self.kl_ctl = (
            alg.AdaptiveKLController(a.kl_coef, a.kl_target, a.kl_horizon)
            if a.kl_target is not None
            else None
        )
        self.opt, self.sched = self._optimizer(self.model, tc.lr)
        self.critic = None
        if a.use_critic:
            critic = ValueModel(cfg.model.critic_path or cfg.model.path, fsdp.master_dtype(dtype))
            self.critic = fsdp.shard(critic.to(self.device), dtype)
            self.critic_opt, self.critic_sched = self._optimizer(self.critic, tc.critic_lr)
        # teachers by path (two tasks may share one); routing: teacher_paths key -> path
        self.teachers: dict[str, torch.nn.Module] = {}
        if a.distill_coef > 0:
            for path in sorted(set(cfg.model.teacher_paths.values())):
                _check_same_vocabulary(self.tokenizer, cfg.model.path, path)
                self.teachers[path] = self._frozen(path)
        self.baseline_state = (
            alg.new_baseline_state(a.baseline_decay) if a.advantage == "running_baseline" else None
        )
        self._prompt_ids: dict[str, int] = {}  # prompt key -> stable int id (running_baseline)
        self.sync: WeightSync | None = None
        self.server_urls: list[str] = []  # every server, as connect() was told (all ranks)
        self.backend: Backend = "shm"
        self.probe: list[int] = []
        self.served_probe: list[float] | None = None  # the probe's logprobs, last pushed version

    def _frozen(self, path: str) -> torch.nn.Module:
        model = load_causal_lm(path, self.cfg.model.dtype, self.device).eval()
        model.requires_grad_(False)
        return model

    def _optimizer(self, model: torch.nn.Module, lr: float):
        tc = self.cfg.trainer
        opt = torch.optim.AdamW(
            model.parameters(), lr=lr, betas=tc.betas, weight_decay=tc.weight_decay
        )
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt,
            lambda s: fsdp.cosine_lr(s, self.cfg.pipeline.steps, tc.warmup_steps, tc.lr_schedule),
        )
        return opt, sched

    @property
    def kl_coef(self) -> float:
        """beta of the KL to the reference: fixed, or the adaptive controller's current value."""
        return self.kl_ctl.value if self.kl_ctl is not None else self.cfg.algo.kl_coef

    # -- routing -------------------------------------------------------------------------------

    def teacher_key(self, sample: Sample) -> str:
        """The ``model.teacher_paths`` key of the sample's teacher: its task, else ``default``."""
        paths = self.cfg.model.teacher_paths
        row = sample.metadata.get("row") or {}
        task = row.get("task") or self.cfg.data.task
        if task in paths:
            return task
        if "default" in paths:
            return "default"
        raise ValueError(
            f"sample {sample.id} is from task {task!r}, which has no teacher: "
            f"model.teacher_paths has {sorted(paths)}; add {task!r} or 'default'"
        )

    def _prompt_key(self, sample: Sample) -> str:
        row = sample.metadata.get("row")
        if isinstance(row, dict) and "prompt" in row:
            return json.dumps(row["prompt"], sort_keys=True)
        return sample.group_id

    def group_ids(self, samples: list[Sample]) -> torch.Tensor:
        """Group index per sample: the step's groups, or (running_baseline) stable prompt ids."""
        if self.baseline_state is None:
            index: dict[str, int] = {}
            return torch.tensor([index.setdefault(s.group_id, len(index)) for s in samples])
        ids = self._prompt_ids
        return torch.tensor([ids.setdefault(self._prompt_key(s), len(ids)) for s in samples])

    # -- training ------------------------------------------------------------------------------

    def advantages(
        self, samples: list[Sample], full: Batch, grids: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
        """(advantages [B, T], critic returns [B, T] or None, metrics) for the whole batch.

        ``grids`` holds the per-token quantities of the whole batch that the configuration
        needs (``old``, ``ref``, ``values``, ``teacher``: [B, T] on CPU); see the module
        docstring for the formulas.
        """
        a = self.cfg.algo
        mask = full.mask
        tokens = mask.sum().clamp(min=1.0)
        # an infra_error kept in the loss (reward.exclude_infra_errors=false) scores 0
        rewards = torch.tensor(
            [s.reward if s.reward is not None else 0.0 for s in samples], dtype=torch.float32
        )
        metrics: dict[str, float] = {}
        token_rewards: torch.Tensor = rewards
        if "ref" in grids:  # the KL of the sampling policy to the reference, per token
            kl = alg.kl_estimate(grids["old"], grids["ref"], a.kl_estimator) * mask
            metrics["kl_seq"] = float(kl.sum(-1).mean())
            if a.kl_in_reward:
                metrics["kl_ref"] = float(kl.sum() / tokens)
                token_rewards = alg.kl_penalty_in_reward(rewards, kl, mask, self.kl_coef)
        if self.kl_ctl is not None or a.kl_in_reward:
            metrics["kl_coef"] = self.kl_coef
        returns = None
        adv = torch.zeros_like(mask)
        if a.use_critic:
            values = grids["values"]
            raw, returns = alg.gae_advantages_and_returns(
                token_rewards, values, mask, gamma=a.gamma, lam=a.lam
            )
            if a.reward_coef > 0:
                adv = alg.masked_whiten(raw, mask) if a.norm_std else raw
            metrics["value_mean"] = float(alg.masked_mean(values, mask))
            metrics["return_mean"] = float(alg.masked_mean(returns, mask))
            metrics["explained_variance"] = _explained_variance(returns, values, mask)
        elif a.reward_coef > 0:
            adv = alg.compute_advantages(
                a.advantage,
                token_rewards,
                self.group_ids(samples),
                mask,
                norm_std=a.norm_std,
                gamma=a.gamma,
                lam=a.lam,
                baseline_state=self.baseline_state,
            )
        adv = adv * a.reward_coef
        if self.teachers:
            reverse_kl = (grids["old"] - grids["teacher"]) * mask  # k1 of KL(student || teacher)
            adv = adv - a.distill_coef * reverse_kl
            metrics["distill_kl"] = float(reverse_kl.sum() / tokens)
            keys = [self.teacher_key(s) for s in samples]
            if len(set(self.cfg.model.teacher_paths)) > 1:
                for key in sorted(set(keys)):
                    rows = [i for i, k in enumerate(keys) if k == key]
                    n = mask[rows].sum().clamp(min=1.0)
                    metrics[f"distill_kl/{key}"] = float(reverse_kl[rows].sum() / n)
        return adv, returns, metrics

    def train_step(self, samples: list[Sample]) -> dict[str, Any]:
        """One RL step on ``samples`` (identical on every rank); returns rank-0-reduced metrics
        and, under ``per_sample``, each sample's [mean advantage, mean engine-vs-trainer
        |Δlogp|] over its loss tokens (for the lineage)."""
        a = self.cfg.algo
        t0 = time.perf_counter()
        pad = self.tokenizer.pad_token_id
        full = collate(samples, pad)
        mine, chunks = self._shard(len(samples))
        batch = collate([samples[i] for i in mine], pad).to(self.device)
        # With only the policy's own logprobs to recompute, the first mini-batch's come from its
        # own forward pass, taken before any optimizer step: one forward fewer for those rows.
        fused = self.ref is None and self.critic is None and not self.teachers
        t_recompute = time.perf_counter()
        local = self._recompute(batch, [samples[i] for i in mine], skip=chunks[0] if fused else [])
        t1 = time.perf_counter()
        grids = self._gather(local, mine, full.mask.shape)
        adv_all, returns_all, step_metrics = self.advantages(samples, full, grids)
        width = batch.mask.shape[1]
        adv = adv_all[mine][:, :width].to(self.device)
        returns = None if returns_all is None else returns_all[mine][:, :width].to(self.device)
        engine_mask = batch.mask.clone()  # the per-sample mismatch covers every generated token
        if a.mask_truncated:  # DAPO: truncated samples count in group statistics only
            truncated = torch.tensor(
                [samples[i].status == "truncated" for i in mine], device=self.device
            )
            batch.mask[truncated] = 0.0
        sums: dict[str, float] = defaultdict(float)
        t2 = time.perf_counter()
        for k, chunk in enumerate(chunks):
            self._optimizer_step(batch, chunk, adv, local, returns, sums, fill_old=fused and k == 0)
        t3 = time.perf_counter()
        per_sample = self._per_sample(
            samples, mine, full.mask, adv_all, engine_mask, batch.engine_logp, local["old"]
        )
        self.sched.step()
        if self.critic is not None:
            self.critic_sched.step()
        kl_seq = step_metrics.pop("kl_seq", None)
        if self.kl_ctl is not None and kl_seq is not None:
            self.kl_ctl.update(kl_seq, len(samples))
        timing = {  # rank 0's; the caller's time/train_s less these is the batch's transfer
            "time/recompute_s": t1 - t_recompute,
            "time/optimize_s": t3 - t2,
            "time/rank_s": time.perf_counter() - t0,
        }
        return self._reduce_metrics(sums) | step_metrics | timing | {"per_sample": per_sample}

    def _per_sample(
        self,
        samples: list[Sample],
        mine: list[int],
        full_mask: torch.Tensor,
        adv_all: torch.Tensor,
        m: torch.Tensor,
        engine_logp: torch.Tensor,
        old: torch.Tensor,
    ) -> list[list[float]]:
        """[mean advantage, mean |engine logp - trainer logp|] per sample over its loss tokens;
        each rank fills its own rows of the mismatch and one all_reduce sums them."""
        tokens = full_mask.sum(1).clamp(min=1)
        advantage = (adv_all * full_mask).sum(1) / tokens
        gap = torch.zeros(len(samples), device=self.device)
        rows = torch.tensor(mine, device=self.device, dtype=torch.long)
        gap[rows] = ((old - engine_logp).abs() * m).sum(1) / m.sum(1).clamp(min=1)
        if self.world > 1:
            dist.all_reduce(gap)
        return torch.stack([advantage.float().cpu(), gap.float().cpu()], 1).tolist()

    def _shard(self, n: int) -> tuple[list[int], list[list[int]]]:
        """This rank's samples and its rows of each mini-batch. Mini-batch k is samples[k::M]
        whatever the world size, and each rank takes every world-th sample of it, so N ranks
        train on the same mini-batches as one (with M = 1 the shard is samples[rank::world])."""
        mine: list[int] = []
        chunks: list[list[int]] = []
        for k in range(self.cfg.trainer.mini_batches):
            part = list(range(k, n, self.cfg.trainer.mini_batches))[self.rank :: self.world]
            chunks.append(list(range(len(mine), len(mine) + len(part))))
            mine += part
        return mine, chunks

    def _micro_batches(self, lengths: list[int]) -> list[list[int] | None]:
        """``micro_batches`` by token budget, made equally many on every rank: each FSDP2
        forward/backward is a collective. A rank with fewer splits its largest micro-batches,
        then pads with ``None`` (a zero-weight pass)."""
        groups = micro_batches(lengths, self.cfg.trainer.micro_batch_tokens)
        if self.world == 1:
            return list(groups)
        count = torch.tensor([len(groups)], device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        out: list[list[int] | None] = list(groups)
        while len(out) < int(count) and any(g is not None and len(g) > 1 for g in out):
            largest = max(range(len(out)), key=lambda i: len(out[i] or []))
            g = out.pop(largest)
            assert g is not None  # the largest has more than one sample
            out += [g[: len(g) // 2], g[len(g) // 2 :]]
        return out + [None] * (int(count) - len(out))

    @torch.no_grad()
    def _recompute(
        self, batch: Batch, samples: list[Sample], skip: list[int] | None = None
    ) -> dict[str, torch.Tensor]:
        """Per-token quantities of this rank's rows [b, T] with no gradient: ``old`` (policy
        logprobs), ``ref``, ``values`` (critic), ``teacher`` (each row's own teacher). Rows in
        ``skip`` are left at zero (their ``old`` is filled by the first optimizer step)."""
        temperature = self.cfg.rollout.temperature or 1.0
        lengths = batch.attention_mask.sum(1).tolist()
        todo = sorted(set(range(len(lengths))) - set(skip or []))
        parts: dict[str, list] = defaultdict(list)
        for part in self._micro_batches([lengths[i] for i in todo]):
            idx = None if part is None else [todo[i] for i in part]
            mb = _select(batch, idx if idx is not None else [0])
            old = token_logprobs(self.model, mb, temperature)[0]
            values = token_values(self.critic, mb) if self.critic is not None else None
            if idx is None:
                continue  # a zero-weight pass: only keeps the FSDP collectives in step
            parts["old"].append((idx, old))
            if values is not None:
                parts["values"].append((idx, values))
            if self.ref is not None:
                parts["ref"].append((idx, token_logprobs(self.ref, mb, temperature)[0]))
        if self.teachers:  # frozen, unsharded: each rank runs only its own rows
            paths = [self.cfg.model.teacher_paths[self.teacher_key(s)] for s in samples]
            for path, teacher in self.teachers.items():
                rows = [i for i, p in enumerate(paths) if p == path]
                for local in micro_batches(
                    [lengths[i] for i in rows], self.cfg.trainer.micro_batch_tokens
                ):
                    idx = [rows[i] for i in local]
                    logp = token_logprobs(teacher, _select(batch, idx), temperature)[0]
                    parts["teacher"].append((idx, logp))
        names = ["old"] + [
            name
            for name, used in (
                ("ref", self.ref is not None),
                ("values", self.critic is not None),
                ("teacher", bool(self.teachers)),
            )
            if used
        ]
        return {name: _scatter(parts[name], batch.mask) for name in names}

    def _gather(
        self, local: dict[str, torch.Tensor], mine: list[int], shape: torch.Size
    ) -> dict[str, torch.Tensor]:
        """The whole batch's [B, T] grids (on CPU) of the quantities the advantage needs: each
        rank fills its rows of a zero grid and one all_reduce sums them."""
        a = self.cfg.algo
        names = [n for n in ("ref", "values", "teacher") if n in local]
        if not a.kl_in_reward and self.kl_ctl is None:
            names = [n for n in names if n != "ref"]
        if not names:
            return {}
        names = ["old", *names]
        grid = torch.zeros((len(names), *shape), dtype=torch.float32, device=self.device)
        rows = torch.tensor(mine, device=self.device)
        for k, name in enumerate(names):
            values = local[name]
            grid[k, rows, : values.shape[1]] = values.float()
        if self.world > 1:
            dist.all_reduce(grid)
        return {name: grid[k].cpu() for k, name in enumerate(names)}

    def _optimizer_step(
        self,
        batch: Batch,
        rows: list[int],
        adv: torch.Tensor,
        local: dict[str, torch.Tensor],
        returns: torch.Tensor | None,
        sums: dict[str, float],
        fill_old: bool = False,
    ) -> None:
        """One optimizer step on ``rows``; ``fill_old``: their ``local["old"]`` is not computed
        yet, and is this (pre-step) policy's logprobs from these forward passes."""
        a, tc = self.cfg.algo, self.cfg.trainer
        temperature = self.cfg.rollout.temperature or 1.0
        old_logp = local["old"]
        ref_logp = None if a.kl_in_reward else local.get("ref")  # set: a KL term in the loss
        tokens, seqs = alg.loss_denominators(batch.mask[rows])
        counts = torch.tensor([tokens, seqs], dtype=torch.float64, device=self.device)
        dist.all_reduce(counts)  # global denominators: N ranks equal one
        g_tokens, g_seqs = int(counts[0]), int(counts[1])
        agg = dict(global_tokens=g_tokens, global_seqs=g_seqs)
        norm_tokens = self.cfg.rollout.max_tokens  # Dr. GRPO's L, the same for every loss term
        lengths = batch.attention_mask[rows].sum(1).tolist()
        for local_idx in self._micro_batches(lengths):
            dummy = local_idx is None  # zero-weight pass that keeps the FSDP collectives in step
            idx = [0] if dummy else [rows[i] for i in local_idx]
            mb = _select(batch, idx)
            logp, entropy = token_logprobs(self.model, mb, temperature, with_entropy=True)
            assert entropy is not None  # asked for with_entropy
            mask, w = mb.mask * (0.0 if dummy else 1.0), mb.mask.shape[1]
            if fill_old and not dummy:
                old_logp[idx, :w] = logp.detach()
            old, advantages = old_logp[idx, :w], adv[idx, :w]
            is_w, mis = None, {}
            if a.is_level != "none":
                is_w, mis = alg.importance_weights(
                    old,
                    mb.engine_logp,
                    mask,
                    level=a.is_level,
                    mode=a.is_mode,
                    cap=a.is_cap,
                    lower=a.is_lower,
                )
            loss, m = alg.policy_loss(
                a.policy_loss, logp, old, advantages, mask,
                clip_eps_low=a.clip_eps_low, clip_eps_high=a.clip_eps_high, dual_clip_c=a.dual_clip_c,
                is_weights=is_w, aggregation=a.aggregation, loss_scale_tokens=norm_tokens, **agg,
            )  # fmt: skip
            if a.entropy_coef > 0:
                bonus = alg.entropy_bonus(
                    entropy, mask, a.aggregation, norm_tokens=norm_tokens, **agg
                )
                loss = loss - a.entropy_coef * bonus
            if ref_logp is not None:
                kl = alg.kl_estimate(logp, ref_logp[idx, :w], a.kl_estimator)
                kl_term = alg.aggregate(kl, mask, a.aggregation, norm_tokens=norm_tokens, **agg)
                loss = loss + self.kl_coef * kl_term
                sums["kl_ref"] += float((kl.detach() * mask).sum())
            (loss * self.world).backward()  # FSDP averages gradients over ranks; losses are sums
            if self.critic is not None:
                assert returns is not None  # the critic's targets come with it
                values = token_values(self.critic, mb)
                vloss, vm = alg.value_loss(
                    values,
                    local["values"][idx, :w],
                    returns[idx, :w],
                    mask,
                    clip=a.value_clip,
                    global_tokens=g_tokens,
                )
                (vloss * self.world).backward()
                sums["value_loss"] += float(vloss.detach())
                sums["value_clip_fraction"] += float(vm["value_clip_fraction"]) * float(mask.sum())
            if dummy:
                continue
            n = float(mask.sum())
            sums["tokens"] += n
            sums["loss"] += float(loss.detach())
            sums["entropy"] += float((entropy.detach() * mask).sum())
            for key in ("clip_fraction", "ratio_mean", "approx_kl"):
                sums[key] += float(m[key]) * n
            for key, value in mis.items():
                sums[key] = (
                    max(sums[key], float(value))
                    if key.endswith("_max")
                    else sums[key] + float(value) * n
                )
        sums["grad_norm"] += _clip_and_step(self.model, self.opt, tc.grad_clip)
        if self.critic is not None:
            sums["critic_grad_norm"] += _clip_and_step(self.critic, self.critic_opt, tc.grad_clip)
        sums["optimizer_steps"] += 1

    def _reduce_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        keys = sorted(sums)
        t = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=self.device)
        maxima = [k for k in keys if k.endswith("_max")]
        dist.all_reduce(t)
        maximum_values: list[float] = []
        if maxima:
            mx = torch.tensor([sums[k] for k in maxima], dtype=torch.float64, device=self.device)
            dist.all_reduce(mx, op=dist.ReduceOp.MAX)
            maximum_values = mx.tolist()
        total = dict(zip(keys, t.tolist(), strict=True))
        tokens = max(total.pop("tokens", 0.0), 1.0)
        steps = total.pop("optimizer_steps") / self.world
        out: dict[str, float] = {"lr": float(self.sched.get_last_lr()[0])}
        for key in ("loss", "value_loss"):  # each rank's share of the batch loss: sum, per step
            if key in total:
                out[key] = total.pop(key) / steps
        for key in ("grad_norm", "critic_grad_norm"):  # the same global norm on every rank
            if key in total:
                out[key] = total.pop(key) / (steps * self.world)
        for k, v in total.items():
            out[k] = v / tokens
        out.update(zip(maxima, maximum_values, strict=True))
        return out

    # -- weight sync ---------------------------------------------------------------------------

    def connect(
        self, urls: list[str], backend: Backend, nodes: Mapping[str, str] | None = None
    ) -> None:
        """Called once, after the rollout servers are up. ``nodes``: the Ray node of each
        server trident started; a server on another host than rank 0 fetches the shm backend's
        buckets over HTTP (``WeightSync(remote=...)``)."""
        import ray

        from trident.cluster.net import node_ip
        from trident.weights.sync import WeightSync, make_probe, same_host

        sc = self.cfg.sync
        self.probe = make_probe(self.tokenizer, sc.probe_tokens, seed=self.cfg.run.seed)
        self.server_urls, self.backend = list(urls), backend
        if self.rank == 0:
            node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
            ip = node_ip()
            remote = [u for u in urls if not same_host(u, (nodes or {}).get(u), node, ip)]
            self.sync = WeightSync(
                urls,
                backend=backend,
                bucket_bytes=sc.bucket_bytes,
                delta=sc.delta and backend == "shm",
                full_every=sc.full_every,
                on_base_mismatch=sc.on_base_mismatch,
                # what a restarted server is brought back to (rollout.max_restarts)
                keep_served=self.cfg.rollout.max_restarts > 0 and backend == "shm",
                remote=remote if backend == "shm" else (),
                serve_host=ip,
                nccl_master_address=ip,  # the engines join rank 0's group from their hosts
            )
            self.sync.init()

    def sync_weights(self, version: int, urls: list[str] | None = None) -> dict[str, float]:
        """Push the current weights as ``version`` to ``urls`` (default: every server) and
        verify them (collective on all ranks).

        The weights stream from the FSDP2 shards: every rank iterates the same sharded state
        dict, each bucket is all-gathered just before rank 0 sends it (``WeightSync.push``),
        and the other ranks take part in the same gathers (``drain``)."""
        from trident.weights.sync import drain, hf_named_tensors, probe_logprobs

        # the probe is also what a restarted server is checked against (rollout.max_restarts)
        probe = self.cfg.sync.verify or self.cfg.rollout.max_restarts > 0
        expected = probe_logprobs(self.model, self.probe) if probe else None
        shards = hf_named_tensors(self.model, self.tied)
        metrics: dict[str, float] = {}
        if self.rank != 0:
            # the GPU backends send to one server at a time, gathering the stream for each
            targets = len(urls if urls is not None else self.server_urls)
            drain(shards)
            for _ in range(targets - 1 if self.backend != "shm" else 0):
                drain(hf_named_tensors(self.model, self.tied))
        else:
            assert self.sync is not None  # connect() made it on rank 0
            metrics = self.sync.push(shards, version, urls)
            if expected is not None and self.cfg.sync.verify:
                metrics |= self.sync.verify(self.probe, expected, version, self.cfg.sync.tolerance)
            self.served_probe = expected
        dist.barrier()
        return metrics

    def rejoin(self, url: str) -> dict[str, float]:
        """Rank 0 only: bring the restarted server ``url`` to the last pushed version (from
        the kept copy, whatever the trainer has learned since) and verify it with that
        version's probe logprobs (``WeightSync.rejoin``)."""
        assert self.rank == 0 and self.sync is not None
        assert self.served_probe is not None  # computed at every sync when restarts are on
        return self.sync.rejoin(url, self.probe, self.served_probe, self.cfg.sync.tolerance)

    def pid(self) -> int:
        return os.getpid()

    def save_hf(self, out_dir: str) -> str:
        fsdp.save_hf(self.model, self.tokenizer, out_dir)
        return str(Path(out_dir))

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
        fsdp.save_hf(self.model, self.tokenizer, out_dir)
        extra = {
            "sched": self.sched.state_dict(),
            "critic_sched": self.critic_sched.state_dict() if self.critic is not None else None,
            "kl_ctl": dict(vars(self.kl_ctl)) if self.kl_ctl is not None else None,
            "baseline_state": self.baseline_state,
            "prompt_ids": self._prompt_ids,
            "torch_rng": torch.get_rng_state(),
        }
        fsdp.save_training_state(Path(out_dir) / "trainer", self._stateful(), extra)
        return str(Path(out_dir))

    def load_state(self, ckpt_dir: str) -> None:
        """Continue from what ``save_state`` wrote (collective)."""
        extra = fsdp.load_training_state(Path(ckpt_dir) / "trainer", self._stateful())
        self.sched.load_state_dict(extra["sched"])
        if self.critic is not None and extra["critic_sched"] is not None:
            self.critic_sched.load_state_dict(extra["critic_sched"])
        if self.kl_ctl is not None and extra["kl_ctl"] is not None:
            vars(self.kl_ctl).update(extra["kl_ctl"])
        self.baseline_state = extra["baseline_state"]
        self._prompt_ids = extra["prompt_ids"]
        torch.set_rng_state(extra["torch_rng"])

    def release(self) -> None:
        """Delete what this rank keeps outside its process: the weight sync's bucket files."""
        if self.sync is not None:
            self.sync.close()

    def shutdown(self) -> None:
        self.release()
        if dist.is_initialized():
            dist.destroy_process_group()


def _clip_and_step(model: torch.nn.Module, opt: torch.optim.Optimizer, max_norm: float) -> float:
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    grad_norm = full_tensor(grad_norm)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(grad_norm)


def _explained_variance(returns: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over valid tokens; 1 = perfect critic, 0 = no better than a
    constant; NaN-free (0 when the returns do not vary)."""
    var_returns = float(alg.masked_mean((returns - alg.masked_mean(returns, mask)) ** 2, mask))
    residual = returns - values
    var_residual = float(alg.masked_mean((residual - alg.masked_mean(residual, mask)) ** 2, mask))
    if var_returns <= 1e-12 or not math.isfinite(var_residual):
        return 0.0
    return 1.0 - var_residual / var_returns


def _check_same_vocabulary(tokenizer, student_path: str, teacher_path: str) -> None:
    """Distillation compares logprobs of the same token ids: the vocabularies must be equal."""
    teacher_vocab = load_tokenizer(teacher_path).get_vocab()
    if teacher_vocab != tokenizer.get_vocab():
        raise ValueError(
            f"teacher {teacher_path} has a different tokenizer vocabulary than the student "
            f"{student_path}: on-policy distillation scores the student's token ids with the "
            "teacher, so both must share one tokenizer"
        )


def _select(batch: Batch, idx: list[int]) -> Batch:
    width = int(batch.attention_mask[idx].sum(1).max())
    return Batch(
        batch.input_ids[idx, :width],
        batch.attention_mask[idx, :width],
        batch.mask[idx, : width - 1],
        batch.engine_logp[idx, : width - 1],
        batch.versions[idx, : width - 1],
    )


def _scatter(parts: list[tuple[list[int], torch.Tensor]], like: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(like)
    for idx, values in parts:
        out[idx, : values.shape[1]] = values
    return out
