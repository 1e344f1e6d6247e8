"""KL divergence to a reference policy: per-token estimators, the in-reward penalty, and the
adaptive coefficient.

Estimators (Schulman, "Approximating KL Divergence", 2020). Tokens are sampled from the policy
pi, and d = log pi_ref(o_t) - log pi(o_t); each is an estimate of KL(pi || pi_ref) per token:

- ``k1`` = -d                    unbiased, high variance, can be negative
- ``k2`` = d^2 / 2               biased, low variance, >= 0
- ``k3`` = e^d - d - 1           unbiased, low variance, >= 0 (GRPO's KL term)

The same functions measure other pairs: ``kl_estimate(old_logp, logp)`` is KL(old || new) on
tokens sampled from the old policy (PPO's approx_kl), ``kl_estimate(engine_logp, trainer_logp)``
the engine/trainer mismatch.

Two ways to use the KL: as a loss term (``aggregate(kl_estimate(...), mask, mode)`` times
``kl_coef``, GRPO) or inside the reward (:func:`kl_penalty_in_reward`, REINFORCE++/PPO-RLHF).
:class:`AdaptiveKLController` (Ziegler et al. 2019, "Fine-Tuning Language Models from Human
Preferences") moves the coefficient so that the measured KL tracks a target:
e = clip(KL / target - 1, -0.2, 0.2), beta <- beta (1 + e n_steps / horizon). The trainer
measures KL as the batch mean of each sample's summed per-token KL of the sampling policy to the
reference (Ziegler's per-sample KL; TRL's PPO measures the same) and counts n_steps in samples.

Simplification: d is clamped to [-20, 20] before the exponential so that a token the reference
finds impossible cannot produce inf; at |d| = 20 the estimate is already ~5e8.
"""

from __future__ import annotations

import torch
from torch import Tensor

from trident.algorithms.advantages import outcome_to_token_rewards

KL_ESTIMATORS = ("k1", "k2", "k3")
_LOG_RATIO_BOUND = 20.0


def kl_estimate(logp: Tensor, ref_logp: Tensor, kind: str = "k3") -> Tensor:
    """Per-token estimate [B, T] of KL(pi || pi_ref) from log-probs of tokens sampled from pi."""
    log_ratio = ref_logp - logp
    if kind == "k1":
        return -log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        log_ratio = log_ratio.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
        return torch.exp(log_ratio) - log_ratio - 1.0
    raise ValueError(f"unknown KL estimator {kind!r}; expected one of {KL_ESTIMATORS}")


def kl_penalty_in_reward(rewards: Tensor, kl: Tensor, mask: Tensor, coef: float) -> Tensor:
    """Token-level rewards [B, T]: the outcome at the last valid token minus ``coef * kl``.

    ``rewards`` is [B] (or already token-level [B, T]); ``kl`` is a per-token estimate, detached
    here because a reward carries no gradient. Feed the result to ``compute_advantages``.
    """
    mask = mask.to(kl.dtype)
    return outcome_to_token_rewards(rewards.to(kl.dtype), mask) - coef * kl.detach() * mask


class AdaptiveKLController:
    """Ziegler et al.'s proportional controller for the KL coefficient (``.value``)."""

    def __init__(self, init_coef: float, target: float, horizon: int) -> None:
        if target <= 0 or horizon <= 0:
            raise ValueError("AdaptiveKLController needs target > 0 and horizon > 0")
        self.value = float(init_coef)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        """Adjust the coefficient after ``n_steps`` samples (or steps) at ``current_kl``."""
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value
