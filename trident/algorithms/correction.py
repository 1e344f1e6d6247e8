"""Off-policy correction: importance weights for train/inference mismatch and stale samples,
decoupled PPO, and the log-linear approximation of the proximal policy.

Three log-probs of the same sampled tokens meet here: the engine's (behaviour policy mu, the
one that sampled, possibly at an older weight version and always with different kernels), the
trainer's recompute before the update (pi_old, or pi_prox in decoupled PPO), and the current
trainer policy pi_theta (carries the gradient).

Importance weights (Yao, Liu et al. 2025, "Your Efficient RL Framework Secretly Brings You
Off-Policy RL Training"; verl ``rollout_corr``; slime TIS; IcePop). With the per-token log-ratio
log rho_t = log pi_old(o_t) - log mu(o_t):

- level ``token``: rho_t; ``sequence``: prod_t rho_t (= exp of the summed log-ratios; unbiased,
  high variance); ``geometric``: exp(mean_t log rho_t) (length-invariant); ``none``: 1.
- mode ``truncate`` (TIS): w = min(rho, cap) (and max(., lower) when ``lower`` is given).
- mode ``mask`` (MIS; IcePop when two-sided): w = rho * 1[lower <= rho <= cap]; tokens (or whole
  sequences) out of band get weight 0.

The weights are detached and multiply the per-token policy loss (``policy_loss(...,
is_weights=w)``). Recipes built from these pieces:
- TIS/MIS on top of PPO: ``policy_loss("ppo_clip", logp, old_logp, ..., is_weights=w)`` with
  w from ``importance_weights(old_logp, engine_logp, ...)``;
- bypass (skip the recompute): ``policy_loss("ppo_clip", logp, engine_logp, ...)``;
- bypass-PG: ``policy_loss("reinforce", ..., is_weights=importance_weights(logp, engine_logp))``;
- decoupled PPO (Hilton et al. 2021, "Batch size-invariance for policy optimization"; AReaL,
  Fu et al. 2025): L = -w_t min(r_t A_t, clip(r_t, 1-eps_l, 1+eps_h) A_t) with the trust region
  around the proximal policy, r_t = pi_theta/pi_prox, and the behaviour weight
  w_t = pi_prox/mu, capped as above: :func:`decoupled_ppo_loss`. It is the same computation as
  TIS with pi_old := pi_prox, so one weight corrects both staleness and kernel mismatch.
- :func:`approx_proximal_logp` (AReaL's ``loglinear`` approximation) replaces the extra forward
  pass for pi_prox by interpolating in log space between mu and pi_theta by version:
  alpha = (v_prox - v_behav) / (v_theta - v_behav), log pi_prox ~ log mu + alpha (log pi_theta - log mu).
  It is exact if log-probs move linearly in the version number, which they do not; AReaL reports
  it as a speed/accuracy trade-off.

Mismatch metrics (masked means over valid tokens): mean and max |log pi_old - log mu|, the k1 and
k3 estimates of KL(mu || pi_old) (tokens are sampled from mu), the mean weight, and the
fraction of tokens truncated (``is_clip_fraction``) or masked (``is_mask_fraction``).

Simplifications: log-weights are clamped to [-20, 20] before the exponential (verl's safety
bound), and there is no per-token veto of a sequence (verl's ``C_veto``); a two-sided
``mask`` with ``level="token"`` covers most of its use.
"""

from __future__ import annotations

import torch
from torch import Tensor

from trident.algorithms.aggregation import masked_mean
from trident.algorithms.kl import kl_estimate
from trident.algorithms.losses import policy_loss

IS_LEVELS = ("none", "token", "sequence", "geometric")
IS_MODES = ("truncate", "mask")
_LOG_WEIGHT_BOUND = 20.0


def importance_weights(
    trainer_logp: Tensor,
    engine_logp: Tensor,
    mask: Tensor,
    level: str = "token",
    mode: str = "truncate",
    cap: float = 2.0,
    lower: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Detached importance weights [B, T] of pi_trainer / pi_engine (0 at masked positions)."""
    if mode not in IS_MODES:
        raise ValueError(f"unknown importance-sampling mode {mode!r}; expected one of {IS_MODES}")
    mask = mask.to(trainer_logp.dtype)
    trainer_logp, engine_logp = trainer_logp.detach(), engine_logp.detach()
    log_rho = (trainer_logp - engine_logp) * mask
    if level == "none":
        log_w = torch.zeros_like(log_rho)
    elif level == "token":
        log_w = log_rho
    elif level == "sequence":
        log_w = log_rho.sum(-1, keepdim=True).expand_as(log_rho)
    elif level == "geometric":
        mean = log_rho.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
        log_w = mean.expand_as(log_rho)
    else:
        raise ValueError(
            f"unknown importance-sampling level {level!r}; expected one of {IS_LEVELS}"
        )
    rho = torch.exp(log_w.clamp(-_LOG_WEIGHT_BOUND, _LOG_WEIGHT_BOUND))

    out_of_band = torch.zeros_like(mask, dtype=torch.bool)
    if level != "none":
        out_of_band = rho > cap
        if lower is not None:
            out_of_band = out_of_band | (rho < lower)
    if mode == "truncate":
        weights = rho.clamp(min=lower, max=cap) if level != "none" else rho
    else:
        weights = torch.where(out_of_band, 0.0, rho)
    weights = weights * mask

    affected = masked_mean(out_of_band.to(mask.dtype), mask)
    no_tokens = torch.zeros_like(affected)
    metrics = mismatch_metrics(trainer_logp, engine_logp, mask) | {
        "is_weight_mean": masked_mean(weights, mask),
        "is_clip_fraction": affected if mode == "truncate" else no_tokens,
        "is_mask_fraction": affected if mode == "mask" else no_tokens,
    }
    return weights, metrics


def mismatch_metrics(trainer_logp: Tensor, engine_logp: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """How far the engine's logprobs are from the trainer's over ``mask``'s tokens: mean and max
    |Δlogp|, and the k1 and k3 estimates of KL(engine || trainer). Positions outside the mask
    are ignored whatever they hold (NaN included)."""
    on = mask > 0
    trainer_logp, engine_logp = trainer_logp[on].detach(), engine_logp[on].detach()
    abs_diff = (trainer_logp - engine_logp).abs()
    if not abs_diff.numel():
        return dict.fromkeys(MISMATCH_METRICS, abs_diff.new_zeros(()))
    return {
        "mismatch_abs_logp_diff_mean": abs_diff.mean(),
        "mismatch_abs_logp_diff_max": abs_diff.max(),
        "mismatch_k1_kl": kl_estimate(engine_logp, trainer_logp, "k1").mean(),
        "mismatch_k3_kl": kl_estimate(engine_logp, trainer_logp, "k3").mean(),
    }


MISMATCH_METRICS = (
    "mismatch_abs_logp_diff_mean",
    "mismatch_abs_logp_diff_max",
    "mismatch_k1_kl",
    "mismatch_k3_kl",
)


def decoupled_ppo_loss(
    logp: Tensor,
    prox_logp: Tensor,
    behav_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
    behav_level: str = "token",
    behav_mode: str = "truncate",
    behav_cap: float = 2.0,
    behav_lower: float | None = None,
    dual_clip_c: float | None = None,
    aggregation: str = "token_mean",
    loss_scale_tokens: int | None = None,
    global_tokens: int | float | Tensor | None = None,
    global_seqs: int | float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Decoupled PPO: clip pi_theta/pi_prox, weight by the capped behaviour ratio pi_prox/mu.

    ``dual_clip_c`` (c > 1) adds the dual clip for negative advantages. Returns the scalar
    loss and the metrics of both the behaviour weights and the clipped objective.
    """
    weights, weight_metrics = importance_weights(
        prox_logp, behav_logp, mask, behav_level, behav_mode, behav_cap, behav_lower
    )
    loss, loss_metrics = policy_loss(
        "ppo_clip" if dual_clip_c is None else "dual_clip",
        logp,
        prox_logp,
        advantages,
        mask,
        clip_eps_low=clip_eps_low,
        clip_eps_high=clip_eps_high,
        dual_clip_c=3.0 if dual_clip_c is None else dual_clip_c,
        is_weights=weights,
        aggregation=aggregation,
        loss_scale_tokens=loss_scale_tokens,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
    )
    return loss, {**weight_metrics, **loss_metrics}


def approx_proximal_logp(
    behav_logp: Tensor,
    current_logp: Tensor,
    behav_versions: Tensor | float,
    prox_version: float,
    current_version: float,
) -> Tensor:
    """AReaL's log-linear pi_prox: log mu + alpha (log pi_theta - log mu), detached.

    ``behav_versions`` is the policy version that sampled each token ([B, T], the Sample's
    ``versions``) or one number. alpha = (v_prox - v_behav) / (v_theta - v_behav), clamped to
    [0, 1]; a token sampled by the current version (v_theta == v_behav) gets alpha = 0, i.e.
    pi_prox = mu.
    """
    behav_logp, current_logp = behav_logp.detach(), current_logp.detach()
    v_behav = torch.as_tensor(behav_versions, dtype=behav_logp.dtype, device=behav_logp.device)
    span = current_version - v_behav
    alpha = torch.where(span > 0, (prox_version - v_behav) / span.clamp(min=1e-12), 0.0)
    alpha = alpha.clamp(0.0, 1.0)
    return behav_logp + alpha * (current_logp - behav_logp)
