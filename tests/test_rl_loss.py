"""Golden-value tests of the per-micro-batch RL loss (``trident.algorithms.rl_loss``) in float64.

Each expected value is computed with a plain per-token Python loop from the formulas in the
module docstring (PPO's clipped surrogate, truncated importance weights, the entropy bonus, the
k3 KL to the reference, PPO's clipped value loss), independently of the vectorised helpers. The
last test pins the trainer's wiring on the tiny model: the loss ``PolicyWorker.train_step``
reports is the one :func:`rl_loss` gives for the same tensors.
"""

from __future__ import annotations

import math

import pytest
import torch

from trident.algorithms.rl_loss import LossSpec, RLLoss, add_sums, rl_loss

F64 = torch.float64

# Two sequences of four tokens; the second has a masked token (tool output) and padding.
MASK = [[1, 1, 1, 1], [1, 0, 1, 0]]
LOGP = [[-0.5, -1.2, -0.1, -2.0], [-0.7, -3.0, -0.4, -9.0]]
OLD = [[-0.7, -1.0, -0.6, -1.9], [-0.2, -2.0, -0.45, -1.0]]
ENGINE = [[-0.9, -1.1, -0.4, -2.5], [-0.1, -1.0, -0.5, -1.0]]
ADV = [[1.0, -0.5, 2.0, 0.3], [-1.5, 4.0, 0.8, 2.0]]
ENTROPY = [[1.1, 0.9, 0.2, 1.7], [0.6, 2.0, 0.3, 5.0]]
REF = [[-0.6, -1.5, -0.3, -2.2], [-0.5, -1.0, -0.9, -1.0]]
VALUES = [[0.1, 0.5, 0.9, -0.2], [0.4, 0.0, 1.2, 7.0]]
OLD_VALUES = [[0.0, 0.2, 1.3, 0.1], [0.1, 1.0, 1.0, 0.0]]
RETURNS = [[1.0, 0.3, 0.5, 0.0], [-0.5, 1.0, 2.0, 0.0]]
EPS_LOW, EPS_HIGH = 0.2, 0.28
# the whole batch has more tokens and sequences than this micro-batch
GLOBAL_TOKENS, GLOBAL_SEQS = 9, 3


def t(values: list) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def tokens() -> list[tuple[int, int]]:
    return [(i, j) for i, row in enumerate(MASK) for j, m in enumerate(row) if m]


def call(spec: LossSpec, *, grad: bool = False, **kw) -> tuple[RLLoss, torch.Tensor]:
    logp = t(LOGP).requires_grad_(grad)
    out = rl_loss(
        spec, logp, t(ENTROPY), t(OLD), t(ADV), t(MASK), t(ENGINE),
        global_tokens=GLOBAL_TOKENS, global_seqs=GLOBAL_SEQS, **kw,
    )  # fmt: skip
    return out, logp


def ppo_token(i: int, j: int, weight: float = 1.0) -> tuple[float, bool]:
    """PPO's pessimistic surrogate of one token (times its IS weight), and whether the clip
    removed its gradient."""
    ratio = math.exp(LOGP[i][j] - OLD[i][j])
    a = ADV[i][j]
    clipped = min(max(ratio, 1 - EPS_LOW), 1 + EPS_HIGH)
    loss = max(-a * ratio, -a * clipped)
    removed = (ratio > 1 + EPS_HIGH and a > 0) or (ratio < 1 - EPS_LOW and a < 0)
    return weight * loss, removed


def k3(logp: float, ref: float) -> float:
    d = ref - logp
    return math.exp(d) - d - 1


SPEC = LossSpec(clip_eps_low=EPS_LOW, clip_eps_high=EPS_HIGH, is_level="none")


def test_clipped_ppo_policy_loss_and_its_metric_sums():
    out, logp = call(SPEC, grad=True)
    loss = sum(ppo_token(i, j)[0] for i, j in tokens()) / GLOBAL_TOKENS
    assert out.policy.item() == pytest.approx(loss, rel=1e-12)
    assert out.value is None
    n = len(tokens())
    ratios = [math.exp(LOGP[i][j] - OLD[i][j]) for i, j in tokens()]
    removed = [ppo_token(i, j)[1] for i, j in tokens()]
    # approx_kl is k3 of KL(old || new): d = logp - old
    approx_kl = [
        math.exp(LOGP[i][j] - OLD[i][j]) - (LOGP[i][j] - OLD[i][j]) - 1 for i, j in tokens()
    ]
    expected = {
        "tokens": n,
        "loss": loss,
        "entropy": sum(ENTROPY[i][j] for i, j in tokens()),
        "clip_fraction": sum(removed),  # token means x tokens = token sums
        "ratio_mean": sum(ratios),
        "approx_kl": sum(approx_kl),
    }
    assert out.sums == pytest.approx(expected, rel=1e-12)
    assert 0 < sum(removed) < n  # the example has clipped and unclipped tokens
    # the gradient reaches exactly the unclipped tokens: d/dlogp (-A r) = -A r
    out.policy.backward()
    assert logp.grad is not None
    for i, row in enumerate(MASK):
        for j, m in enumerate(row):
            ratio, a = math.exp(LOGP[i][j] - OLD[i][j]), ADV[i][j]
            clipped_value = -a * min(max(ratio, 1 - EPS_LOW), 1 + EPS_HIGH)
            active = m and -a * ratio >= clipped_value and not ppo_token(i, j)[1]
            expected_grad = -a * ratio / GLOBAL_TOKENS if active else 0.0
            assert logp.grad[i, j].item() == pytest.approx(expected_grad, abs=1e-12), (i, j)


def test_truncated_importance_weights_multiply_the_token_losses():
    cap = 1.2
    spec = LossSpec(
        clip_eps_low=EPS_LOW,
        clip_eps_high=EPS_HIGH,
        is_level="token",
        is_mode="truncate",
        is_cap=cap,
    )
    out, _ = call(spec)
    weights = {(i, j): min(math.exp(OLD[i][j] - ENGINE[i][j]), cap) for i, j in tokens()}
    loss = sum(ppo_token(i, j, weights[i, j])[0] for i, j in tokens()) / GLOBAL_TOKENS
    assert out.policy.item() == pytest.approx(loss, rel=1e-12)
    truncated = sum(math.exp(OLD[i][j] - ENGINE[i][j]) > cap for i, j in tokens())
    gaps = [abs(OLD[i][j] - ENGINE[i][j]) for i, j in tokens()]
    assert 0 < truncated < len(tokens())
    assert out.sums["is_weight_mean"] == pytest.approx(sum(weights.values()), rel=1e-12)
    assert out.sums["is_clip_fraction"] == pytest.approx(truncated, rel=1e-12)
    assert out.sums["mismatch_abs_logp_diff_mean"] == pytest.approx(sum(gaps), rel=1e-12)
    assert out.sums["mismatch_abs_logp_diff_max"] == pytest.approx(max(gaps), rel=1e-12)  # a max


def test_entropy_bonus_is_subtracted():
    spec = LossSpec(clip_eps_low=EPS_LOW, clip_eps_high=EPS_HIGH, is_level="none", entropy_coef=0.1)
    out, _ = call(spec)
    policy = sum(ppo_token(i, j)[0] for i, j in tokens())
    bonus = sum(ENTROPY[i][j] for i, j in tokens())
    assert out.policy.item() == pytest.approx((policy - 0.1 * bonus) / GLOBAL_TOKENS, rel=1e-12)
    assert out.sums["loss"] == pytest.approx(out.policy.item(), rel=1e-15)


def test_entropy_bonus_with_sequence_mean_aggregation():
    spec = LossSpec(
        clip_eps_low=EPS_LOW,
        clip_eps_high=EPS_HIGH,
        is_level="none",
        entropy_coef=0.1,
        aggregation="seq_mean_token_mean",
    )
    out, _ = call(spec)
    total = 0.0
    for i, row in enumerate(MASK):
        valid = [j for j, m in enumerate(row) if m]
        total += sum(ppo_token(i, j)[0] - 0.1 * ENTROPY[i][j] for j in valid) / len(valid)
    assert out.policy.item() == pytest.approx(total / GLOBAL_SEQS, rel=1e-12)


def test_reference_kl_term_is_added():
    spec = LossSpec(clip_eps_low=EPS_LOW, clip_eps_high=EPS_HIGH, is_level="none", kl_coef=0.05)
    out, logp = call(spec, grad=True, ref_logp=t(REF))
    policy = sum(ppo_token(i, j)[0] for i, j in tokens())
    kl = sum(k3(LOGP[i][j], REF[i][j]) for i, j in tokens())
    assert out.policy.item() == pytest.approx((policy + 0.05 * kl) / GLOBAL_TOKENS, rel=1e-12)
    assert out.sums["kl_ref"] == pytest.approx(kl, rel=1e-12)
    # without a reference there is no KL term and no kl_ref
    assert "kl_ref" not in call(spec)[0].sums


def test_clipped_value_loss():
    clip = 0.2
    spec = LossSpec(is_level="none", value_clip=clip)
    values = t(VALUES).requires_grad_(True)
    out, _ = call(spec, values=values, old_values=t(OLD_VALUES), returns=t(RETURNS))
    total, clipped = 0.0, 0
    for i, j in tokens():
        v, v_old, r = VALUES[i][j], OLD_VALUES[i][j], RETURNS[i][j]
        v_clipped = v_old + min(max(v - v_old, -clip), clip)
        total += 0.5 * max((v - r) ** 2, (v_clipped - r) ** 2)
        clipped += (v_clipped - r) ** 2 > (v - r) ** 2
    assert out.value is not None
    assert out.value.item() == pytest.approx(total / GLOBAL_TOKENS, rel=1e-12)
    assert out.sums["value_loss"] == pytest.approx(total / GLOBAL_TOKENS, rel=1e-12)
    assert out.sums["value_clip_fraction"] == pytest.approx(clipped, rel=1e-12)
    assert 0 < clipped < len(tokens())
    out.value.backward()
    assert values.grad is not None and values.grad[1, 3].item() == 0.0  # padding: no gradient


def test_value_loss_needs_its_targets():
    with pytest.raises(ValueError, match="old_values and returns"):
        call(SPEC, values=t(VALUES))


def test_all_terms_together():
    spec = LossSpec(
        clip_eps_low=EPS_LOW,
        clip_eps_high=EPS_HIGH,
        is_level="token",
        is_cap=1.2,
        entropy_coef=0.1,
        kl_coef=0.05,
    )
    out, _ = call(spec, ref_logp=t(REF))
    total = 0.0
    for i, j in tokens():
        weight = min(math.exp(OLD[i][j] - ENGINE[i][j]), 1.2)
        total += ppo_token(i, j, weight)[0] - 0.1 * ENTROPY[i][j] + 0.05 * k3(LOGP[i][j], REF[i][j])
    assert out.policy.item() == pytest.approx(total / GLOBAL_TOKENS, rel=1e-12)


def test_micro_batches_sum_to_the_batch():
    """Two micro-batches (one row each) with the batch's counts add up to the one-batch loss and
    sums; maxima stay maxima."""
    spec = LossSpec(clip_eps_low=EPS_LOW, clip_eps_high=EPS_HIGH, is_level="token", kl_coef=0.05)
    grids = [t(x) for x in (LOGP, ENTROPY, OLD, ADV, MASK, ENGINE, REF)]
    n, s = len(tokens()), len(MASK)
    whole = rl_loss(spec, *grids[:6], ref_logp=grids[6], global_tokens=n, global_seqs=s)
    total: dict[str, float] = {}
    loss = 0.0
    for row in range(len(MASK)):
        part = [g[row : row + 1] for g in grids]
        out = rl_loss(spec, *part[:6], ref_logp=part[6], global_tokens=n, global_seqs=s)
        add_sums(total, out.sums)
        loss += out.policy.item()
    assert loss == pytest.approx(whole.policy.item(), rel=1e-12)
    assert total == pytest.approx(whole.sums, rel=1e-12)


def test_a_zero_mask_gives_a_zero_loss():
    """The trainer's zero-weight pass (it keeps the FSDP collectives in step) adds nothing."""
    spec = LossSpec(is_level="token", entropy_coef=0.1, kl_coef=0.05)
    zero = torch.zeros(2, 4, dtype=F64)
    out = rl_loss(
        spec, t(LOGP), t(ENTROPY), t(OLD), t(ADV), zero, t(ENGINE),
        global_tokens=GLOBAL_TOKENS, global_seqs=GLOBAL_SEQS, ref_logp=t(REF),
        values=t(VALUES), old_values=t(OLD_VALUES), returns=t(RETURNS),
    )  # fmt: skip
    assert out.policy.item() == 0.0 and out.value is not None and out.value.item() == 0.0
    assert all(v == 0.0 for v in out.sums.values()), out.sums


# -- the trainer's wiring, on the tiny model ---------------------------------------------------


def test_train_step_reports_the_rl_loss_of_its_tensors(tiny_model):
    """One mini-batch and one micro-batch: the loss ``train_step`` reports is ``rl_loss`` of the
    pre-step policy's logprobs and entropies, the batch's advantages and the step's settings."""
    from tests.test_algo_learning import BASE, make_samples
    from trident.cluster.net import free_port
    from trident.config import load_config
    from trident.train.batch import collate
    from trident.train.policy import PolicyWorker
    from trident.train.recompute import token_logprobs

    overrides = [f"model.path={tiny_model}", "algo.entropy_coef=0.01", "algo.is_level=token"]
    worker = PolicyWorker(load_config([], [*BASE, *overrides]), 0, 1, "127.0.0.1", free_port())
    try:
        samples = make_samples(worker.tokenizer, prompts=2, n=3)
        for s in samples:  # an engine that disagrees with the trainer: the IS weights matter
            s.logprobs = [-0.3 * m for m in s.loss_mask]
        full = collate(samples, worker.tokenizer.pad_token_id)
        with torch.no_grad():
            logp, entropy = token_logprobs(worker.model, full, with_entropy=True)
        assert entropy is not None
        adv, _, _ = worker.adv.compute(samples, full.mask, {})
        a = worker.cfg.algo
        spec = LossSpec(
            clip_eps_low=a.clip_eps_low,
            clip_eps_high=a.clip_eps_high,
            aggregation=a.aggregation,
            norm_tokens=worker.cfg.rollout.max_tokens,
            is_level=a.is_level,
            is_cap=a.is_cap,
            entropy_coef=a.entropy_coef,
        )
        n = int(full.mask.sum())
        expected = rl_loss(
            spec, logp, entropy, logp, adv, full.mask, full.engine_logp,
            global_tokens=n, global_seqs=len(samples),
        )  # fmt: skip
        metrics = worker.train_step(samples)
    finally:
        worker.shutdown()
    assert metrics["loss"] == pytest.approx(expected.sums["loss"], rel=1e-5, abs=1e-7)
    assert metrics["entropy"] == pytest.approx(expected.sums["entropy"] / n, rel=1e-5)
    assert metrics["is_weight_mean"] == pytest.approx(expected.sums["is_weight_mean"] / n, rel=1e-5)


@pytest.mark.parametrize(
    ("overrides", "budget"),
    [
        (["rollout.max_tokens=24"], 24),
        (["env.name=calc_lookup", "rollout.max_tokens=24", "env.max_response_tokens=200"], 200),
    ],
)
def test_the_length_normaliser_is_the_runs_response_budget(overrides, budget):
    """Dr. GRPO's L (``seq_mean_token_sum_norm``) is what one sample may write: the per-request
    ``rollout.max_tokens`` for single-turn tasks, ``env.max_response_tokens`` over a whole
    trajectory in environment mode (its turns may write far more than one request's cap)."""
    from trident.config import load_config
    from trident.train.policy import _loss_spec

    cfg = load_config([], ["algo.name=dr_grpo", *overrides])
    assert _loss_spec(cfg, 0.0).norm_tokens == budget


@pytest.mark.parametrize(("old_logprobs", "mini_batches"), [("engine", 1), ("recompute", 2)])
def test_skipping_zero_advantage_rows_changes_no_weight(tiny_model, old_logprobs, mini_batches):
    """``trainer.skip_zero_advantage``: rows whose advantages are all 0 get no forward or backward
    pass, and the weights after two steps are those of training every row: a step with some groups
    of equal rewards, then one where every group's rewards are equal (the optimizer still steps,
    on zero gradients, as AdamW's momentum moves the weights)."""
    from tests.test_algo_learning import BASE, make_samples
    from trident.cluster.net import free_port
    from trident.config import load_config
    from trident.train.policy import PolicyWorker

    def batches(tokenizer) -> list[list]:
        mixed = make_samples(tokenizer, prompts=3, n=4)
        for s, r in zip(mixed, [1.0] * 4 + [1.0, 0.0, 0.0, 1.0] + [0.0] * 4, strict=True):
            s.reward = r  # groups p0 and p2 without signal, p1 with
        flat = make_samples(tokenizer, prompts=2, n=4, seed=1)
        for s in flat:
            s.reward = 1.0
        return [mixed, flat]

    weights, metrics, passed = {}, {}, {}
    for skip in (False, True):
        overrides = [
            f"model.path={tiny_model}", f"trainer.skip_zero_advantage={str(skip).lower()}",
            f"algo.old_logprobs={old_logprobs}", f"trainer.mini_batches={mini_batches}",
            "trainer.weight_decay=0.1", "trainer.share_prompts=false",  # one pass per row counted
        ]  # fmt: skip
        worker = PolicyWorker(load_config([], [*BASE, *overrides]), 0, 1, "127.0.0.1", free_port())
        rows: list[int] = []

        def count(_module, _args, kwargs, rows=rows):
            if torch.is_grad_enabled():
                rows.append(kwargs["input_ids"].shape[0])

        worker.model.register_forward_pre_hook(count, with_kwargs=True)
        try:
            metrics[skip] = [worker.train_step(b) for b in batches(worker.tokenizer)]
            weights[skip] = {k: v.detach().clone() for k, v in worker.model.state_dict().items()}
        finally:
            worker.shutdown()
        passed[skip] = sum(rows)
    # every row passed: 12 + 8. Skipping, pi_old the engine's: group p1's 4 rows, then one
    # zero-weight pass of one row. Recomputing it, the first mini-batch (rows 0-5, then 0-3) is
    # forwarded whole for pi_old: 6 + p1's 2 rows in the second, then 4 + the zero-weight pass.
    assert passed[False] == 20
    assert passed[True] == (5 if old_logprobs == "engine" else 13)
    for key, value in weights[False].items():
        torch.testing.assert_close(weights[True][key], value, rtol=1e-5, atol=1e-6, msg=key)
    for off, on in zip(metrics[False], metrics[True], strict=True):
        assert on["loss"] == pytest.approx(off["loss"], rel=1e-5, abs=1e-7)
        assert on["grad_norm"] == pytest.approx(off["grad_norm"], rel=1e-5, abs=1e-7)
    if old_logprobs == "engine":  # the second step trained no token: no token mean
        assert math.isnan(metrics[True][1]["entropy"])
