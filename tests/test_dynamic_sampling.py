"""DAPO's pipeline extras: dynamic sampling (``SignalFilter``, with the buffer replacing every
dropped group by a fresh prompt's) and overlong reward shaping, and the config that turns them on.

The refill logic is tested on plain Samples through the real buffer and ``fill_batch``, with a
group maker that hands out prepared groups in order (the real drivers pass the vLLM rollout).
"""

from __future__ import annotations

import asyncio

import pytest

from trident.config import ConfigError, load_config
from trident.pipeline.buffer import GroupTicket, RolloutBuffer
from trident.pipeline.groups import SignalFilter, has_signal, shape_rewards, trainable
from trident.pipeline.metrics import overlong_metrics
from trident.pipeline.stages import fill_batch
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


def test_trainable_drops_infra_errors_and_samples_without_model_tokens():
    ok = _sample("g", 0, 1.0)
    empty = _sample("g", 1, 0.0, response=0, status="truncated")
    infra = _sample("g", 2, None, status="infra_error")
    assert trainable([ok, empty, infra]) == [ok]
    assert trainable([ok, empty, infra], exclude_infra_errors=False) == [ok, infra]


class Prepared:
    """A group maker for ``fill_batch``: the next of a fixed list of groups, filtered by a
    ``SignalFilter`` as the run harness filters real groups."""

    def __init__(self, groups: list[list[Sample]], limit: int) -> None:
        self.groups, self.made = list(groups), []
        self.signal = SignalFilter(limit)

    async def __call__(self, ticket: GroupTicket) -> list[Sample]:
        group = self.groups.pop(0)
        self.made.append(group[0].group_id)
        kept = trainable(group)
        return kept if kept and self.signal.keep(kept) else []


def _fill(groups: list[list[Sample]], needed: int, limit: int) -> tuple[list[str], Prepared]:
    async def main() -> list[Sample]:
        buffer = RolloutBuffer(needed, max_staleness=0)
        make = Prepared(groups, limit)
        await fill_batch(buffer, make, needed)
        return await buffer.next_batch(), make

    batch, make = asyncio.run(main())
    return sorted({s.group_id for s in batch}), make


def test_groups_without_signal_are_replaced_by_fresh_prompts():
    groups = [_group("a", 1, 1), _group("b", 0, 1), _group("c", 0, 0), _group("d", 1, 0)]
    groups += [_group("e", 0, 1), _group("f", 0, 1)]
    kept, make = _fill(groups, 3, limit=8)
    assert kept == ["b", "d", "e"]
    assert make.made == ["a", "b", "c", "d", "e"]  # two dropped, two replacements
    assert make.signal.metrics() == {
        "dynamic_sampling/dropped_groups": 2.0,
        "dynamic_sampling/kept_fraction": 0.6,
    }


def test_a_saturated_policy_cannot_stall_a_step():
    # every group has equal rewards: after `limit` drops in a row the next ones are trained on
    groups = [_group(f"g{i}", 1, 1) for i in range(6)]
    kept, make = _fill(groups, 2, limit=3)
    assert kept == ["g3", "g4"] and len(make.made) == 5


def test_a_group_with_nothing_trainable_is_replaced_without_dynamic_sampling():
    groups = [_group("a", 1, 1), [_sample("b", 0, None, status="infra_error")], _group("c", 0, 1)]
    kept, make = _fill(groups, 2, limit=0)
    assert kept == ["a", "c"] and make.made == ["a", "b", "c"]


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
    metrics = overlong_metrics(samples)
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
    with pytest.raises(ConfigError, match="dynamic_sampling_max_dropped"):
        load_config([], ["pipeline.dynamic_sampling_max_dropped=-1"])
