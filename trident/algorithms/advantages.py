"""Advantage estimators: rewards (and, for GAE, critic values) in, per-token advantages out.

Inputs: ``rewards`` is [B] (one outcome reward per sample) or [B, T] (token-level rewards, e.g.
an outcome at the last valid token minus a per-token KL penalty, see
:func:`trident.algorithms.kl.kl_penalty_in_reward`); ``group_ids`` [B] (int) says which samples
answer the same prompt; ``mask`` [B, T] marks the tokens the policy produced. The output is
[B, T], zero wherever ``mask`` is 0. With r_i the reward of sample i and g(i) its group:

- ``grpo``   (Shao et al. 2024, DeepSeekMath; TRL/verl):  A_i = (r_i - mean_g) / (std_g + eps),
  std with Bessel's correction as TRL and verl compute it; ``norm_std=False`` skips the division.
- ``dr_grpo`` (Liu et al. 2025, Dr. GRPO):  A_i = r_i - mean_g.
- ``rloo``   (Ahmadian et al. 2024):  A_i = r_i - (1/(G-1)) sum_{j in g, j != i} r_j.
- ``reinforce_pp`` (Hu 2025, REINFORCE++; OpenRLHF):  the discounted return-to-go of the token
  rewards, G_t = sum_{k >= t} gamma^{k-t} r_k, whitened over all valid tokens of the batch.
- ``reinforce_pp_baseline``: subtract the group mean of the sequence returns from the outcome
  (at the last valid token), then as ``reinforce_pp``.
- ``gae`` (Schulman et al. 2016):  delta_t = r_t + gamma V_{t+1} - V_t,
  A_t = delta_t + gamma lam A_{t+1}; returns R_t = A_t + V_t are the critic's target;
  advantages are whitened over the batch when ``norm_std`` (verl, OpenRLHF).
- ``running_baseline`` (trident; critic-free and single-sample, for streaming/async training
  where a prompt's group may not arrive together):  A_i = r_i - b, where b is an exponential
  moving average of past rewards of the same prompt (``group_ids`` must then identify the
  prompt, e.g. its dataset index), or, for a prompt never seen, a global EMA of batch-mean
  rewards. Baselines are read *before* the batch updates them, so a sample never serves as its
  own baseline (except the very first batch, where the global EMA starts at the batch mean).
  The state is a plain dict (see :func:`new_baseline_state`) that the caller keeps and saves.

Deliberate simplifications:

- Masked positions inside a response (tool output in a multi-turn trajectory) are not steps of
  the MDP: returns, values and GAE recursions pass through them unchanged, so discounting
  counts only the policy's own tokens.
- A group of one sample has no relative signal: ``grpo``, ``dr_grpo`` and ``rloo`` give it zero
  advantage (use ``running_baseline`` for single samples).
- Group statistics use the rewards of every sample, also those whose loss is fully masked (a
  DAPO-masked truncation still tells the group how hard the prompt is).
- For the group estimators a [B, T] reward is reduced to its (undiscounted) sequence sum.
- ``running_baseline`` does not rescale by a running std, so ``norm_std`` is ignored there,
  as in ``dr_grpo``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from trident.algorithms.aggregation import masked_whiten

ESTIMATORS = (
    "grpo",
    "dr_grpo",
    "rloo",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "gae",
    "running_baseline",
)


def compute_advantages(
    estimator: str,
    rewards: Tensor,
    group_ids: Tensor,
    mask: Tensor,
    *,
    norm_std: bool = True,
    values: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 0.95,
    baseline_state: dict[str, Any] | None = None,
    eps: float = 1e-6,
) -> Tensor:
    """Per-token advantages [B, T] from ``estimator`` (one of :data:`ESTIMATORS`)."""
    options = dict(
        norm_std=norm_std,
        values=values,
        gamma=gamma,
        lam=lam,
        baseline_state=baseline_state,
        eps=eps,
    )
    try:
        estimate = _DISPATCH[estimator]
    except KeyError:
        raise ValueError(
            f"unknown advantage estimator {estimator!r}; expected one of {ESTIMATORS}"
        ) from None
    return estimate(rewards, group_ids, mask, options)


# --- outcome rewards -> token grid ----------------------------------------------------------


def outcome_to_token_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """Place each sample's reward [B] on its last valid token: [B, T]. [B, T] passes through."""
    if rewards.dim() == 2:
        return rewards * mask.to(rewards.dtype)
    mask = mask.to(rewards.dtype)
    token_rewards = torch.zeros_like(mask)
    positions = torch.arange(mask.shape[-1], device=mask.device)
    last = torch.where(mask > 0, positions, -1).max(-1).values
    has_token = last >= 0
    rows = torch.arange(mask.shape[0], device=mask.device)[has_token]
    token_rewards[rows, last[has_token]] = rewards[has_token]
    return token_rewards


def sequence_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """One reward per sample [B]: identity for [B], masked sum for token-level [B, T]."""
    if rewards.dim() == 2:
        return (rewards * mask.to(rewards.dtype)).sum(-1)
    return rewards


def discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """Return-to-go G_t = r_t + gamma G_{next valid t}, 0 at masked positions."""
    mask = mask.to(token_rewards.dtype)
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[-1])):
        m = mask[:, t]
        running = m * (token_rewards[:, t] + gamma * running) + (1 - m) * running
        returns[:, t] = running * m
    return returns


# --- group statistics -----------------------------------------------------------------------


def _group_stats(values: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample (group mean, group std with Bessel's correction, group size); std 0 if size 1."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    counts = torch.zeros(n_groups, dtype=values.dtype, device=values.device)
    counts.index_add_(0, inverse, torch.ones_like(values))
    sums = torch.zeros_like(counts).index_add_(0, inverse, values)
    mean = (sums / counts)[inverse]
    squares = torch.zeros_like(counts).index_add_(0, inverse, (values - mean) ** 2)
    size = counts[inverse]
    std = (squares[inverse] / (size - 1).clamp(min=1.0)).sqrt()
    return mean, std, size


def grpo_advantages(
    rewards: Tensor, group_ids: Tensor, mask: Tensor, *, norm_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """GRPO: (r - group mean) / (group std + eps), broadcast over valid tokens."""
    r = sequence_rewards(rewards, mask)
    mean, std, _ = _group_stats(r, group_ids)
    advantage = r - mean
    if norm_std:
        advantage = advantage / (std + eps)
    return advantage[:, None] * mask.to(r.dtype)


def dr_grpo_advantages(rewards: Tensor, group_ids: Tensor, mask: Tensor) -> Tensor:
    """Dr. GRPO: r - group mean (no std division), broadcast over valid tokens."""
    return grpo_advantages(rewards, group_ids, mask, norm_std=False)


def rloo_advantages(rewards: Tensor, group_ids: Tensor, mask: Tensor) -> Tensor:
    """RLOO: r minus the mean of the *other* samples of the group; 0 for a group of one."""
    r = sequence_rewards(rewards, mask)
    mean, _, size = _group_stats(r, group_ids)
    # r - (size*mean - r)/(size-1) == size/(size-1) * (r - mean)
    advantage = torch.where(size > 1, size / (size - 1).clamp(min=1.0) * (r - mean), 0.0)
    return advantage[:, None] * mask.to(r.dtype)


def reinforce_pp_advantages(
    rewards: Tensor, mask: Tensor, *, gamma: float = 1.0, norm_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """REINFORCE++: discounted return-to-go, whitened over all valid tokens of the batch."""
    returns = discounted_returns(outcome_to_token_rewards(rewards, mask), mask, gamma)
    return masked_whiten(returns, mask, scale=norm_std, eps=eps)


def reinforce_pp_baseline_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    mask: Tensor,
    *,
    gamma: float = 1.0,
    norm_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """REINFORCE++-baseline: outcome minus its group mean, then REINFORCE++ normalisation."""
    mean, _, _ = _group_stats(sequence_rewards(rewards, mask), group_ids)
    token_rewards = outcome_to_token_rewards(rewards, mask)
    token_rewards = token_rewards - outcome_to_token_rewards(mean, mask)
    return reinforce_pp_advantages(token_rewards, mask, gamma=gamma, norm_std=norm_std, eps=eps)


def gae_advantages_and_returns(
    rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float = 1.0, lam: float = 0.95
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation: (advantages, returns), both [B, T], unwhitened.

    ``values`` [B, T] are the critic's V(s_t) at each response token; the value after the last
    valid token is 0 (the episode ends). Returns R_t = A_t + V_t are the critic's target.
    """
    mask = mask.to(values.dtype)
    token_rewards = outcome_to_token_rewards(rewards.to(values.dtype), mask)
    values = values.detach()
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[-1])):
        m = mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = advantage * m
        next_advantage = m * advantage + (1 - m) * next_advantage
        next_value = m * values[:, t] + (1 - m) * next_value
    return advantages, (advantages + values) * mask


def new_baseline_state(decay: float = 0.9) -> dict[str, Any]:
    """Empty state for ``running_baseline``: EMA decay, per-prompt EMAs, global EMA.

    Plain floats and string keys, so it can go into a JSON or torch checkpoint as is.
    """
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"baseline decay must be in [0, 1), got {decay}")
    return {"decay": decay, "per_prompt": {}, "global": None}


def running_baseline_advantages(
    rewards: Tensor, group_ids: Tensor, mask: Tensor, baseline_state: dict[str, Any]
) -> Tensor:
    """r - EMA baseline of the prompt (or the global EMA); updates ``baseline_state`` in place."""
    r = sequence_rewards(rewards, mask)
    decay = float(baseline_state["decay"])
    per_prompt: dict[str, float] = baseline_state["per_prompt"]
    reward_list = [float(x) for x in r.detach().cpu().tolist()]
    prompt_list = [str(int(x)) for x in group_ids.cpu().tolist()]  # str keys: JSON-safe state
    if baseline_state["global"] is None and reward_list:
        baseline_state["global"] = sum(reward_list) / len(reward_list)
    fallback = baseline_state["global"]
    baselines = [per_prompt.get(p, fallback) for p in prompt_list]
    for p, reward in zip(prompt_list, reward_list, strict=True):
        previous = per_prompt.get(p)
        per_prompt[p] = reward if previous is None else decay * previous + (1 - decay) * reward
    if reward_list:
        assert fallback is not None  # set from this batch above when it was unset
        batch_mean = sum(reward_list) / len(reward_list)
        baseline_state["global"] = decay * fallback + (1 - decay) * batch_mean
    baseline = torch.tensor(baselines, dtype=r.dtype, device=r.device)
    return (r - baseline)[:, None] * mask.to(r.dtype)


# --- dispatch -------------------------------------------------------------------------------

_Options = dict[str, Any]


def _gae(rewards: Tensor, group_ids: Tensor, mask: Tensor, o: _Options) -> Tensor:
    if o["values"] is None:
        raise ValueError("advantage estimator 'gae' needs the critic's values")
    advantages, _ = gae_advantages_and_returns(
        rewards, o["values"], mask, gamma=o["gamma"], lam=o["lam"]
    )
    return masked_whiten(advantages, mask, eps=o["eps"]) if o["norm_std"] else advantages


def _running(rewards: Tensor, group_ids: Tensor, mask: Tensor, o: _Options) -> Tensor:
    if o["baseline_state"] is None:
        raise ValueError(
            "advantage estimator 'running_baseline' needs a baseline_state kept across steps "
            "(see new_baseline_state)"
        )
    return running_baseline_advantages(rewards, group_ids, mask, o["baseline_state"])


_DISPATCH: dict[str, Callable[[Tensor, Tensor, Tensor, _Options], Tensor]] = {
    "grpo": lambda r, g, m, o: grpo_advantages(r, g, m, norm_std=o["norm_std"], eps=o["eps"]),
    "dr_grpo": lambda r, g, m, o: dr_grpo_advantages(r, g, m),
    "rloo": lambda r, g, m, o: rloo_advantages(r, g, m),
    "reinforce_pp": lambda r, g, m, o: reinforce_pp_advantages(
        r, m, gamma=o["gamma"], norm_std=o["norm_std"], eps=o["eps"]
    ),
    "reinforce_pp_baseline": lambda r, g, m, o: reinforce_pp_baseline_advantages(
        r, g, m, gamma=o["gamma"], norm_std=o["norm_std"], eps=o["eps"]
    ),
    "gae": _gae,
    "running_baseline": _running,
}
