"""Pure RL algorithm functions on torch tensors: advantages, policy/value losses, KL, importance
correction, loss aggregation, and the per-micro-batch loss that combines them
(:mod:`trident.algorithms.rl_loss`), and the Tinker API's sum-semantics losses
(:mod:`trident.algorithms.tinker_losses`). No I/O, no Ray, no HTTP, no files; every formula has a
float64 golden-value test in ``tests/test_algorithms.py``, ``tests/test_rl_loss.py`` or
``tests/test_tinker_losses.py``. How the trainer puts them together, and why:
``docs/algorithms.md``.

Shapes: per-token values are padded [B, T] with a ``mask`` [B, T] (1 = the token counts in the
loss); per-sequence values are [B].
"""

from trident.algorithms.advantages import (
    ESTIMATORS,
    compute_advantages,
    discounted_returns,
    dr_grpo_advantages,
    gae_advantages_and_returns,
    grpo_advantages,
    new_baseline_state,
    outcome_to_token_rewards,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    running_baseline_advantages,
)
from trident.algorithms.aggregation import (
    AGGREGATIONS,
    aggregate,
    loss_denominators,
    masked_mean,
    masked_whiten,
)
from trident.algorithms.correction import (
    IS_LEVELS,
    IS_MODES,
    approx_proximal_logp,
    decoupled_ppo_loss,
    importance_weights,
    mismatch_metrics,
)
from trident.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    kl_estimate,
    kl_penalty_in_reward,
)
from trident.algorithms.losses import POLICY_LOSSES, entropy_bonus, policy_loss, value_loss
from trident.algorithms.shaping import overlong_penalty

__all__ = [
    "AGGREGATIONS",
    "ESTIMATORS",
    "IS_LEVELS",
    "IS_MODES",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "aggregate",
    "approx_proximal_logp",
    "compute_advantages",
    "decoupled_ppo_loss",
    "discounted_returns",
    "dr_grpo_advantages",
    "entropy_bonus",
    "gae_advantages_and_returns",
    "grpo_advantages",
    "importance_weights",
    "kl_estimate",
    "kl_penalty_in_reward",
    "loss_denominators",
    "masked_mean",
    "masked_whiten",
    "mismatch_metrics",
    "new_baseline_state",
    "outcome_to_token_rewards",
    "overlong_penalty",
    "policy_loss",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
    "running_baseline_advantages",
    "value_loss",
]
