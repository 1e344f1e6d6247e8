"""Golden-value tests of trident.algorithms in float64.

Every reference below is written with plain Python loops over lists, from the formulas in
``reference/peers-mechanisms.md`` section 1.2, independently of the vectorised code. A few tests
also pin literal numbers worked out by hand, so that a misconception shared by a reference and
the implementation would still be caught.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from trident.algorithms import (
    AGGREGATIONS,
    ESTIMATORS,
    IS_LEVELS,
    POLICY_LOSSES,
    AdaptiveKLController,
    aggregate,
    approx_proximal_logp,
    compute_advantages,
    decoupled_ppo_loss,
    entropy_bonus,
    gae_advantages_and_returns,
    importance_weights,
    kl_estimate,
    kl_penalty_in_reward,
    loss_denominators,
    new_baseline_state,
    policy_loss,
    value_loss,
)

F64 = torch.float64
EPS = 1e-6

# Seven samples: groups of 3 and 2, two singleton groups; a response with a masked gap (tool
# output), a length-1 response and a fully masked row.
REWARDS = [1.0, 0.0, 0.5, 2.0, -1.0, 3.0, 0.7]
GROUPS = [0, 0, 0, 1, 1, 2, 7]
MASK = [
    [1, 1, 1, 0, 0],
    [1, 1, 1, 1, 1],
    [0, 1, 0, 1, 1],
    [1, 0, 0, 0, 0],
    [0, 0, 0, 0, 0],
    [1, 1, 0, 0, 0],
    [1, 1, 1, 1, 0],
]


def tensor(values: list) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def close(actual: torch.Tensor, expected: list | float, atol: float = 1e-10) -> None:
    expected_t = torch.tensor(expected, dtype=F64)
    assert torch.isfinite(actual).all(), actual
    assert torch.allclose(actual.to(F64), expected_t, rtol=1e-9, atol=atol), (actual, expected_t)


def rand_grid(seed: int, low: float, high: float, rows: int = 7, cols: int = 5) -> list:
    rng = random.Random(seed)
    return [[rng.uniform(low, high) for _ in range(cols)] for _ in range(rows)]


# --- hand-written references ------------------------------------------------------------------


def valid(mask_row: list) -> list[int]:
    return [t for t, m in enumerate(mask_row) if m]


def broadcast(per_seq: list, mask: list) -> list:
    return [[per_seq[i] if m else 0.0 for m in row] for i, row in enumerate(mask)]


def group_members(values: list, groups: list, i: int) -> list:
    return [values[j] for j in range(len(values)) if groups[j] == groups[i]]


def ref_grpo(rewards: list, groups: list, norm_std: bool) -> list:
    out = []
    for i, r in enumerate(rewards):
        members = group_members(rewards, groups, i)
        mean = sum(members) / len(members)
        std = 0.0
        if len(members) > 1:
            std = math.sqrt(sum((x - mean) ** 2 for x in members) / (len(members) - 1))
        out.append((r - mean) / (std + EPS) if norm_std else r - mean)
    return out


def ref_rloo(rewards: list, groups: list) -> list:
    out = []
    for i, r in enumerate(rewards):
        others = [rewards[j] for j in range(len(rewards)) if groups[j] == groups[i] and j != i]
        out.append(r - sum(others) / len(others) if others else 0.0)
    return out


def ref_returns(token_rewards: list, mask: list, gamma: float) -> list:
    out = []
    for rewards_row, mask_row in zip(token_rewards, mask, strict=True):
        row = [0.0] * len(mask_row)
        running = 0.0
        for t in reversed(valid(mask_row)):
            running = rewards_row[t] + gamma * running
            row[t] = running
        out.append(row)
    return out


def ref_outcome_on_last(rewards: list, mask: list) -> list:
    out = []
    for r, mask_row in zip(rewards, mask, strict=True):
        row = [0.0] * len(mask_row)
        if valid(mask_row):
            row[valid(mask_row)[-1]] = r
        out.append(row)
    return out


def ref_whiten(grid: list, mask: list, scale: bool = True) -> list:
    tokens = [grid[i][t] for i, row in enumerate(mask) for t in valid(row)]
    mean = sum(tokens) / len(tokens)
    std = math.sqrt(sum((x - mean) ** 2 for x in tokens) / len(tokens))
    out = []
    for i, row in enumerate(mask):
        denominator = std + EPS if scale else 1.0
        out.append([(grid[i][t] - mean) / denominator if m else 0.0 for t, m in enumerate(row)])
    return out


def ref_gae(rewards: list, values: list, mask: list, gamma: float, lam: float) -> tuple:
    advantages, returns = [], []
    for r, value_row, mask_row in zip(rewards, values, mask, strict=True):
        adv_row, ret_row = [0.0] * len(mask_row), [0.0] * len(mask_row)
        steps = valid(mask_row)
        next_value, next_adv = 0.0, 0.0
        for k in reversed(steps):
            reward = r if k == steps[-1] else 0.0
            delta = reward + gamma * next_value - value_row[k]
            next_adv = delta + gamma * lam * next_adv
            next_value = value_row[k]
            adv_row[k], ret_row[k] = next_adv, next_adv + value_row[k]
        advantages.append(adv_row)
        returns.append(ret_row)
    return advantages, returns


def ref_aggregate(loss: list, mask: list, mode: str, norm_tokens: int | None = None) -> float:
    per_seq = []
    for loss_row, mask_row in zip(loss, mask, strict=True):
        steps = valid(mask_row)
        if steps:
            per_seq.append((sum(loss_row[t] for t in steps), len(steps)))
    if not per_seq:
        return 0.0
    if mode == "token_mean":
        return sum(s for s, _ in per_seq) / sum(n for _, n in per_seq)
    if mode == "seq_mean_token_mean":
        return sum(s / n for s, n in per_seq) / len(per_seq)
    if mode == "seq_mean_token_sum":
        return sum(s for s, _ in per_seq) / len(per_seq)
    length = norm_tokens if norm_tokens is not None else len(mask[0])
    return sum(s for s, _ in per_seq) / len(per_seq) / length


def clip(x: float, low: float, high: float) -> float:
    return min(max(x, low), high)


def ref_token_losses(name: str, logp, old, adv, mask, el, eh, c=3.0) -> tuple[list, list]:
    """Per-token policy loss and 'clipped' flags."""
    losses, flags = [], []
    for i, mask_row in enumerate(mask):
        steps = valid(mask_row)
        seq_ratio = math.exp(sum(logp[i][t] - old[i][t] for t in steps) / max(len(steps), 1))
        loss_row, flag_row = [], []
        for t in range(len(mask_row)):
            ratio = math.exp(logp[i][t] - old[i][t])
            a = adv[i][t]
            if name == "gspo":
                ratio = seq_ratio
            if name in ("ppo_clip", "dual_clip", "gspo"):
                loss = -min(ratio * a, clip(ratio, 1 - el, 1 + eh) * a)
                flag = (ratio > 1 + eh and a > 0) or (ratio < 1 - el and a < 0)
                if name == "dual_clip" and a < 0:
                    loss = min(loss, -c * a)
            elif name == "cispo":
                loss = -clip(ratio, 1 - el, 1 + eh) * a * logp[i][t]
                flag = ratio < 1 - el or ratio > 1 + eh
            else:
                loss, flag = -a * logp[i][t], False
            loss_row.append(loss)
            flag_row.append(1.0 if flag else 0.0)
        losses.append(loss_row)
        flags.append(flag_row)
    return losses, flags


def ref_token_mean(grid: list, mask: list) -> float:
    return ref_aggregate(grid, mask, "token_mean")


# --- aggregation -------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_aggregate_golden(mode: str) -> None:
    loss = rand_grid(1, -2.0, 3.0)
    close(
        aggregate(tensor(loss), tensor(MASK), mode, norm_tokens=16),
        ref_aggregate(loss, MASK, mode, 16),
    )


def test_aggregate_literals() -> None:
    loss = tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = tensor([[1, 1, 1], [1, 0, 0]])
    close(aggregate(loss, mask, "token_mean"), 10 / 4)
    close(aggregate(loss, mask, "seq_mean_token_mean"), (2.0 + 4.0) / 2)
    close(aggregate(loss, mask, "seq_mean_token_sum"), (6.0 + 4.0) / 2)
    close(aggregate(loss, mask, "seq_mean_token_sum_norm", norm_tokens=10), 10 / (2 * 10))
    close(aggregate(loss, mask, "seq_mean_token_sum_norm"), 10 / (2 * 3))  # falls back to T


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_aggregate_fully_masked_is_zero_not_nan(mode: str) -> None:
    loss = tensor(rand_grid(2, -1.0, 1.0, rows=3))
    close(aggregate(loss, torch.zeros(3, 5, dtype=F64), mode), 0.0)


def test_aggregate_rejects_unknown_mode() -> None:
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(tensor([[1.0]]), tensor([[1.0]]), "sum_of_everything")


def test_loss_denominators() -> None:
    assert loss_denominators(tensor(MASK)) == (sum(map(sum, MASK)), 6)


# --- advantages --------------------------------------------------------------------------------


def advantages(estimator: str, rewards=REWARDS, groups=GROUPS, mask=MASK, **kw) -> torch.Tensor:
    group_ids = torch.tensor(groups, dtype=torch.long)
    return compute_advantages(estimator, tensor(rewards), group_ids, tensor(mask), eps=EPS, **kw)


@pytest.mark.parametrize("norm_std", [True, False])
def test_grpo_golden(norm_std: bool) -> None:
    expected = broadcast(ref_grpo(REWARDS, GROUPS, norm_std), MASK)
    close(advantages("grpo", norm_std=norm_std), expected)


def test_grpo_literal() -> None:
    # rewards 1,0,0,1: mean 0.5, sample std sqrt(1/3): A = +-0.5 * sqrt(3)
    a = advantages("grpo", rewards=[1.0, 0.0, 0.0, 1.0], groups=[0] * 4, mask=[[1]] * 4)
    half = 0.5 / (math.sqrt(1 / 3) + EPS)
    close(a[:, 0], [half, -half, -half, half])


def test_dr_grpo_golden() -> None:
    close(advantages("dr_grpo"), broadcast(ref_grpo(REWARDS, GROUPS, norm_std=False), MASK))
    close(advantages("dr_grpo", norm_std=True), broadcast(ref_grpo(REWARDS, GROUPS, False), MASK))


def test_rloo_golden_and_literal() -> None:
    close(advantages("rloo"), broadcast(ref_rloo(REWARDS, GROUPS), MASK))
    a = advantages("rloo", rewards=[1.0, 0.0, 0.0], groups=[3, 3, 3], mask=[[1]] * 3)
    close(a[:, 0], [1.0, -0.5, -0.5])


@pytest.mark.parametrize("gamma", [1.0, 0.9])
@pytest.mark.parametrize("norm_std", [True, False])
def test_reinforce_pp_golden(gamma: float, norm_std: bool) -> None:
    returns = ref_returns(ref_outcome_on_last(REWARDS, MASK), MASK, gamma)
    expected = ref_whiten(returns, MASK, scale=norm_std)
    close(advantages("reinforce_pp", gamma=gamma, norm_std=norm_std), expected)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_baseline_golden(gamma: float) -> None:
    centred = ref_grpo(REWARDS, GROUPS, norm_std=False)
    expected = ref_whiten(ref_returns(ref_outcome_on_last(centred, MASK), MASK, gamma), MASK)
    close(advantages("reinforce_pp_baseline", gamma=gamma), expected)


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0)])
def test_gae_golden(gamma: float, lam: float) -> None:
    values = rand_grid(3, -1.0, 1.0)
    ref_adv, ref_ret = ref_gae(REWARDS, values, MASK, gamma, lam)
    adv, ret = gae_advantages_and_returns(
        tensor(REWARDS), tensor(values), tensor(MASK), gamma=gamma, lam=lam
    )
    close(adv, ref_adv)
    close(ret, ref_ret)
    close(advantages("gae", values=tensor(values), gamma=gamma, lam=lam, norm_std=False), ref_adv)
    close(advantages("gae", values=tensor(values), gamma=gamma, lam=lam), ref_whiten(ref_adv, MASK))


def test_gae_monte_carlo_limit() -> None:
    # gamma = lam = 1: A_t = R - V_t, and the return is the final reward at every token.
    values = [[0.25, -0.5, 2.0]]
    adv, ret = gae_advantages_and_returns(
        tensor([1.0]), tensor(values), tensor([[1, 1, 1]]), gamma=1.0, lam=1.0
    )
    close(adv, [[0.75, 1.5, -1.0]])
    close(ret, [[1.0, 1.0, 1.0]])


def test_gae_needs_values() -> None:
    with pytest.raises(ValueError, match="values"):
        advantages("gae")


def test_running_baseline_literal_two_batches() -> None:
    state = new_baseline_state(decay=0.9)
    first = advantages(
        "running_baseline", rewards=[1.0, 0.0], groups=[5, 6], mask=[[1], [1]], baseline_state=state
    )
    close(first[:, 0], [0.5, -0.5])  # cold start: the global EMA starts at the batch mean 0.5
    assert state["per_prompt"] == {"5": 1.0, "6": 0.0}
    assert state["global"] == pytest.approx(0.5)
    second = advantages(
        "running_baseline",
        rewards=[1.0, 1.0, 0.2],
        groups=[6, 9, 5],
        mask=[[1]] * 3,
        baseline_state=state,
    )
    close(second[:, 0], [1.0 - 0.0, 1.0 - 0.5, 0.2 - 1.0])  # prompt 9 unseen -> global baseline
    assert state["per_prompt"]["6"] == pytest.approx(0.1)
    assert state["per_prompt"]["5"] == pytest.approx(0.9 * 1.0 + 0.1 * 0.2)
    assert state["per_prompt"]["9"] == pytest.approx(1.0)
    assert state["global"] == pytest.approx(0.9 * 0.5 + 0.1 * (2.2 / 3))


def test_running_baseline_golden_stream() -> None:
    rng = random.Random(4)
    batches = [
        ([rng.choice([0.0, 1.0]) for _ in range(7)], [rng.randrange(4) for _ in range(7)])
        for _ in range(5)
    ]
    decay, per_prompt, global_ema = 0.8, {}, None
    state = new_baseline_state(decay)
    for rewards, prompts in batches:
        if global_ema is None:
            global_ema = sum(rewards) / len(rewards)
        expected = [
            r - per_prompt.get(p, global_ema) for r, p in zip(rewards, prompts, strict=True)
        ]
        for r, p in zip(rewards, prompts, strict=True):
            per_prompt[p] = r if p not in per_prompt else decay * per_prompt[p] + (1 - decay) * r
        global_ema = decay * global_ema + (1 - decay) * sum(rewards) / len(rewards)
        got = advantages("running_baseline", rewards=rewards, groups=prompts, baseline_state=state)
        close(got, broadcast(expected, MASK))


def test_running_baseline_needs_state() -> None:
    with pytest.raises(ValueError, match="baseline_state"):
        advantages("running_baseline")


@pytest.mark.parametrize("estimator", [e for e in ESTIMATORS if e != "running_baseline"])
def test_all_equal_rewards_give_zero_advantages(estimator: str) -> None:
    values = tensor([[0.3] * 5] * 7)  # a critic that already predicts the reward exactly
    a = advantages(estimator, rewards=[0.3] * 7, values=values, gamma=1.0, lam=1.0, norm_std=True)
    close(a, [[0.0] * 5] * 7, atol=1e-8)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_singleton_group_has_zero_advantage(estimator: str) -> None:
    a = advantages(estimator, rewards=[4.0, 1.0, 2.0], groups=[0, 1, 1], mask=[[1, 1]] * 3)
    close(a[0], [0.0, 0.0])
    assert a[1].abs().sum() > 0


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_fully_masked_rows_are_finite_and_zero(estimator: str) -> None:
    kw = {"values": tensor(rand_grid(5, -1.0, 1.0)), "baseline_state": new_baseline_state()}
    a = advantages(estimator, **kw)
    close(a[4], [0.0] * 5)
    close(advantages(estimator, mask=[[0] * 5] * 7, **kw), [[0.0] * 5] * 7)


def test_unknown_estimator() -> None:
    with pytest.raises(ValueError, match="estimator"):
        advantages("ppo_magic")


# --- KL ---------------------------------------------------------------------------------------


def ref_kl(logp: float, ref_logp: float, kind: str) -> float:
    d = ref_logp - logp
    return {"k1": -d, "k2": d * d / 2, "k3": math.exp(d) - d - 1}[kind]


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_estimators_golden(kind: str) -> None:
    logp, ref = rand_grid(6, -4.0, -0.1), rand_grid(7, -4.0, -0.1)
    expected = [
        [ref_kl(a, b, kind) for a, b in zip(r1, r2, strict=True)]
        for r1, r2 in zip(logp, ref, strict=True)
    ]
    close(kl_estimate(tensor(logp), tensor(ref), kind), expected)


def test_kl_literals() -> None:
    logp, ref = tensor([math.log(0.5)]), tensor([math.log(0.25)])  # d = -log 2
    close(kl_estimate(logp, ref, "k1"), [math.log(2)])
    close(kl_estimate(logp, ref, "k2"), [math.log(2) ** 2 / 2])
    close(kl_estimate(logp, ref, "k3"), [0.5 - 1 + math.log(2)])


@pytest.mark.parametrize("kind", ["k1", "k3"])
def test_unbiased_estimators_average_to_exact_kl(kind: str) -> None:
    p, q = [0.5, 0.3, 0.2], [0.2, 0.2, 0.6]
    exact = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q, strict=True))
    per_token = kl_estimate(
        tensor([math.log(x) for x in p]), tensor([math.log(x) for x in q]), kind
    )
    close((tensor(p) * per_token).sum(), exact)


def test_kl_penalty_in_reward_golden() -> None:
    kl = rand_grid(8, 0.0, 0.5)
    expected = [
        [
            (REWARDS[i] if valid(row) and t == valid(row)[-1] else 0.0)
            - (0.1 * kl[i][t] if m else 0.0)
            for t, m in enumerate(row)
        ]
        for i, row in enumerate(MASK)
    ]
    token_rewards = kl_penalty_in_reward(tensor(REWARDS), tensor(kl), tensor(MASK), coef=0.1)
    close(token_rewards, expected)
    # token-level rewards feed the return-based estimators
    close(
        advantages("reinforce_pp", rewards=token_rewards.tolist()),
        ref_whiten(ref_returns(expected, MASK, 1.0), MASK),
    )


def test_adaptive_kl_controller_literal() -> None:
    controller = AdaptiveKLController(init_coef=0.1, target=6.0, horizon=10000)
    assert controller.update(12.0, 256) == pytest.approx(0.1 * (1 + 0.2 * 256 / 10000))
    assert controller.update(3.0, 256) == pytest.approx(
        0.1 * (1 + 0.2 * 0.0256) * (1 - 0.2 * 0.0256)
    )
    before = controller.value
    controller.update(6.3, 100)  # error 0.05, inside the clip
    assert controller.value == pytest.approx(before * (1 + 0.05 * 100 / 10000))


# --- policy losses -------------------------------------------------------------------------------

EL, EH = 0.2, 0.28


def loss_inputs(seed: int = 10, per_seq_adv: bool = False) -> tuple[list, list, list]:
    rng = random.Random(seed)
    logp = [[rng.uniform(-3.0, -0.1) for _ in range(5)] for _ in range(7)]
    shift = [rng.uniform(-0.3, 0.3) for _ in range(7)]
    old = [[x + shift[i] + rng.uniform(-0.3, 0.3) for x in row] for i, row in enumerate(logp)]
    if per_seq_adv:
        seq_adv = [rng.gauss(0, 1) for _ in range(7)]
        adv = [[seq_adv[i]] * 5 for i in range(7)]
    else:
        adv = [[rng.gauss(0, 1) for _ in range(5)] for _ in range(7)]
    return logp, old, adv


def run_loss(name: str, logp, old, adv, mask=MASK, **kw) -> tuple[torch.Tensor, dict, torch.Tensor]:
    logp_t = tensor(logp).requires_grad_(True)
    kw.setdefault("clip_eps_low", EL)
    kw.setdefault("clip_eps_high", EH)
    loss, metrics = policy_loss(name, logp_t, tensor(old), tensor(adv), tensor(mask), **kw)
    loss.backward()
    return loss, metrics, logp_t.grad


@pytest.mark.parametrize("mode", AGGREGATIONS)
@pytest.mark.parametrize("name", POLICY_LOSSES)
def test_policy_loss_golden(name: str, mode: str) -> None:
    logp, old, adv = loss_inputs(per_seq_adv=name == "gspo")
    token_losses, flags = ref_token_losses(name, logp, old, adv, MASK, EL, EH)
    loss, metrics, _ = run_loss(name, logp, old, adv, aggregation=mode, loss_scale_tokens=12)
    close(loss, ref_aggregate(token_losses, MASK, mode, 12))
    close(metrics["clip_fraction"], ref_token_mean(flags, MASK))
    ratios = [
        [math.exp(a - b) for a, b in zip(r1, r2, strict=True)]
        for r1, r2 in zip(logp, old, strict=True)
    ]
    close(metrics["ratio_mean"], ref_token_mean(ratios, MASK))
    close(
        metrics["approx_kl"],
        ref_token_mean([[r - 1 - math.log(r) for r in row] for row in ratios], MASK),
    )


def test_clipping_actually_happens_in_the_golden_data() -> None:
    # The golden tests above are only meaningful if the data exercise the clip branches.
    for name in ("ppo_clip", "gspo", "cispo"):
        logp, old, adv = loss_inputs(per_seq_adv=name == "gspo")
        if name == "gspo":
            _, flags = ref_token_losses(name, logp, old, adv, MASK, 0.05, 0.05)
        else:
            _, flags = ref_token_losses(name, logp, old, adv, MASK, EL, EH)
        assert 0 < ref_token_mean(flags, MASK) < 1, name


def test_dual_clip_golden_branch() -> None:
    # A negative advantage with a ratio far above c: the loss is capped at c |A|.
    loss, metrics, grad = run_loss(
        "dual_clip", [[0.0]], [[-2.0]], [[-1.5]], mask=[[1]], dual_clip_c=3.0
    )
    close(loss, 3.0 * 1.5)
    close(metrics["dual_clip_fraction"], 1.0)
    close(grad, [[0.0]])
    loss, _, _ = run_loss("ppo_clip", [[0.0]], [[-2.0]], [[-1.5]], mask=[[1]])
    close(loss, math.exp(2.0) * 1.5)


@pytest.mark.parametrize("name", [n for n in POLICY_LOSSES if n != "gspo"])  # GSPO: next test
def test_policy_loss_gradient_golden(name: str) -> None:
    """d loss / d logp under token_mean, derived by hand for each loss."""
    logp, old, adv = loss_inputs(seed=11)
    n_tokens = sum(map(sum, MASK))
    expected = []
    for i, row in enumerate(MASK):
        grad_row = []
        for t, m in enumerate(row):
            ratio, a = math.exp(logp[i][t] - old[i][t]), adv[i][t]
            if not m:
                grad_row.append(0.0)
                continue
            clipped = (ratio > 1 + EH and a > 0) or (ratio < 1 - EL and a < 0)
            if name in ("ppo_clip", "dual_clip"):
                g = 0.0 if clipped else -a * ratio
                if name == "dual_clip" and a < 0 and -a * clip(ratio, 1 - EL, 1 + EH) > -3.0 * a:
                    g = 0.0
            elif name == "cispo":
                g = -clip(ratio, 1 - EL, 1 + EH) * a
            else:
                g = -a
            grad_row.append(g / n_tokens)
        expected.append(grad_row)
    _, _, grad = run_loss(name, logp, old, adv)
    close(grad, expected)


def test_gspo_gradient_equals_sequence_level_gradient() -> None:
    # GSPO: grad of -(1/S) sum_i min(s_i A_i, clip(s_i) A_i), with d s_i / d logp_t = s_i / |y_i|.
    logp, old, adv = loss_inputs(seed=12, per_seq_adv=True)
    el = eh = 0.05
    seqs = [i for i, row in enumerate(MASK) if valid(row)]
    expected = [[0.0] * 5 for _ in MASK]
    for i in seqs:
        steps = valid(MASK[i])
        s = math.exp(sum(logp[i][t] - old[i][t] for t in steps) / len(steps))
        a = adv[i][0]
        if (s > 1 + eh and a > 0) or (s < 1 - el and a < 0):
            continue
        for t in steps:
            expected[i][t] = -a * s / len(steps) / len(seqs)
    _, _, grad = run_loss(
        "gspo", logp, old, adv, clip_eps_low=el, clip_eps_high=eh, aggregation="seq_mean_token_mean"
    )
    close(grad, expected)
    assert any(v == 0.0 for i in seqs for v in [expected[i][valid(MASK[i])[0]]])


def test_is_weights_scale_each_token() -> None:
    logp, old, adv = loss_inputs(seed=13)
    weights = rand_grid(14, 0.0, 2.0)
    token_losses, _ = ref_token_losses("ppo_clip", logp, old, adv, MASK, EL, EH)
    weighted = [
        [x * w for x, w in zip(r1, r2, strict=True)]
        for r1, r2 in zip(token_losses, weights, strict=True)
    ]
    loss, _, _ = run_loss("ppo_clip", logp, old, adv, is_weights=tensor(weights))
    close(loss, ref_token_mean(weighted, MASK))


@pytest.mark.parametrize("name", POLICY_LOSSES)
def test_equal_policies_ratio_one_no_clip(name: str) -> None:
    logp, _, adv = loss_inputs(seed=15)
    loss, metrics, _ = run_loss(name, logp, logp, adv)
    close(metrics["ratio_mean"], 1.0)
    close(metrics["clip_fraction"], 0.0)
    close(metrics["approx_kl"], 0.0)
    if name in ("ppo_clip", "dual_clip", "gspo"):
        close(loss, -ref_token_mean(adv, MASK))  # ratio 1: the surrogate is -A


@pytest.mark.parametrize("mode", AGGREGATIONS)
@pytest.mark.parametrize("name", POLICY_LOSSES)
def test_policy_loss_fully_masked_is_finite(name: str, mode: str) -> None:
    logp, old, adv = loss_inputs(seed=16)
    loss, metrics, grad = run_loss(name, logp, old, adv, mask=[[0] * 5] * 7, aggregation=mode)
    close(loss, 0.0)
    close(grad, [[0.0] * 5] * 7)
    for value in metrics.values():
        assert torch.isfinite(value).all()


def test_length_one_responses() -> None:
    logp, old, adv = [[-1.0], [-0.5]], [[-1.1], [-0.2]], [[0.7], [-1.2]]
    for mode in AGGREGATIONS:
        token_losses, _ = ref_token_losses("ppo_clip", logp, old, adv, [[1], [1]], EL, EH)
        loss, _, _ = run_loss("ppo_clip", logp, old, adv, mask=[[1], [1]], aggregation=mode)
        close(loss, ref_aggregate(token_losses, [[1], [1]], mode))


def test_unknown_policy_loss() -> None:
    with pytest.raises(ValueError, match="policy loss"):
        run_loss("trpo", [[0.0]], [[0.0]], [[1.0]], mask=[[1]])


@pytest.mark.parametrize("clip_range", [0.2, None])
@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean"])
def test_value_loss_golden(clip_range: float | None, mode: str) -> None:
    values, old, returns = rand_grid(20, -1, 1), rand_grid(21, -1, 1), rand_grid(22, -1, 1)
    token_losses, flags = [], []
    for v_row, o_row, r_row in zip(values, old, returns, strict=True):
        loss_row, flag_row = [], []
        for v, o, r in zip(v_row, o_row, r_row, strict=True):
            plain = (v - r) ** 2
            clipped = (
                plain if clip_range is None else (o + clip(v - o, -clip_range, clip_range) - r) ** 2
            )
            loss_row.append(0.5 * max(plain, clipped))
            flag_row.append(1.0 if clipped > plain else 0.0)
        token_losses.append(loss_row)
        flags.append(flag_row)
    loss, metrics = value_loss(
        tensor(values), tensor(old), tensor(returns), tensor(MASK), clip_range, mode
    )
    close(loss, ref_aggregate(token_losses, MASK, mode))
    close(metrics["value_clip_fraction"], ref_token_mean(flags, MASK))
    if clip_range is not None:
        assert ref_token_mean(flags, MASK) > 0


def test_entropy_bonus_golden() -> None:
    entropy = rand_grid(23, 0.0, 3.0)
    for mode in AGGREGATIONS:
        close(
            entropy_bonus(tensor(entropy), tensor(MASK), mode), ref_aggregate(entropy, MASK, mode)
        )


# --- gradient accumulation -----------------------------------------------------------------------


def tiny_policy_batch() -> tuple:
    gen = torch.Generator().manual_seed(0)
    batch, length, features, vocab = 8, 6, 4, 5
    x = torch.randn(batch, length, features, generator=gen, dtype=F64)
    tokens = torch.randint(0, vocab, (batch, length), generator=gen)
    lengths = [6, 1, 3, 5, 0, 2, 4, 6]  # unequal, one empty, one of length 1
    mask = torch.tensor(
        [[1.0 if t < n else 0.0 for t in range(length)] for n in lengths], dtype=F64
    )
    mask[3, 1] = 0.0  # a masked tool-output token inside a response
    old_logp = torch.randn(batch, length, generator=gen, dtype=F64) * 0.1 - 1.6
    adv = torch.randn(batch, 1, generator=gen, dtype=F64).expand(batch, length).clone()
    weight = torch.randn(features, vocab, generator=gen, dtype=F64)
    return x, tokens, mask, old_logp, adv, weight


def accumulated_gradient(name: str, mode: str, micro_batch: int | None) -> torch.Tensor:
    x, tokens, mask, old_logp, adv, weight = tiny_policy_batch()
    weight = weight.clone().requires_grad_(True)
    global_tokens, global_seqs = loss_denominators(mask)
    size = micro_batch or x.shape[0]
    for start in range(0, x.shape[0], size):
        rows = slice(start, start + size)
        width = int((mask[rows] > 0).nonzero()[:, 1].max().item()) + 1 if mask[rows].any() else 1
        cols = slice(0, width)  # each micro-batch is padded only to its own longest response
        logits = x[rows, cols] @ weight
        logp = torch.log_softmax(logits, -1).gather(-1, tokens[rows, cols, None]).squeeze(-1)
        loss, _ = policy_loss(
            name,
            logp,
            old_logp[rows, cols],
            adv[rows, cols],
            mask[rows, cols],
            clip_eps_low=0.2,
            clip_eps_high=0.28,
            aggregation=mode,
            loss_scale_tokens=6,
            global_tokens=global_tokens if micro_batch else None,
            global_seqs=global_seqs if micro_batch else None,
        )
        loss.backward()
    return weight.grad


@pytest.mark.parametrize("mode", AGGREGATIONS)
@pytest.mark.parametrize("name", ["ppo_clip", "gspo", "cispo"])
def test_grad_accumulation_4x2_equals_1x8(name: str, mode: str) -> None:
    whole = accumulated_gradient(name, mode, None)
    accumulated = accumulated_gradient(name, mode, 2)
    assert whole.abs().sum() > 0
    assert torch.allclose(accumulated, whole, rtol=1e-10, atol=1e-13)


def test_grad_accumulation_without_global_counts_differs() -> None:
    # Why the global denominators exist: summing per-micro-batch token means is not the batch mean.
    x, tokens, mask, old_logp, adv, weight = tiny_policy_batch()
    weight = weight.clone().requires_grad_(True)
    for start in range(0, 8, 2):
        rows = slice(start, start + 2)
        logp = torch.log_softmax(x[rows] @ weight, -1).gather(-1, tokens[rows, :, None]).squeeze(-1)
        loss, _ = policy_loss(
            "ppo_clip",
            logp,
            old_logp[rows],
            adv[rows],
            mask[rows],
            clip_eps_low=0.2,
            clip_eps_high=0.2,
        )
        (loss / 4).backward()
    assert not torch.allclose(weight.grad, accumulated_gradient("ppo_clip", "token_mean", None))


# --- importance correction ------------------------------------------------------------------------


def ref_importance(trainer, engine, mask, level, mode, cap, lower) -> tuple[list, float]:
    weights, affected, n_tokens = [], 0, 0
    for i, row in enumerate(mask):
        steps = valid(row)
        logs = [trainer[i][t] - engine[i][t] for t in steps]
        weight_row = [0.0] * len(row)
        for k, t in enumerate(steps):
            if level == "none":
                rho = 1.0
            elif level == "token":
                rho = math.exp(logs[k])
            elif level == "sequence":
                rho = math.prod(math.exp(x) for x in logs)
            else:
                rho = math.exp(sum(logs) / len(logs))
            out = level != "none" and (rho > cap or (lower is not None and rho < lower))
            if mode == "truncate":
                w = (
                    rho
                    if level == "none"
                    else min(rho, cap)
                    if lower is None
                    else clip(rho, lower, cap)
                )
            else:
                w = 0.0 if out else rho
            weight_row[t] = w
            affected += out
            n_tokens += 1
        weights.append(weight_row)
    return weights, affected / n_tokens


@pytest.mark.parametrize("lower", [None, 0.8])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
@pytest.mark.parametrize("level", IS_LEVELS)
def test_importance_weights_golden(level: str, mode: str, lower: float | None) -> None:
    trainer = rand_grid(30, -3.0, -0.1)
    rng = random.Random(31)
    engine = [[x + rng.uniform(-0.5, 0.5) for x in row] for row in trainer]
    cap = 1.3
    expected, fraction = ref_importance(trainer, engine, MASK, level, mode, cap, lower)
    weights, metrics = importance_weights(
        tensor(trainer), tensor(engine), tensor(MASK), level, mode, cap, lower
    )
    close(weights, expected)
    assert not weights.requires_grad
    key, other = ("is_clip_fraction", "is_mask_fraction")[:: 1 if mode == "truncate" else -1]
    close(metrics[key], fraction)
    close(metrics[other], 0.0)
    if level != "none":
        assert 0 < fraction < 1  # the data reach both sides of the band
    diffs = [abs(trainer[i][t] - engine[i][t]) for i, row in enumerate(MASK) for t in valid(row)]
    close(metrics["mismatch_abs_logp_diff_mean"], sum(diffs) / len(diffs))
    close(metrics["mismatch_abs_logp_diff_max"], max(diffs))
    k3 = [
        ref_kl(engine[i][t], trainer[i][t], "k3") for i, row in enumerate(MASK) for t in valid(row)
    ]
    close(metrics["mismatch_k3_kl"], sum(k3) / len(k3))
    close(metrics["is_weight_mean"], ref_token_mean(expected, MASK))


def test_importance_weights_literal() -> None:
    trainer = tensor([[math.log(0.6), math.log(0.5)]])
    engine = tensor([[math.log(0.2), math.log(0.5)]])  # token ratios 3 and 1
    mask = tensor([[1, 1]])
    close(importance_weights(trainer, engine, mask, "token", "truncate", 2.0)[0], [[2.0, 1.0]])
    close(importance_weights(trainer, engine, mask, "token", "mask", 2.0)[0], [[0.0, 1.0]])
    close(importance_weights(trainer, engine, mask, "sequence", "truncate", 5.0)[0], [[3.0, 3.0]])
    close(
        importance_weights(trainer, engine, mask, "geometric", "mask", 2.0)[0], [[math.sqrt(3)] * 2]
    )
    close(importance_weights(trainer, engine, mask, "geometric", "mask", 2.0, 1.8)[0], [[0.0, 0.0]])


@pytest.mark.parametrize("level", IS_LEVELS)
def test_importance_weights_equal_policies_and_empty_rows(level: str) -> None:
    logp = tensor(rand_grid(32, -3.0, -0.1))
    weights, metrics = importance_weights(logp, logp, tensor(MASK), level, "mask", 2.0, 0.5)
    close(weights, [[float(m) for m in row] for row in MASK])
    close(metrics["mismatch_k3_kl"], 0.0)
    weights, metrics = importance_weights(
        logp, logp + 1.0, torch.zeros(7, 5, dtype=F64), level, "mask", 2.0
    )
    close(weights, [[0.0] * 5] * 7)
    assert all(torch.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("dual", [None, 3.0])
def test_decoupled_ppo_golden(dual: float | None) -> None:
    logp, prox, adv = loss_inputs(seed=40)
    rng = random.Random(41)
    behav = [[x + rng.uniform(-0.6, 0.6) for x in row] for row in prox]
    cap = 1.5
    per_token = []
    for i, row in enumerate(MASK):
        loss_row = []
        for t in range(len(row)):
            w = min(math.exp(prox[i][t] - behav[i][t]), cap)
            r, a = math.exp(logp[i][t] - prox[i][t]), adv[i][t]
            surrogate = -min(r * a, clip(r, 1 - EL, 1 + EH) * a)
            if dual is not None and a < 0:
                surrogate = min(surrogate, -dual * a)
            loss_row.append(w * surrogate)
        per_token.append(loss_row)
    loss, metrics = decoupled_ppo_loss(
        tensor(logp), tensor(prox), tensor(behav), tensor(adv), tensor(MASK),
        clip_eps_low=EL, clip_eps_high=EH, behav_cap=cap, dual_clip_c=dual,
    )  # fmt: skip
    close(loss, ref_token_mean(per_token, MASK))
    assert 0 < metrics["is_clip_fraction"] < 1
    assert {"clip_fraction", "ratio_mean", "approx_kl", "mismatch_k3_kl"} <= metrics.keys()


def test_approx_proximal_logp_literal() -> None:
    behav, current = tensor([[-1.0, -2.0, -3.0]]), tensor([[-0.5, -1.0, -3.5]])
    versions = tensor([[2.0, 4.0, 5.0]])  # alpha = (4-2)/(5-2), (4-4)/(5-4), undefined -> 0
    out = approx_proximal_logp(behav, current, versions, prox_version=4, current_version=5)
    close(out, [[-1.0 + 2 / 3 * 0.5, -2.0, -3.0]])
    close(approx_proximal_logp(behav, current, 3.0, 4, 5), [[-0.75, -1.5, -3.25]])
    assert not out.requires_grad


def test_overlong_penalty_golden() -> None:
    from trident.algorithms import overlong_penalty

    def reference(length: int, max_len: int, buffer: int) -> float:  # DAPO eq. 13
        if length <= max_len - buffer:
            return 0.0
        if length <= max_len:
            return ((max_len - buffer) - length) / buffer
        return -1.0

    lengths = [0, 1, 12, 13, 14, 15, 16, 17, 40]
    for max_len, buffer in [(16, 4), (16, 16), (16, 1)]:
        out = overlong_penalty(torch.tensor(lengths), max_len, buffer)
        close(out, [reference(n, max_len, buffer) for n in lengths])
    close(overlong_penalty(torch.tensor([12, 14, 16, 20]), 16, 4), [0.0, -0.5, -1.0, -1.0])
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(torch.tensor([1]), 16, 0)
