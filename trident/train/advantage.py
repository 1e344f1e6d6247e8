"""Advantages over the whole batch, and what they keep across steps.

Every rank computes the same advantages over the whole batch from [B, T] grids of the per-token
quantities (``old``, ``ref``, ``values``, ``teacher``; :func:`trident.train.recompute.gather`),
so group statistics see whole groups, GAE's whitening and REINFORCE++'s batch normalisation use
global statistics, and N ranks compute exactly what one rank would.

A token's advantage is ``reward_coef`` times the reward estimator's (the group estimators of
:mod:`trident.algorithms.advantages`, or GAE with the critic's values), with the KL to the
reference in the reward when ``kl_in_reward``, minus ``distill_coef`` times the per-token reverse
KL to the sample's teacher. :class:`Advantages` also holds the state those need across steps,
identical on every rank: the adaptive KL coefficient, the per-prompt running baselines, and the
stable prompt ids they are keyed by. The formulas and why they are built this way:
``docs/algorithms.md``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from trident import algorithms as alg
from trident.config.algo import AlgoConfig
from trident.sample import Sample


class Advantages:
    """Advantage assembly for one configuration, with its state across steps."""

    def __init__(self, algo: AlgoConfig, teacher_paths: Mapping[str, str], task: str) -> None:
        """``teacher_paths``: ``model.teacher_paths``; ``task``: ``data.task``, the task of a
        sample whose row names none."""
        self.algo, self.teacher_paths, self.task = algo, dict(teacher_paths), task
        self.distill = algo.distill_coef > 0 and bool(self.teacher_paths)
        self.kl_ctl = (
            alg.AdaptiveKLController(algo.kl_coef, algo.kl_target, algo.kl_horizon)
            if algo.kl_target is not None
            else None
        )
        self.baseline_state = (
            alg.new_baseline_state(algo.baseline_decay)
            if algo.advantage == "running_baseline"
            else None
        )
        self.prompt_ids: dict[str, int] = {}  # prompt key -> stable int id (running_baseline)

    @property
    def kl_coef(self) -> float:
        """beta of the KL to the reference: fixed, or the adaptive controller's current value."""
        return self.kl_ctl.value if self.kl_ctl is not None else self.algo.kl_coef

    # -- routing -------------------------------------------------------------------------------

    def teacher_key(self, sample: Sample) -> str:
        """The ``model.teacher_paths`` key of the sample's teacher: its task, else ``default``."""
        paths = self.teacher_paths
        row = sample.metadata.get("row") or {}
        task = row.get("task") or self.task
        if task in paths:
            return task
        if "default" in paths:
            return "default"
        raise ValueError(
            f"sample {sample.id} is from task {task!r}, which has no teacher: "
            f"model.teacher_paths has {sorted(paths)}; add {task!r} or 'default'"
        )

    def group_ids(self, samples: list[Sample]) -> torch.Tensor:
        """Group index per sample: the step's groups, or (running_baseline) stable prompt ids."""
        if self.baseline_state is None:
            index: dict[str, int] = {}
            return torch.tensor([index.setdefault(s.group_id, len(index)) for s in samples])
        ids = self.prompt_ids
        return torch.tensor([ids.setdefault(_prompt_key(s), len(ids)) for s in samples])

    def grids(self, available: Iterable[str]) -> list[str]:
        """The grids of the whole batch the advantages need, of the ``available`` ones (none, or
        ``old`` first): the reference only for a KL in the reward or the adaptive coefficient."""
        names = [n for n in ("ref", "values", "teacher") if n in set(available)]
        if not self.algo.kl_in_reward and self.kl_ctl is None:
            names = [n for n in names if n != "ref"]
        return ["old", *names] if names else []

    # -- the step ------------------------------------------------------------------------------

    def compute(
        self, samples: list[Sample], mask: torch.Tensor, grids: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
        """(advantages [B, T], critic returns [B, T] or None, metrics) for the whole batch;
        ``grids`` holds what :meth:`grids` named ([B, T] on CPU)."""
        metrics: dict[str, float] = {}
        token_rewards = self._token_rewards(samples, mask, grids, metrics)
        adv, returns = self._reward_advantages(samples, token_rewards, mask, grids, metrics)
        adv = adv * self.algo.reward_coef
        if self.distill:
            adv = self._distill(samples, adv, mask, grids, metrics)
        return adv, returns, metrics

    def update_kl(self, kl_seq: float | None, n_samples: int) -> None:
        """Called after each step with its ``kl_seq`` metric: the adaptive coefficient moves."""
        if self.kl_ctl is not None and kl_seq is not None:
            self.kl_ctl.update(kl_seq, n_samples)

    def _token_rewards(
        self,
        samples: list[Sample],
        mask: torch.Tensor,
        grids: Mapping[str, torch.Tensor],
        metrics: dict[str, float],
    ) -> torch.Tensor:
        """The rewards [B], or token rewards [B, T] with the KL to the reference subtracted."""
        a = self.algo
        # an infra_error kept in the loss (reward.exclude_infra_errors=false) scores 0
        rewards = torch.tensor(
            [s.reward if s.reward is not None else 0.0 for s in samples], dtype=torch.float32
        )
        token_rewards = rewards
        if "ref" in grids:  # the KL of the sampling policy to the reference, per token
            kl = alg.kl_estimate(grids["old"], grids["ref"], a.kl_estimator) * mask
            metrics["kl_seq"] = float(kl.sum(-1).mean())
            if a.kl_in_reward:
                metrics["kl_ref"] = float(kl.sum() / mask.sum().clamp(min=1.0))
                token_rewards = alg.kl_penalty_in_reward(rewards, kl, mask, self.kl_coef)
        if self.kl_ctl is not None or a.kl_in_reward:
            metrics["kl_coef"] = self.kl_coef
        return token_rewards

    def _reward_advantages(
        self,
        samples: list[Sample],
        token_rewards: torch.Tensor,
        mask: torch.Tensor,
        grids: Mapping[str, torch.Tensor],
        metrics: dict[str, float],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The reward estimator's advantages (GAE with the critic, else the group estimators)
        and the critic's returns."""
        a = self.algo
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
            metrics["explained_variance"] = explained_variance(returns, values, mask)
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
        return adv, returns

    def _distill(
        self,
        samples: list[Sample],
        adv: torch.Tensor,
        mask: torch.Tensor,
        grids: Mapping[str, torch.Tensor],
        metrics: dict[str, float],
    ) -> torch.Tensor:
        """``adv`` minus ``distill_coef`` times the per-token k1 reverse KL to the teacher."""
        reverse_kl = (grids["old"] - grids["teacher"]) * mask  # k1 of KL(student || teacher)
        adv = adv - self.algo.distill_coef * reverse_kl
        metrics["distill_kl"] = float(reverse_kl.sum() / mask.sum().clamp(min=1.0))
        keys = [self.teacher_key(s) for s in samples]
        if len(set(self.teacher_paths)) > 1:
            for key in sorted(set(keys)):
                rows = [i for i, k in enumerate(keys) if k == key]
                n = mask[rows].sum().clamp(min=1.0)
                metrics[f"distill_kl/{key}"] = float(reverse_kl[rows].sum() / n)
        return adv

    # -- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the adaptive KL controller, baselines, prompt ids."""
        return {
            "kl_ctl": dict(vars(self.kl_ctl)) if self.kl_ctl is not None else None,
            "baseline_state": self.baseline_state,
            "prompt_ids": self.prompt_ids,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from what :meth:`state_dict` returned."""
        if self.kl_ctl is not None and state["kl_ctl"] is not None:
            vars(self.kl_ctl).update(state["kl_ctl"])
        self.baseline_state = state["baseline_state"]
        self.prompt_ids = state["prompt_ids"]


def _prompt_key(sample: Sample) -> str:
    row = sample.metadata.get("row")
    if isinstance(row, dict) and "prompt" in row:
        return json.dumps(row["prompt"], sort_keys=True)
    return sample.group_id


def explained_variance(returns: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over valid tokens; 1 = perfect critic, 0 = no better than a
    constant; NaN-free (0 when the returns do not vary)."""
    var_returns = float(alg.masked_mean((returns - alg.masked_mean(returns, mask)) ** 2, mask))
    residual = returns - values
    var_residual = float(alg.masked_mean((residual - alg.masked_mean(residual, mask)) ** 2, mask))
    if var_returns <= 1e-12 or not math.isfinite(var_residual):
        return 0.0
    return 1.0 - var_residual / var_returns
