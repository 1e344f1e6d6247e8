"""The FSDP2 policy trainer: one ``PolicyWorker`` per rank, each hosted by a Ray actor.

A training step, given the step's scored Samples (the same list on every rank):

1. advantages for the whole batch (``algorithms.compute_advantages``; groups stay whole);
2. each rank takes its shard (``samples[rank::world]``) and recomputes the logprobs of the policy
   that is about to be updated (the PPO "old" policy; in sync mode it is the sampler's weights,
   so the engine-vs-trainer gap measured here is pure numerical mismatch);
3. ``trainer.mini_batches`` optimizer steps, each accumulating micro-batches of at most
   ``trainer.micro_batch_tokens`` tokens. Losses use global token/sequence counts, so 4x2 equals
   8x1 and N ranks equal one;
4. importance weights correct the engine/trainer mismatch (TIS/MIS, ``algo.is_*``).

Logits are divided by the sampling temperature, so the trainer's policy is the distribution the
engine sampled from (the server reports processed logprobs). ``top_p`` < 1 is not modelled.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trident import algorithms as alg
from trident.config import TridentConfig
from trident.models.load import load_causal_lm, load_tokenizer
from trident.sample import Sample
from trident.train import fsdp
from trident.train.batch import Batch, collate, micro_batches


def token_logprobs(model, batch: Batch, temperature: float = 1.0, with_entropy: bool = False):
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
    """One FSDP2 rank of the policy (and its frozen reference, when the KL needs one)."""

    def __init__(
        self, cfg: TridentConfig, rank: int, world_size: int, master_addr: str, master_port: int
    ) -> None:
        fsdp.init_distributed(rank, world_size, master_addr, master_port)
        fsdp.set_cpu_threads(cfg.trainer.cpu_threads)
        torch.manual_seed(cfg.run.seed)
        self.cfg, self.rank, self.world = cfg, rank, world_size
        self.device = fsdp.device()
        self.tokenizer = load_tokenizer(cfg.model.path)
        self.model = fsdp.shard(load_causal_lm(cfg.model.path, cfg.model.dtype).to(self.device))
        self.tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        self.ref = None
        if cfg.algo.kl_coef > 0:
            self.ref = (
                load_causal_lm(cfg.model.ref_path or cfg.model.path, cfg.model.dtype)
                .to(self.device)
                .eval()
            )
            self.ref.requires_grad_(False)
        tc = cfg.trainer
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=tc.lr, betas=tc.betas, weight_decay=tc.weight_decay
        )
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt,
            lambda s: fsdp.cosine_lr(s, cfg.pipeline.steps, tc.warmup_steps, tc.lr_schedule),
        )
        self.sync = None
        self.probe: list[int] = []

    # -- training ------------------------------------------------------------------------------

    def advantages(self, samples: list[Sample], full: Batch) -> torch.Tensor:
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        group_index: dict[str, int] = {}
        gids = torch.tensor([group_index.setdefault(s.group_id, len(group_index)) for s in samples])
        a = self.cfg.algo
        return alg.compute_advantages(
            a.advantage, rewards, gids, full.mask, norm_std=a.norm_std, gamma=a.gamma, lam=a.lam
        )

    def train_step(self, samples: list[Sample]) -> dict[str, float]:
        """One RL step on ``samples`` (identical on every rank); returns rank-0-reduced metrics."""
        full = collate(samples, self.tokenizer.pad_token_id)
        adv_all = self.advantages(samples, full) * self.cfg.algo.reward_coef
        mine = list(range(self.rank, len(samples), self.world))
        batch = collate([samples[i] for i in mine], self.tokenizer.pad_token_id).to(self.device)
        adv = adv_all[mine][:, : batch.mask.shape[1]].to(self.device)
        if self.cfg.algo.mask_truncated:  # DAPO: truncated samples count in group statistics only
            truncated = torch.tensor(
                [samples[i].status == "truncated" for i in mine], device=self.device
            )
            batch.mask[truncated] = 0.0
        old_logp, ref_logp = self._recompute(batch)
        sums: dict[str, float] = defaultdict(float)
        chunks = [
            list(range(len(mine)))[k :: self.cfg.trainer.mini_batches]
            for k in range(self.cfg.trainer.mini_batches)
        ]
        for chunk in chunks:
            self._optimizer_step(batch, chunk, adv, old_logp, ref_logp, sums)
        self.sched.step()
        return self._reduce_metrics(sums, batch)

    @torch.no_grad()
    def _recompute(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        temperature = self.cfg.rollout.temperature or 1.0
        old, ref = [], []
        for idx in micro_batches(
            batch.attention_mask.sum(1).tolist(), self.cfg.trainer.micro_batch_tokens
        ):
            mb = _select(batch, idx)
            old.append((idx, token_logprobs(self.model, mb, temperature)[0]))
            if self.ref is not None:
                ref.append((idx, token_logprobs(self.ref, mb, temperature)[0]))
        return _scatter(old, batch.mask), (
            _scatter(ref, batch.mask) if self.ref is not None else None
        )

    def _optimizer_step(self, batch, rows, adv, old_logp, ref_logp, sums) -> None:
        a, tc = self.cfg.algo, self.cfg.trainer
        temperature = self.cfg.rollout.temperature or 1.0
        tokens, seqs = alg.loss_denominators(batch.mask[rows])
        counts = torch.tensor([tokens, seqs], dtype=torch.float64, device=self.device)
        dist.all_reduce(counts)  # global denominators: N ranks equal one
        g_tokens, g_seqs = int(counts[0]), int(counts[1])
        lengths = batch.attention_mask[rows].sum(1).tolist()
        for local in micro_batches(lengths, tc.micro_batch_tokens):
            idx = [rows[i] for i in local]
            mb = _select(batch, idx)
            logp, entropy = token_logprobs(self.model, mb, temperature, with_entropy=True)
            mask, w = mb.mask, mb.mask.shape[1]
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
            agg = dict(aggregation=a.aggregation, global_tokens=g_tokens, global_seqs=g_seqs)
            loss, m = alg.policy_loss(
                a.policy_loss, logp, old, advantages, mask,
                clip_eps_low=a.clip_eps_low, clip_eps_high=a.clip_eps_high, dual_clip_c=a.dual_clip_c,
                is_weights=is_w, loss_scale_tokens=self.cfg.rollout.max_tokens, **agg,
            )  # fmt: skip
            if a.entropy_coef > 0:
                loss = loss - a.entropy_coef * alg.entropy_bonus(entropy, mask, **agg)
            if ref_logp is not None:
                kl = alg.kl_estimate(logp, ref_logp[idx, :w], a.kl_estimator)
                loss = loss + a.kl_coef * alg.aggregate(
                    kl, mask, a.aggregation, global_tokens=g_tokens, global_seqs=g_seqs
                )
                sums["kl_ref"] += float((kl * mask).sum())
            (loss * self.world).backward()  # FSDP averages gradients over ranks; losses are sums
            n = float(mask.sum())
            sums["tokens"] += n
            sums["loss"] += float(loss.detach())
            sums["entropy"] += float((entropy * mask).sum())
            for key in ("clip_fraction", "ratio_mean", "approx_kl"):
                sums[key] += float(m[key]) * n
            for key, value in mis.items():
                sums[key] = (
                    max(sums[key], float(value))
                    if key.endswith("_max")
                    else sums[key] + float(value) * n
                )
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), tc.grad_clip)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        sums["grad_norm"] += float(grad_norm)
        sums["optimizer_steps"] += 1
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def _reduce_metrics(self, sums: dict[str, float], batch: Batch) -> dict[str, float]:
        keys = sorted(sums)
        t = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=self.device)
        maxima = [k for k in keys if k.endswith("_max")]
        dist.all_reduce(t)
        if maxima:
            mx = torch.tensor([sums[k] for k in maxima], dtype=torch.float64, device=self.device)
            dist.all_reduce(mx, op=dist.ReduceOp.MAX)
        total = dict(zip(keys, t.tolist(), strict=True))
        tokens = max(total.pop("tokens"), 1.0)
        steps = total.pop("optimizer_steps") / self.world
        out = {
            "loss": total.pop("loss") / steps,
            "grad_norm": total.pop("grad_norm") / (steps * self.world),
            "lr": self.sched.get_last_lr()[0],
        }
        for k, v in total.items():
            out[k] = v / tokens
        for k, v in zip(maxima, mx.tolist() if maxima else [], strict=True):
            out[k] = v
        return out

    # -- weight sync ---------------------------------------------------------------------------

    def connect(self, urls: list[str], backend: str) -> None:
        """Called once, after the rollout servers are up."""
        from trident.weights.sync import WeightSync, make_probe

        self.probe = make_probe(self.tokenizer, self.cfg.sync.probe_tokens, seed=self.cfg.run.seed)
        if self.rank == 0:
            self.sync = WeightSync(urls, backend=backend)
            self.sync.init()

    def sync_weights(self, version: int) -> dict[str, float]:
        """Push the current weights as ``version`` and verify them (collective on all ranks)."""
        from trident.weights.sync import hf_named_tensors, probe_logprobs

        state = fsdp.full_state_dict(self.model)
        expected = probe_logprobs(self.model, self.probe) if self.cfg.sync.verify else None
        metrics: dict[str, float] = {}
        if self.rank == 0:
            metrics = self.sync.push(hf_named_tensors(state, self.tied), version)
            if expected is not None:
                metrics |= self.sync.verify(self.probe, expected, version, self.cfg.sync.tolerance)
        dist.barrier()
        return metrics

    def probe_logprobs(self) -> list[float]:
        from trident.weights.sync import probe_logprobs

        return probe_logprobs(self.model, self.probe)

    def save_hf(self, out_dir: str) -> str:
        fsdp.save_hf(self.model, self.tokenizer, out_dir)
        return str(Path(out_dir))

    def shutdown(self) -> None:
        if self.sync is not None:
            self.sync.close()
        if dist.is_initialized():
            dist.destroy_process_group()


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


def make_worker_actor(resources: dict[str, Any]):
    import ray

    return ray.remote(**resources)(PolicyWorker)
