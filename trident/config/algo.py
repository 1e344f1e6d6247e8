"""Algorithm configuration: one preset name sets the defaults, any field can still be overridden.

Presets only fill fields the user did not set explicitly (on the command line or in YAML), so
``algo.name=gspo algo.clip_eps_high=0.3`` keeps the user's 0.3.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

AdvantageEstimator = Literal[
    "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae", "running_baseline"
]
PolicyLoss = Literal["ppo_clip", "dual_clip", "gspo", "cispo", "reinforce"]
Aggregation = Literal[
    "token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"
]
KLEstimator = Literal["k1", "k2", "k3"]
ISLevel = Literal["none", "token", "sequence", "geometric"]
ISMode = Literal["truncate", "mask"]
OldLogprobs = Literal["auto", "recompute", "engine"]

# Each preset lists only what differs from the field defaults below (which are GRPO's).
PRESETS: dict[str, dict[str, Any]] = {
    "grpo": {},
    "dr_grpo": {"advantage": "dr_grpo", "aggregation": "seq_mean_token_sum_norm"},
    "dapo": {
        "clip_eps_low": 0.2,
        "clip_eps_high": 0.28,
        "aggregation": "token_mean",
        "dynamic_sampling": True,
        "overlong_penalty": True,
        "mask_truncated": True,
    },
    "gspo": {
        "policy_loss": "gspo",
        "clip_eps_low": 3e-4,
        "clip_eps_high": 4e-4,
        "aggregation": "seq_mean_token_mean",
    },
    # MiniMax-M1 puts no lower bound on CISPO's IS weight: eps_low = 1 makes the bound 0.
    "cispo": {
        "policy_loss": "cispo",
        "clip_eps_low": 1.0,
        "clip_eps_high": 5.0,
        "aggregation": "token_mean",
    },
    "ppo": {"advantage": "gae", "use_critic": True},
    "rloo": {"advantage": "rloo"},
    # OpenRLHF's REINFORCE++ shapes the reward with the k1 KL estimate (Hu 2025).
    "reinforce_pp": {
        "advantage": "reinforce_pp",
        "kl_coef": 0.001,
        "kl_in_reward": True,
        "kl_estimator": "k1",
    },
    "reinforce_pp_baseline": {"advantage": "reinforce_pp_baseline"},
    "opd": {"advantage": "grpo", "distill_coef": 1.0, "reward_coef": 0.0},
    # Critic-free, single-sample asynchronous REINFORCE: one response per prompt (rollout.n = 1),
    # A = r - b with b a running EMA baseline (per prompt when prompts repeat, else global), and
    # l_t = -w_t A log pi(o_t) (Williams 1992), w_t the async modes' truncated IS weight
    # min(pi_prox / mu, is_cap) of a stale token. One rollout per prompt and token IS as in
    # FlashREINFORCE (OpenRLHF #1340), which baselines with the batch mean instead.
    "async_reinforce": {"advantage": "running_baseline", "policy_loss": "reinforce"},
}


class AlgoConfig(BaseModel):
    """The policy-gradient algorithm. Defaults are GRPO with token-mean PPO-clip."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    name: Literal[
        "grpo",
        "dr_grpo",
        "dapo",
        "gspo",
        "cispo",
        "ppo",
        "rloo",
        "reinforce_pp",
        "reinforce_pp_baseline",
        "opd",
        "async_reinforce",
    ] = Field(default="grpo", description="Preset that sets the defaults of the fields below.")
    advantage: AdvantageEstimator = Field(default="grpo", description="Advantage estimator.")
    policy_loss: PolicyLoss = Field(default="ppo_clip", description="Policy loss.")
    aggregation: Aggregation = Field(
        default="token_mean", description="How per-token losses become one number."
    )
    clip_eps_low: float = Field(
        default=0.2, ge=0, description="PPO ratio clip below: ratio >= 1 - eps_low."
    )
    clip_eps_high: float = Field(
        default=0.2,
        ge=0,
        description="PPO ratio clip above: ratio <= 1 + eps_high (clip-higher when > eps_low).",
    )
    dual_clip_c: float = Field(
        default=3.0,
        gt=1,
        description="Dual-clip bound c for negative advantages (policy_loss=dual_clip).",
    )
    kl_coef: float = Field(
        default=0.0,
        ge=0,
        description="Coefficient of the KL penalty to the reference model (0 = no reference model).",
    )
    kl_estimator: KLEstimator = Field(
        default="k3",
        description="KL estimator, with d = log pi_ref - log pi: k1 = -d, k2 = d^2/2, k3 = e^d - 1 - d.",
    )
    kl_target: float | None = Field(
        default=None,
        gt=0,
        description="Target KL for the adaptive coefficient (Ziegler et al.), per sample (summed over its "
        "tokens); kl_coef is the initial value; None = fixed kl_coef.",
    )
    kl_horizon: int = Field(
        default=10000, ge=1, description="Horizon of the adaptive KL controller, in samples."
    )
    kl_in_reward: bool = Field(
        default=False,
        description="Subtract the KL from the reward instead of adding it to the loss.",
    )
    entropy_coef: float = Field(default=0.0, ge=0, description="Entropy bonus coefficient.")
    old_logprobs: OldLogprobs = Field(
        default="auto",
        description="pi_old, the policy the ratio and its clip are taken against: recompute = the "
        "trainer scores the batch before its update; engine = the rollout engine's sampled-token "
        "logprobs, pi_old only on-policy; auto = the engine's where they are pi_old up to the "
        "verified sync's numerical gap (every loss token sampled by the weights the trainer "
        "holds, sync.verify on, float32, top_p = 1), else recompute.",
    )
    is_level: ISLevel = Field(
        default="token", description="Importance-sampling correction of engine/trainer mismatch."
    )
    is_mode: ISMode = Field(
        default="truncate",
        description="truncate = TIS (clip weights at is_cap), mask = MIS (drop tokens outside bounds).",
    )
    is_cap: float = Field(default=2.0, gt=0, description="Upper bound of the importance weight.")
    is_lower: float | None = Field(
        default=None,
        ge=0,
        description="Lower bound of the importance weight (two-sided MIS / IcePop); None = none.",
    )
    norm_std: bool = Field(
        default=True, description="Divide group-relative advantages by the group std (GRPO)."
    )
    use_critic: bool = Field(
        default=False, description="Train a value head alongside the policy (PPO/GAE)."
    )
    value_clip: float | None = Field(
        default=0.2,
        gt=0,
        description="PPO value-loss clip: V may move at most this far from V_old per step; None = unclipped.",
    )
    gamma: float = Field(default=1.0, ge=0, le=1, description="Discount for GAE.")
    lam: float = Field(default=0.95, ge=0, le=1, description="GAE lambda.")
    baseline_decay: float = Field(
        default=0.9,
        ge=0,
        lt=1,
        description="EMA decay of the per-prompt reward baseline (advantage=running_baseline).",
    )
    dynamic_sampling: bool = Field(
        default=False, description="Drop groups whose rewards are all equal and refill (DAPO)."
    )
    overlong_penalty: bool = Field(
        default=False,
        description="Linear penalty for responses in the last overlong_buffer tokens (DAPO).",
    )
    overlong_buffer: int = Field(
        default=8, ge=1, description="Length of the soft overlong window, in tokens."
    )
    mask_truncated: bool = Field(
        default=False, description="Exclude truncated samples from the loss (DAPO)."
    )
    distill_coef: float = Field(
        default=0.0,
        ge=0,
        description="Weight of per-token reverse KL to a teacher (on-policy distillation).",
    )
    reward_coef: float = Field(
        default=1.0, ge=0, description="Weight of the reward advantage in the loss."
    )

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if isinstance(data, dict):
            preset = PRESETS.get(data.get("name", "grpo"), {})
            data = {**preset, **data}
        return data
