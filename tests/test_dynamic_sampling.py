"""DAPO's pipeline extras: dynamic sampling and overlong reward shaping, and the config that
turns them on.

The selection and refill logic is tested on plain Samples: ``collect_groups`` takes the function
that makes ``k`` groups, here one that hands out prepared groups in order (the real drivers pass
the vLLM rollout). A short real run of both on the SFT-warmed tiny model checks the wiring.
"""

from __future__ import annotations

import asyncio

import pytest

from trident.config import ConfigError, load_config
from trident.pipeline.rollout import (
    SignalFilter,
    StepBatch,
    collect_groups,
    has_signal,
    select_groups,
    shape_rewards,
    step_metrics,
    trainable,
)
from trident.sample import Sample


def _sample(
    group: str, k: int, reward: float | None, response: int = 2, status: str = "ok"
) -> Sample:
    n = 3 + response
    return Sample(
        id=f"{group}-{k}",
        group_id=group,
        token_ids=list(range(n)),
        loss_mask=[0] * 3 + [1] * response,
        logprobs=[0.0] * n,
        versions=[-1] * 3 + [0] * response,
        reward=reward,
        status=status,
    )


def _group(name: str, *rewards: float | None) -> list[Sample]:
    return [_sample(name, k, r) for k, r in enumerate(rewards)]


# -- selection ------------------------------------------------------------------------------------


def test_signal_means_two_scored_rewards_that_differ():
    assert has_signal(_group("a", 0.0, 1.0, 1.0))
    assert not has_signal(_group("b", 1.0, 1.0, 1.0))
    assert not has_signal(_group("c", 0.0, 0.0))
    assert not has_signal(_group("d", 1.0, None, None))  # infra errors have no reward
    assert not has_signal(_group("e", 0.5))
    assert has_signal(_group("f", 0.5, 0.5 + 1e-6))


def test_select_keeps_the_first_groups_with_signal_in_order():
    groups = [_group("a", 1, 1), _group("b", 0, 1), _group("c", 0, 0), _group("d", 1, 0)]
    groups += [_group("e", 0, 1)]
    kept, dropped = select_groups(groups, 2)
    assert [g[0].group_id for g in kept] == ["b", "d"]
    assert [g[0].group_id for g in dropped] == ["a", "c", "e"]


def test_trainable_drops_infra_errors_and_samples_without_model_tokens():
    ok = _sample("g", 0, 1.0)
    empty = _sample("g", 1, 0.0, response=0, status="truncated")
    infra = _sample("g", 2, None, status="infra_error")
    assert trainable([ok, empty, infra]) == [ok]
    assert trainable([ok, empty, infra], exclude_infra_errors=False) == [ok, infra]


class Prepared:
    """``make(k)`` for ``collect_groups``: the next ``k`` of a fixed list of groups."""

    def __init__(self, groups: list[list[Sample]]) -> None:
        self.groups, self.asked = list(groups), []

    async def __call__(self, k: int) -> list[list[Sample]]:
        self.asked.append(k)
        out, self.groups = self.groups[:k], self.groups[k:]
        return out


def _collect(groups, needed, **kw):
    make = Prepared(groups)
    return asyncio.run(collect_groups(make, needed, **kw)), make.asked


def test_without_dynamic_sampling_one_round_trains_everything_trainable():
    groups = [_group("a", 1, 1), _group("b", 0, 1)]
    groups[0].append(_sample("a", 9, 0.0, response=0))  # no model-written token
    batch, asked = _collect(groups, 2)
    assert asked == [2]
    assert [s.id for s in batch.train] == ["a-0", "a-1", "b-0", "b-1"]
    assert len(batch.generated) == 5 and batch.metrics == {"untrainable_samples": 1.0}


def test_dynamic_sampling_refills_until_enough_groups_have_signal():
    # round 1: 4 groups, 1 with signal (rate 1/4) -> round 2 asks ceil(3 / (1/4)) = 12, capped at 4
    flat = [_group(f"r1-{i}", 1, 1) for i in range(3)] + [_group("r1-s", 0, 1)]
    mixed = [_group("r2-a", 0, 0), _group("r2-s1", 1, 0), _group("r2-s2", 0, 1)]
    mixed += [_group("r2-s3", 0.2, 0.1)]
    batch, asked = _collect(flat + mixed + [_group("unused", 0, 1)], 4, dynamic=True, max_rounds=3)
    assert asked == [4, 4]
    assert sorted({s.group_id for s in batch.train}) == ["r1-s", "r2-s1", "r2-s2", "r2-s3"]
    assert len(batch.generated) == 16  # rollout metrics see every generated sample
    assert batch.metrics["dynamic_sampling/rounds"] == 2
    assert batch.metrics["dynamic_sampling/dropped_groups"] == 4
    assert batch.metrics["dynamic_sampling/kept_fraction"] == 0.5


def test_dynamic_sampling_asks_for_the_missing_groups_over_the_kept_rate():
    first = [_group("a", 0, 1), _group("b", 0, 1), _group("c", 1, 1), _group("d", 1, 1)]
    batch, asked = _collect(first + [_group(f"x{i}", 0, 1) for i in range(9)], 8, dynamic=True)
    # one round only (max_rounds=1): 6 of the 8 groups have signal, and that is the batch
    assert asked == [8] and batch.metrics["dynamic_sampling/kept_groups"] == 6
    batch, asked = _collect(first + [_group(f"x{i}", 0, 1) for i in range(9)], 3, max_rounds=3,
                            dynamic=True)  # fmt: skip
    assert asked == [3, 2]  # 2 of 3 kept (rate 2/3): ceil(1 / (2/3)) = 2
    assert len({s.group_id for s in batch.train}) == 3


def test_dynamic_sampling_gives_up_after_max_rounds():
    groups = [_group(f"g{i}", 1, 1) for i in range(6)] + [_group("late", 0, 1)]
    batch, asked = _collect(groups, 2, dynamic=True, max_rounds=3)
    assert asked == [2, 2, 2]
    # nothing had signal: the last round's groups are trained (zero advantages) so the step runs
    assert {s.group_id for s in batch.train} == {"g4", "g5"}
    assert batch.metrics["dynamic_sampling/kept_groups"] == 0
    assert batch.metrics["dynamic_sampling/kept_fraction"] == 0.0


def test_signal_filter_drops_at_most_limit_groups_in_a_row():
    f = SignalFilter(limit=2)
    flat, mixed = _group("f", 1, 1), _group("m", 0, 1)
    assert [f.keep(flat), f.keep(flat), f.keep(flat), f.keep(flat)] == [False, False, True, True]
    assert f.keep(mixed) and not f.keep(flat)  # signal resets the count
    assert f.metrics() == {
        "dynamic_sampling/dropped_groups": 3.0,
        "dynamic_sampling/kept_fraction": 0.5,
    }
    # counts since the last call; no kept fraction when no group was judged
    assert f.metrics() == {"dynamic_sampling/dropped_groups": 0.0}


# -- overlong shaping -----------------------------------------------------------------------------


def test_overlong_penalty_is_added_to_scored_rewards():
    algo = load_config([], ["algo.overlong_penalty=true", "algo.overlong_buffer=4"]).algo
    # L_max = 10, L_cache = 4: no penalty up to 6 tokens, then -1/4 per token, -1 at 10
    samples = [_sample("g", k, 1.0, response=n) for k, n in enumerate((3, 6, 7, 9, 10))]
    samples.append(_sample("g", 9, None, response=10, status="infra_error"))
    shape_rewards(samples, algo, max_len=10)
    assert [s.reward for s in samples] == [1.0, 1.0, 0.75, 0.25, 0.0, None]
    metrics = step_metrics(StepBatch(trainable(samples), samples), env=False)
    assert metrics["overlong/penalty_mean"] == pytest.approx(-2.0 / 5)
    assert metrics["overlong/penalized_fraction"] == pytest.approx(3 / 5)
    off = load_config([], []).algo
    plain = [_sample("g", 0, 1.0, response=10)]
    shape_rewards(plain, off, max_len=10)
    assert plain[0].reward == 1.0


# -- config ---------------------------------------------------------------------------------------


def test_dapo_extras_are_accepted_and_checked():
    cfg = load_config([], ["algo.name=dapo", "rollout.max_tokens=32"])
    assert cfg.algo.dynamic_sampling and cfg.algo.overlong_penalty
    assert cfg.response_budget == 32
    with pytest.raises(ConfigError, match="overlong_buffer=40 exceeds the response budget 16"):
        load_config([], ["algo.overlong_penalty=true", "algo.overlong_buffer=40"])
    env = ["env.name=calc_lookup", "env.max_response_tokens=96"]
    assert load_config([], [*env, "algo.name=dapo"]).response_budget == 96
    with pytest.raises(ConfigError, match="dynamic_sampling_rounds"):
        load_config([], ["pipeline.dynamic_sampling_rounds=0"])
