"""The Tinker API's built-in losses, with its semantics: a datum's loss is a plain **sum** over
its tokens (and a call's over its datums), never a mean; the client normalises, e.g. the
cookbook's supervised datums carry weights that sum to 1 per example.

Notation, per token t of one datum: ``logp_t`` the trainer's logprob of ``target_tokens[t]``
(differentiable), ``q_t`` the sampler's (``logprobs``), ``A_t`` the advantage, ``w_t`` the
weight, ``r_t = exp(logp_t - q_t)``, ``sg`` stop-gradient. Each function returns the
elementwise loss ``l_t`` (the API's ``elementwise_loss`` output); the loss is ``Σ_t l_t``
(the ``loss:sum`` metric).

- ``cross_entropy``: l_t = -w_t logp_t.
- ``importance_sampling``: l_t = -r_t A_t.
- ``ppo``: l_t = -min(r_t A_t, clip(r_t, lo, hi) A_t).
- ``cispo``: l_t = -sg(clip(r_t, lo, hi)) logp_t A_t.
- ``dro``: l_t = -(logp_t A_t - ½ β (logp_t - q_t)²).

``clip_low_threshold`` (lo) and ``clip_high_threshold`` (hi) in ``loss_fn_config`` are bounds
on the ratio itself, not epsilons: Tinker's own implementation text is
``torch.clamp(prob_ratio, clip_low_threshold, clip_high_threshold)``. Defaults: PPO's ε_low =
ε_high = 0.2 ("currently fixed to 0.2 in Tinker"), so [0.8, 1.2]; CISPO's one-sided [0, 4]
(https://tinker-docs.thinkingmachines.ai/tinker/losses/ppo and .../losses/cispo). DRO's β has
no published default, so it must be given (https://tinker-docs.thinkingmachines.ai/tinker/
losses/dro, after Richemond et al. 2024). The RL losses read no ``weights``: Tinker's formulas
have none (prompt positions carry A = 0); inputs a loss does not read are ignored.

Losses trident does not define (``stable_reinforce``, whose definition is unpublished,
``gspo``, ``custom``...) raise :class:`UnsupportedLoss` naming the ones it does. The SDK's own
list is ``tinker/types/loss_fn_type.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor

_PPO_BOUNDS = (0.8, 1.2)
_CISPO_BOUNDS = (0.0, 4.0)


class UnsupportedLoss(ValueError):
    """A ``loss_fn`` trident does not define, or a call that does not give what its loss
    needs: the caller's mistake, answered as such (never retried)."""


def cross_entropy(logp: Tensor, weights: Tensor) -> Tensor:
    """-w logp per token."""
    return -weights * logp


def importance_sampling(logp: Tensor, sampler_logp: Tensor, advantages: Tensor) -> Tensor:
    """-exp(logp - q) A per token."""
    return -torch.exp(logp - sampler_logp) * advantages


def ppo(
    logp: Tensor,
    sampler_logp: Tensor,
    advantages: Tensor,
    clip_low: float = _PPO_BOUNDS[0],
    clip_high: float = _PPO_BOUNDS[1],
) -> Tensor:
    """-min(r A, clip(r, clip_low, clip_high) A) per token; the bounds are on r itself."""
    ratio = torch.exp(logp - sampler_logp)
    clipped = torch.clamp(ratio, clip_low, clip_high)
    return -torch.minimum(ratio * advantages, clipped * advantages)


def cispo(
    logp: Tensor,
    sampler_logp: Tensor,
    advantages: Tensor,
    clip_low: float = _CISPO_BOUNDS[0],
    clip_high: float = _CISPO_BOUNDS[1],
) -> Tensor:
    """-sg(clip(r, clip_low, clip_high)) logp A per token: the clipped ratio is a constant
    coefficient, so no token's gradient is zeroed."""
    coefficient = torch.clamp(torch.exp(logp - sampler_logp), clip_low, clip_high).detach()
    return -coefficient * logp * advantages


def dro(logp: Tensor, sampler_logp: Tensor, advantages: Tensor, beta: float) -> Tensor:
    """-(logp A - ½ β (logp - q)²) per token."""
    return -(logp * advantages - 0.5 * beta * (logp - sampler_logp) ** 2)


def _cross_entropy(logp: Tensor, inputs: Mapping[str, Tensor], _cfg: dict) -> Tensor:
    return cross_entropy(logp, inputs["weights"])


def _importance_sampling(logp: Tensor, inputs: Mapping[str, Tensor], _cfg: dict) -> Tensor:
    return importance_sampling(logp, inputs["logprobs"], inputs["advantages"])


def _bounds(cfg: dict, default: tuple[float, float]) -> tuple[float, float]:
    """The ratio's clip bounds a call names, each falling back to the loss's default."""
    low, high = cfg.get("clip_low_threshold"), cfg.get("clip_high_threshold")
    return (default[0] if low is None else low, default[1] if high is None else high)


def _ppo(logp: Tensor, inputs: Mapping[str, Tensor], cfg: dict) -> Tensor:
    return ppo(logp, inputs["logprobs"], inputs["advantages"], *_bounds(cfg, _PPO_BOUNDS))


def _cispo(logp: Tensor, inputs: Mapping[str, Tensor], cfg: dict) -> Tensor:
    return cispo(logp, inputs["logprobs"], inputs["advantages"], *_bounds(cfg, _CISPO_BOUNDS))


def _dro(logp: Tensor, inputs: Mapping[str, Tensor], cfg: dict) -> Tensor:
    if "beta" not in cfg:
        raise UnsupportedLoss(
            "loss_fn 'dro' needs loss_fn_config {'beta': ...}: Tinker publishes no default"
        )
    return dro(logp, inputs["logprobs"], inputs["advantages"], cfg["beta"])


_RL_INPUTS = ("target_tokens", "logprobs", "advantages")
_THRESHOLDS = ("clip_low_threshold", "clip_high_threshold")
# name -> (elementwise loss, the loss_fn_inputs it needs, the loss_fn_config keys it takes)
_LOSSES: dict[str, tuple[Callable[[Tensor, Mapping[str, Tensor], dict], Tensor], tuple, tuple]] = {
    "cross_entropy": (_cross_entropy, ("target_tokens", "weights"), ()),
    "importance_sampling": (_importance_sampling, _RL_INPUTS, ()),
    "ppo": (_ppo, _RL_INPUTS, _THRESHOLDS),
    "cispo": (_cispo, _RL_INPUTS, _THRESHOLDS),
    "dro": (_dro, _RL_INPUTS, ("beta",)),
}
TINKER_LOSSES = tuple(_LOSSES)


def check_loss(name: str, config: Mapping[str, float]) -> None:
    """Raise :class:`UnsupportedLoss` unless trident defines ``name`` and takes every key of
    ``config`` for it (a misspelt threshold is refused, not silently defaulted)."""
    if name not in _LOSSES:
        raise UnsupportedLoss(
            f"loss_fn {name!r} is not defined by trident; it defines "
            f"{', '.join(TINKER_LOSSES)} (stable_reinforce's definition is unpublished)"
        )
    taken = _LOSSES[name][2]
    unknown = sorted(set(config) - set(taken))
    if unknown:
        raise UnsupportedLoss(
            f"loss_fn {name!r} takes loss_fn_config keys {list(taken)}, not {unknown}"
        )


def required_inputs(name: str) -> tuple[str, ...]:
    """The ``loss_fn_inputs`` the loss ``name`` reads (``target_tokens`` first)."""
    check_loss(name, {})
    return _LOSSES[name][1]


def tinker_loss(
    name: str, logp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]
) -> Tensor:
    """The elementwise loss [T] of the Tinker loss ``name`` for one datum: ``logp`` [T] the
    trainer's logprobs of its ``target_tokens``, ``inputs`` its ``loss_fn_inputs`` (each [T]),
    ``config`` the call's ``loss_fn_config``. Its sum is the datum's loss."""
    check_loss(name, config)
    fn, needed, _ = _LOSSES[name]
    for key in needed:
        if key not in inputs:
            raise UnsupportedLoss(f"loss_fn {name!r} needs loss_fn_inputs {list(needed)}")
        if inputs[key].shape != logp.shape:
            raise UnsupportedLoss(
                f"loss_fn_inputs[{key!r}] has shape {list(inputs[key].shape)}, not the "
                f"datum's {list(logp.shape)}"
            )
    values = {k: inputs[k].to(device=logp.device, dtype=logp.dtype) for k in needed[1:]}
    return fn(logp, values, dict(config))
