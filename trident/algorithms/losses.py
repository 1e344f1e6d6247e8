"""Policy, value and entropy losses: per-token log-probs and advantages in, a scalar loss out.

Notation: r_t = pi_theta(o_t) / pi_old(o_t) = exp(logp - old_logp), A_t the advantage,
eps_l / eps_h the lower / upper clip range, w_t an optional importance weight (train/inference
mismatch or decoupled-PPO behaviour weight, see :mod:`trident.algorithms.correction`). Each loss
is l_t per token, multiplied by w_t and reduced by :func:`~trident.algorithms.aggregation.aggregate`.

- ``ppo_clip`` (Schulman et al. 2017; clip-higher from DAPO, Yu et al. 2025):
  l_t = -min(r_t A_t, clip(r_t, 1 - eps_l, 1 + eps_h) A_t).
- ``dual_clip`` (Ye et al. 2020): as ``ppo_clip``, and for A_t < 0 the loss is capped at
  c |A_t| (l_t = min(l_t, -c A_t)), so a token whose ratio exploded cannot dominate.
- ``gspo`` (Zheng et al. 2025, Group Sequence Policy Optimization): a sequence ratio
  s_i = exp((1/|y_i|) sum_t log r_t) replaces r_t. Implemented in the GSPO-token form,
  s_it = sg(s_i) * pi_theta(o_t) / sg(pi_theta(o_t)), whose value is s_i and whose gradient,
  with per-sequence advantages and ``seq_mean_token_mean``, is exactly GSPO's; it also
  accepts per-token advantages.
- ``cispo`` (MiniMax-M1, 2025): l_t = -sg(clip(r_t, 1 - eps_l, 1 + eps_h)) A_t log pi_theta(o_t).
  The IS weight is clipped and detached, so no token's gradient is zeroed (unlike PPO's clip).
  MiniMax uses no lower bound: the ``cispo`` preset sets eps_l = 1.
- ``reinforce``: l_t = -A_t log pi_theta(o_t), no ratio (with w_t this is verl's "bypass-PG").

Metrics (detached, masked means over the micro-batch's valid tokens): ``clip_fraction`` = share
of tokens whose policy gradient the clip removed (for ``cispo``: whose IS weight was clipped),
``ratio_mean`` / ``ratio_max`` of r_t, ``approx_kl`` = k3 estimate of KL(pi_old || pi_theta),
and ``dual_clip_fraction`` for ``dual_clip``.

``value_loss`` is PPO's clipped critic loss, 0.5 max((V - R)^2, (V_old + clip(V - V_old, +-c) - R)^2).

Simplification: log r is clamped to [-20, 20] before the exponential (as verl does), which only
matters for ratios that the clip would discard anyway.
"""

from __future__ import annotations

import torch
from torch import Tensor

from trident.algorithms.aggregation import aggregate, masked_mean
from trident.algorithms.kl import kl_estimate

POLICY_LOSSES = ("ppo_clip", "dual_clip", "gspo", "cispo", "reinforce")
_LOG_RATIO_BOUND = 20.0


def policy_loss(
    name: str,
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
    dual_clip_c: float = 3.0,
    is_weights: Tensor | None = None,
    aggregation: str = "token_mean",
    loss_scale_tokens: int | None = None,
    global_tokens: int | float | Tensor | None = None,
    global_seqs: int | float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Scalar policy loss named ``name`` (one of :data:`POLICY_LOSSES`) and its metrics.

    ``logp`` carries the gradient; ``old_logp``, ``advantages`` and ``is_weights`` are treated
    as constants. ``loss_scale_tokens`` is Dr. GRPO's constant for ``seq_mean_token_sum_norm``;
    ``global_tokens`` / ``global_seqs`` make micro-batch losses sum to the batch loss.
    """
    mask = mask.to(logp.dtype)
    old_logp = old_logp.detach()
    advantages = advantages.detach()
    log_ratio = (logp - old_logp).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    low, high = 1.0 - clip_eps_low, 1.0 + clip_eps_high
    extra: dict[str, Tensor] = {}

    if name in ("ppo_clip", "dual_clip"):
        token_loss, clipped = _clipped_surrogate(torch.exp(log_ratio), advantages, low, high)
        if name == "dual_clip":
            cap = -dual_clip_c * advantages
            dual_clipped = (advantages < 0) & (token_loss > cap)
            token_loss = torch.where(advantages < 0, torch.minimum(token_loss, cap), token_loss)
            extra["dual_clip_fraction"] = masked_mean(dual_clipped.to(logp.dtype), mask)
    elif name == "gspo":
        seq_log_ratio = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        token_log_ratio = seq_log_ratio.detach()[:, None] + logp - logp.detach()
        token_loss, clipped = _clipped_surrogate(torch.exp(token_log_ratio), advantages, low, high)
        extra["seq_ratio_mean"] = masked_mean(torch.exp(seq_log_ratio).detach(), mask.amax(-1))
    elif name == "cispo":
        ratio = torch.exp(log_ratio).detach()
        weight = ratio.clamp(low, high)
        token_loss = -weight * advantages * logp
        clipped = (ratio < low) | (ratio > high)
    elif name == "reinforce":
        token_loss = -advantages * logp
        clipped = torch.zeros_like(mask, dtype=torch.bool)
    else:
        raise ValueError(f"unknown policy loss {name!r}; expected one of {POLICY_LOSSES}")

    if is_weights is not None:
        token_loss = token_loss * is_weights.detach()
    loss = aggregate(
        token_loss,
        mask,
        aggregation,
        norm_tokens=loss_scale_tokens,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
    )
    with torch.no_grad():
        ratio = torch.exp(log_ratio)
        metrics = {
            "clip_fraction": masked_mean(clipped.to(logp.dtype), mask),
            "ratio_mean": masked_mean(ratio, mask),
            "ratio_max": _masked_max(ratio, mask),
            "approx_kl": masked_mean(kl_estimate(old_logp, logp, "k3"), mask),
            **extra,
        }
    return loss, {k: v.detach() for k, v in metrics.items()}


def _clipped_surrogate(
    ratio: Tensor, advantages: Tensor, low: float, high: float
) -> tuple[Tensor, Tensor]:
    """PPO's pessimistic surrogate per token, and where the clip removed the gradient."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(low, high)
    gradient_removed = ((ratio > high) & (advantages > 0)) | ((ratio < low) & (advantages < 0))
    return torch.maximum(unclipped, clipped), gradient_removed


def _masked_max(values: Tensor, mask: Tensor) -> Tensor:
    if not bool((mask > 0).any()):
        return torch.zeros((), dtype=values.dtype, device=values.device)
    return values[mask > 0].max()


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip: float | None = 0.2,
    aggregation: str = "token_mean",
    *,
    norm_tokens: int | None = None,
    global_tokens: int | float | Tensor | None = None,
    global_seqs: int | float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped value loss (``clip=None`` gives plain 0.5 (V - R)^2) and its metrics."""
    mask = mask.to(values.dtype)
    old_values, returns = old_values.detach(), returns.detach()
    error = (values - returns) ** 2
    if clip is None:
        token_loss, clipped = 0.5 * error, torch.zeros_like(mask, dtype=torch.bool)
    else:
        values_clipped = old_values + (values - old_values).clamp(-clip, clip)
        error_clipped = (values_clipped - returns) ** 2
        token_loss = 0.5 * torch.maximum(error, error_clipped)
        clipped = error_clipped > error
    loss = aggregate(
        token_loss,
        mask,
        aggregation,
        norm_tokens=norm_tokens,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
    )
    metrics = {
        "value_clip_fraction": masked_mean(clipped.to(values.dtype), mask),
        "value_mean": masked_mean(values.detach(), mask),
        "value_error": masked_mean(error.detach(), mask),
    }
    return loss, metrics


def entropy_bonus(
    entropy: Tensor,
    mask: Tensor,
    aggregation: str = "token_mean",
    *,
    norm_tokens: int | None = None,
    global_tokens: int | float | Tensor | None = None,
    global_seqs: int | float | Tensor | None = None,
) -> Tensor:
    """Aggregated per-token entropy; the trainer's loss is ``policy_loss - coef * bonus``."""
    return aggregate(
        entropy,
        mask,
        aggregation,
        norm_tokens=norm_tokens,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
    )
