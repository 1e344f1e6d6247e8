"""The per-micro-batch RL loss: per-token tensors in, the policy's and the critic's losses and
the micro-batch's metric sums out. No model, no optimizer: the trainer runs the forward passes,
calls :func:`rl_loss` and backpropagates what it returns.

With m the micro-batch's loss mask, logp = log pi_theta (the only input that carries the policy's
gradient), old = log pi_old, A the advantages, H the per-token entropy and ``agg`` the
:func:`~trident.algorithms.aggregation.aggregate` named by ``spec.aggregation``:

    L_policy = policy_loss(logp, old, A, m; w)         w: IS weights of old vs the engine's
               - entropy_coef * agg(H, m)               when entropy_coef > 0
               + kl_coef * agg(kl_estimate(logp, ref), m)   when a reference is given
    L_value  = token_mean(0.5 max((V - R)^2, (V_old + clip(V - V_old, +-c) - R)^2))

w is :func:`~trident.algorithms.correction.importance_weights` (none when ``is_level`` is
``none``). Every term is aggregated with the whole batch's token and sequence counts
(``global_tokens``, ``global_seqs``), so the losses of a batch's micro-batches sum to its loss.
The reference KL is a loss term only when it is not already in the reward (``kl_in_reward``):
the trainer then passes no ``ref_logp``.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from trident.algorithms.aggregation import aggregate
from trident.algorithms.correction import importance_weights
from trident.algorithms.kl import kl_estimate
from trident.algorithms.losses import entropy_bonus, policy_loss, value_loss

# policy_loss's metrics the trainer reports (token means, summed here as mean x tokens)
_POLICY_METRICS = ("clip_fraction", "ratio_mean", "approx_kl")


@dataclass(frozen=True)
class LossSpec:
    """The settings of :func:`rl_loss` (the ``algo.*`` fields of the same names; defaults are
    GRPO's). ``norm_tokens`` is Dr. GRPO's constant L for ``seq_mean_token_sum_norm``;
    ``kl_coef`` is the step's beta (fixed or adaptive)."""

    policy_loss: str = "ppo_clip"
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip_c: float = 3.0
    aggregation: str = "token_mean"
    norm_tokens: int | None = None
    is_level: str = "token"
    is_mode: str = "truncate"
    is_cap: float = 2.0
    is_lower: float | None = None
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    value_clip: float | None = 0.2


@dataclass
class RLLoss:
    """What :func:`rl_loss` returns. ``sums``: the micro-batch's metrics as sums, ready to add
    into the step's: ``tokens`` (its loss tokens), ``loss`` and ``value_loss`` (its share of the
    batch loss), maxima for keys ending in ``_max``, and for every other key the token sum
    (token mean x tokens), so that the step's sum divided by its ``tokens`` is a token mean."""

    policy: Tensor
    value: Tensor | None
    sums: dict[str, float]


def rl_loss(
    spec: LossSpec,
    logp: Tensor,
    entropy: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    engine_logp: Tensor,
    *,
    global_tokens: int,
    global_seqs: int,
    ref_logp: Tensor | None = None,
    values: Tensor | None = None,
    old_values: Tensor | None = None,
    returns: Tensor | None = None,
) -> RLLoss:
    """The loss of one micro-batch ([b, T] tensors; see the module docstring).

    ``logp`` and ``entropy`` carry the policy's gradient, ``values`` (the critic's V, given
    together with ``old_values`` and ``returns``) the critic's; everything else is a constant.
    """
    agg = {"global_tokens": global_tokens, "global_seqs": global_seqs}
    is_w, mis = None, {}
    if spec.is_level != "none":
        is_w, mis = importance_weights(
            old_logp,
            engine_logp,
            mask,
            level=spec.is_level,
            mode=spec.is_mode,
            cap=spec.is_cap,
            lower=spec.is_lower,
        )
    loss, m = policy_loss(
        spec.policy_loss, logp, old_logp, advantages, mask,
        clip_eps_low=spec.clip_eps_low, clip_eps_high=spec.clip_eps_high,
        dual_clip_c=spec.dual_clip_c, is_weights=is_w, aggregation=spec.aggregation,
        loss_scale_tokens=spec.norm_tokens, **agg,
    )  # fmt: skip
    if spec.entropy_coef > 0:
        bonus = entropy_bonus(entropy, mask, spec.aggregation, norm_tokens=spec.norm_tokens, **agg)
        loss = loss - spec.entropy_coef * bonus
    n = float(mask.sum())
    sums: dict[str, float] = {}
    if ref_logp is not None:
        kl = kl_estimate(logp, ref_logp, spec.kl_estimator)
        kl_term = aggregate(kl, mask, spec.aggregation, norm_tokens=spec.norm_tokens, **agg)
        loss = loss + spec.kl_coef * kl_term
        sums["kl_ref"] = float((kl.detach() * mask).sum())
    vloss = None
    if values is not None:
        if old_values is None or returns is None:
            raise ValueError("the value loss needs old_values and returns with values")
        vloss, vm = value_loss(
            values, old_values, returns, mask, clip=spec.value_clip, global_tokens=global_tokens
        )
        sums["value_loss"] = float(vloss.detach())
        sums["value_clip_fraction"] = float(vm["value_clip_fraction"]) * n
    sums["tokens"] = n
    sums["loss"] = float(loss.detach())
    sums["entropy"] = float((entropy.detach() * mask).sum())
    for key in _POLICY_METRICS:
        sums[key] = float(m[key]) * n
    for key, value in mis.items():
        sums[key] = float(value) if key.endswith("_max") else float(value) * n
    return RLLoss(loss, vloss, sums)


def add_sums(total: dict[str, float], sums: dict[str, float]) -> None:
    """Add a micro-batch's :attr:`RLLoss.sums` into the step's ``total`` (maxima for ``_max``)."""
    for key, value in sums.items():
        before = total.get(key, 0.0)
        total[key] = max(before, value) if key.endswith("_max") else before + value


def gradient_rows(
    rows: list[int], adv: Tensor, mask: Tensor, spec: LossSpec, kl_term: bool
) -> list[int]:
    """The ``rows`` (of [B, T] ``adv`` and ``mask``) whose policy gradient may be nonzero.

    Every policy loss (ppo_clip, dual_clip, gspo, cispo, reinforce; :mod:`.losses`) is
    l_t = A_t f(r_t), times an importance weight, so a row whose loss tokens all have A_t = 0
    (a GRPO group whose rewards are all equal; a row without loss tokens) adds nothing to the
    gradient, unless the loss has another term: an entropy bonus, or a reference-KL term
    (``kl_term``, counted when its coefficient is not 0). Its tokens and sequence stay in the
    loss's normalisers, so leaving it out changes no weight (DAPO's dynamic sampling drops such
    groups and renormalises over the rest; nothing is renormalised here)."""
    if spec.entropy_coef > 0 or (kl_term and spec.kl_coef != 0):
        return rows
    signal = ((adv[rows] != 0) & (mask[rows] > 0)).any(1).tolist()
    return [r for r, s in zip(rows, signal, strict=True) if s]
