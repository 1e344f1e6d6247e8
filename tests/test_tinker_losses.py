"""Golden-value tests of trident.algorithms.tinker_losses in float64.

The references are plain Python loops over lists, written from the formulas in Tinker's loss
docs (quoted in the module's docstring), independently of the vectorised code; a few literal
numbers are worked out by hand. Gradients are checked by ``torch.autograd.gradcheck`` where the
loss is smooth at the test points, and against the closed form where a stop-gradient makes the
numerical derivative differ on purpose (CISPO).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from trident.algorithms.tinker_losses import (
    TINKER_LOSSES,
    UnsupportedLoss,
    check_loss,
    cispo,
    cross_entropy,
    dro,
    importance_sampling,
    ppo,
    required_inputs,
    tinker_loss,
)

F64 = torch.float64


def tensor(values: list, grad: bool = False) -> torch.Tensor:
    return torch.tensor(values, dtype=F64, requires_grad=grad)


def close(actual: torch.Tensor, expected: list | float) -> None:
    expected_t = torch.tensor(expected, dtype=F64)
    assert torch.allclose(actual.detach().to(F64), expected_t, rtol=1e-12, atol=1e-12), (
        actual,
        expected_t,
    )


def rl_datum(seed: int, n: int = 9) -> tuple[list, list, list]:
    """logp, q, A with ratios on both sides of PPO's and CISPO's bounds, none on a bound."""
    rng = random.Random(seed)
    logp = [rng.uniform(-3.0, -0.1) for _ in range(n)]
    q = [lp + rng.choice([-1, 1]) * rng.uniform(0.02, 1.6) for lp in logp]
    advantages = [rng.choice([-1, 1]) * rng.uniform(0.1, 2.0) for _ in range(n)]
    return logp, q, advantages


# --- hand-written references ------------------------------------------------------------------


def ref_ppo(logp: list, q: list, adv: list, lo: float, hi: float) -> list:
    out = []
    for lp, lq, a in zip(logp, q, adv, strict=True):
        r = math.exp(lp - lq)
        out.append(-min(r * a, min(max(r, lo), hi) * a))
    return out


def ref_ppo_grad(logp: list, q: list, adv: list, lo: float, hi: float) -> list:
    """d l / d logp: -r A where the unclipped term is the smaller, else 0 (the clipped term is
    constant in logp)."""
    out = []
    for lp, lq, a in zip(logp, q, adv, strict=True):
        r = math.exp(lp - lq)
        out.append(-r * a if r * a <= min(max(r, lo), hi) * a else 0.0)
    return out


def ref_cispo(logp: list, q: list, adv: list, lo: float, hi: float) -> list:
    return [
        -min(max(math.exp(lp - lq), lo), hi) * lp * a
        for lp, lq, a in zip(logp, q, adv, strict=True)
    ]


def ref_dro(logp: list, q: list, adv: list, beta: float) -> list:
    return [-(lp * a - 0.5 * beta * (lp - lq) ** 2) for lp, lq, a in zip(logp, q, adv, strict=True)]


# --- values -----------------------------------------------------------------------------------


def test_cross_entropy_is_the_weighted_negative_logprob_sum():
    logp, weights = [-0.5, -1.25, -2.0, -0.1], [0.0, 0.5, 0.25, 1.0]
    loss = cross_entropy(tensor(logp), tensor(weights))
    close(loss, [0.0, 0.625, 0.5, 0.1])
    close(loss.sum(), 1.225)


def test_cross_entropy_with_weights_summing_to_one_per_example_is_the_mean_nll():
    """The cookbook's supervised datums: weights 1/n over an example's n completion tokens, 0
    on its prompt, so the sum over a batch of B examples is B times the mean per-example NLL."""
    rng = random.Random(0)
    examples = []
    for prompt, completion in ((2, 3), (1, 5), (4, 1)):
        logp = [rng.uniform(-4.0, -0.01) for _ in range(prompt + completion)]
        weights = [0.0] * prompt + [1.0 / completion] * completion
        examples.append((logp, weights, prompt))
    total = sum(float(cross_entropy(tensor(lp), tensor(w)).sum()) for lp, w, _ in examples)
    means = [-sum(lp[p:]) / len(lp[p:]) for lp, _, p in examples]
    assert total / len(examples) == pytest.approx(sum(means) / len(means), rel=1e-12)


def test_importance_sampling_matches_its_reference():
    logp, q, adv = rl_datum(1)
    expected = [-math.exp(lp - lq) * a for lp, lq, a in zip(logp, q, adv, strict=True)]
    close(importance_sampling(tensor(logp), tensor(q), tensor(adv)), expected)


def test_importance_sampling_on_policy_is_minus_the_advantage_sum_and_its_gradient_minus_a():
    logp, _, adv = rl_datum(2)
    lp = tensor(logp, grad=True)
    loss = importance_sampling(lp, tensor(logp), tensor(adv)).sum()
    close(loss, -sum(adv))
    loss.backward()
    assert lp.grad is not None
    close(lp.grad, [-a for a in adv])  # the REINFORCE gradient at r = 1


def test_ppo_matches_its_reference_and_hand_values():
    logp, q, adv = rl_datum(3)
    close(ppo(tensor(logp), tensor(q), tensor(adv)), ref_ppo(logp, q, adv, 0.8, 1.2))
    close(ppo(tensor(logp), tensor(q), tensor(adv), 0.5, 3.0), ref_ppo(logp, q, adv, 0.5, 3.0))
    # r = e^0.4 = 1.4918 > 1.2: A = 2 takes the clipped 2.4; A = -2 the unclipped -2.9836
    r = math.exp(0.4)
    close(ppo(tensor([0.4, 0.4]), tensor([0.0, 0.0]), tensor([2.0, -2.0])), [-2.4, 2 * r])


def test_ppo_thresholds_are_ratio_bounds_with_tinkers_defaults():
    """loss_fn_config's thresholds bound r itself (Tinker's ``torch.clamp(prob_ratio,
    clip_low_threshold, clip_high_threshold)``); by default [1 - 0.2, 1 + 0.2]."""
    logp, q, adv = rl_datum(4)
    inputs = {"target_tokens": torch.zeros(9, dtype=torch.long), "logprobs": tensor(q)}
    inputs["advantages"] = tensor(adv)
    close(tinker_loss("ppo", tensor(logp), inputs, {}), ref_ppo(logp, q, adv, 0.8, 1.2))
    config = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.5}
    close(tinker_loss("ppo", tensor(logp), inputs, config), ref_ppo(logp, q, adv, 0.9, 1.5))
    close(
        tinker_loss("cispo", tensor(logp), inputs, {}), ref_cispo(logp, q, adv, 0.0, 4.0)
    )  # CISPO's one-sided default


def test_cispo_matches_its_reference():
    logp, q, adv = rl_datum(5)
    close(cispo(tensor(logp), tensor(q), tensor(adv)), ref_cispo(logp, q, adv, 0.0, 4.0))
    close(cispo(tensor(logp), tensor(q), tensor(adv), 0.8, 1.2), ref_cispo(logp, q, adv, 0.8, 1.2))


def test_dro_matches_its_reference():
    logp, q, adv = rl_datum(6)
    close(dro(tensor(logp), tensor(q), tensor(adv), 0.05), ref_dro(logp, q, adv, 0.05))
    # on policy the penalty vanishes: -Σ logp A
    close(dro(tensor([-1.0]), tensor([-1.0]), tensor([3.0]), 7.0), [3.0])


# --- gradients --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["cross_entropy", "importance_sampling", "ppo", "dro"])
def test_gradients_of_the_smooth_losses_pass_gradcheck(name):
    logp, q, adv = rl_datum(7)
    weights = [abs(a) for a in adv]
    fns = {
        "cross_entropy": lambda lp: cross_entropy(lp, tensor(weights)),
        "importance_sampling": lambda lp: importance_sampling(lp, tensor(q), tensor(adv)),
        "ppo": lambda lp: ppo(lp, tensor(q), tensor(adv), 0.8, 1.2),
        "dro": lambda lp: dro(lp, tensor(q), tensor(adv), 0.3),
    }
    assert torch.autograd.gradcheck(lambda lp: fns[name](lp).sum(), (tensor(logp, grad=True),))


def test_ppo_gradient_is_zero_where_the_clip_binds():
    logp, q, adv = rl_datum(8)
    lp = tensor(logp, grad=True)
    ppo(lp, tensor(q), tensor(adv)).sum().backward()
    expected = ref_ppo_grad(logp, q, adv, 0.8, 1.2)
    assert lp.grad is not None
    close(lp.grad, expected)
    assert 0 < sum(g == 0.0 for g in expected) < len(expected)  # both cases occur


def test_cispo_gradient_is_the_detached_clipped_ratio_times_minus_a():
    """Not gradcheck: the stop-gradient makes the derivative differ from the numerical one on
    purpose. d l / d logp = -clip(r) A, nonzero even where the ratio is clipped."""
    logp, q, adv = rl_datum(9)
    lp = tensor(logp, grad=True)
    cispo(lp, tensor(q), tensor(adv), 0.8, 1.2).sum().backward()
    expected = [
        -min(max(math.exp(a - b), 0.8), 1.2) * c for a, b, c in zip(logp, q, adv, strict=True)
    ]
    assert lp.grad is not None
    close(lp.grad, expected)


# --- what is refused --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["stable_reinforce", "gspo", "custom", "nll"])
def test_a_loss_trident_does_not_define_is_one_clear_error_naming_those_it_does(name):
    with pytest.raises(UnsupportedLoss) as err:
        check_loss(name, {})
    assert name in str(err.value)
    for defined in TINKER_LOSSES:
        assert defined in str(err.value)
    assert TINKER_LOSSES == ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro")


def test_bad_configs_and_inputs_are_refused():
    logp = tensor([-1.0, -2.0])
    inputs = {"target_tokens": torch.zeros(2, dtype=torch.long), "logprobs": logp.clone()}
    inputs["advantages"] = tensor([1.0, 0.0])
    with pytest.raises(UnsupportedLoss, match="clip_low_treshold"):  # misspelt: not defaulted
        tinker_loss("ppo", logp, inputs, {"clip_low_treshold": 0.5})
    with pytest.raises(UnsupportedLoss, match="beta"):
        tinker_loss("dro", logp, inputs, {})
    with pytest.raises(UnsupportedLoss, match="weights"):
        tinker_loss("cross_entropy", logp, inputs, {})
    with pytest.raises(UnsupportedLoss, match="shape"):
        tinker_loss("importance_sampling", logp, {**inputs, "advantages": tensor([1.0])}, {})
    assert required_inputs("cross_entropy") == ("target_tokens", "weights")
