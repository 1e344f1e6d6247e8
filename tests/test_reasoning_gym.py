"""reasoning-gym datasets as tasks (``data.task=reasoning_gym:NAME``), with the real
reasoning-gym: rows with its answer format, disjoint deterministic splits, scored by the
dataset's own ``score_answer`` through the reward path training uses."""

import argparse
import asyncio
import contextlib
import io
import json

import pytest

from tests.conftest import run_cli
from trident.cli.data import register, task_names
from trident.config import load_config
from trident.data.loaders import load_split
from trident.rewards import RewardSum

COMPOSITE = {
    "datasets": [
        {"name": "chain_sum", "weight": 1.0, "config": {"min_terms": 2, "max_terms": 2}},
        {"name": "basic_arithmetic", "weight": 1.0, "config": {}},
    ]
}
# (dataset, task_kwargs, where a correct answer is when the dataset has no single reference)
DATASETS = [
    ("basic_arithmetic", {}, None),
    ("chain_sum", {"min_terms": 2, "max_terms": 3}, None),
    ("countdown", {}, None),
    ("propositional_logic", {}, "example_answer"),  # logic: many valid conclusions
    ("graph_color", {}, "possible_answer"),  # graphs: many valid colourings
    ("shortest_path", {}, None),
    ("composite", COMPOSITE, None),
]


def _data_overrides(name: str, kwargs: dict) -> list[str]:
    return [
        f"data.task=reasoning_gym:{name}",
        f"data.task_kwargs={json.dumps(kwargs)}",
        "data.num_train=40",
        "data.num_test=10",
    ]


def _correct_answer(row: dict, key: str | None) -> str:
    answer = row["answer"] if key is None else row["entry"]["metadata"][key]
    return answer if isinstance(answer, str) else json.dumps(answer)


@pytest.mark.parametrize(("name", "kwargs", "answer_in"), DATASETS)
def test_gym_task_rows_splits_and_scores(name, kwargs, answer_in):
    cfg = load_config([], _data_overrides(name, kwargs))  # reward.fns empty: the task's reward
    train = load_split(cfg.data, "train", seed=1)
    test = load_split(cfg.data, "test", seed=1)
    assert len(train) == 40 and len(test) == 10
    assert train == load_split(cfg.data, "train", seed=1)  # deterministic
    assert train != load_split(cfg.data, "train", seed=2)
    questions = [r["entry"]["question"] for r in train]
    assert len(set(questions)) == 40
    assert not set(questions) & {r["entry"]["question"] for r in test}  # disjoint splits
    system, user = train[0]["prompt"]
    assert system["role"] == "system" and "<answer>" in system["content"]  # its answer format
    assert user == {"role": "user", "content": train[0]["entry"]["question"]}

    rewards = RewardSum.from_config(cfg.reward)

    async def scores(rows, respond):
        return await asyncio.gather(*(rewards.score(respond(r), r) for r in rows))

    right = asyncio.run(scores(test, lambda r: f"<answer>{_correct_answer(r, answer_in)}</answer>"))
    wrong = asyncio.run(scores(test, lambda r: "<answer>no idea</answer>"))
    untagged = asyncio.run(scores(test, lambda r: _correct_answer(r, answer_in)))
    assert right == [(1.0, "ok")] * len(test), right
    # Some datasets give partial credit (propositional_logic 0.05-0.25, countdown 0.01).
    assert all(status == "ok" and score < 0.5 for score, status in wrong), wrong
    assert all(status == "ok" and score < 0.5 for score, status in untagged), untagged


def test_without_the_system_prompt_the_prompt_is_the_question_alone():
    overrides = [*_data_overrides("chain_sum", {}), "data.system_prompt=false"]
    (row,) = load_split(load_config([], overrides).data, "test", seed=1)[:1]
    assert row["prompt"] == [{"role": "user", "content": row["entry"]["question"]}]


def test_a_burst_of_checks_is_not_timed_out_waiting_for_a_worker():
    """An eval scores hundreds of responses at once on a few checker processes: the timeout
    bounds each check's work, not its wait in the queue nor a fresh worker's start-up (seen:
    125 of 1000 eval scores were infra_error on a cold pool before)."""
    cfg = load_config([], [*_data_overrides("chain_sum", {}), "reward.timeout_s=0.5"])
    rows = load_split(cfg.data, "train", seed=1) * 10  # 400 checks of ms each on 2-8 workers
    rewards = RewardSum.from_config(cfg.reward)

    async def burst():
        return await asyncio.gather(
            *(rewards.score(f"<answer>{r['answer']}</answer>", r) for r in rows)
        )

    assert asyncio.run(burst()) == [(1.0, "ok")] * len(rows)


def test_reasoning_gym_reward_by_name_and_not_applicable_elsewhere():
    cfg = load_config([], [*_data_overrides("chain_sum", {}), "reward.fns=[{name: reasoning_gym}]"])
    row = load_split(cfg.data, "test")[0]
    model = RewardSum.from_config(cfg.reward)
    assert asyncio.run(model.score(f"<answer>{row['answer']}</answer>", row)) == (1.0, "ok")
    # An arithmetic-task row is not a reasoning-gym row: not applicable, not a zero.
    assert asyncio.run(model.score("Answer: 3", {"task": "arithmetic", "answer": "3"})) == (
        None,
        "ok",
    )


def test_bad_gym_names_and_configs_fail_at_config_time():
    r = run_cli("train", "data.task=reasoning_gym:chain_su", "--dry-run", timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "did you mean reasoning_gym:chain_sum?" in r.stderr.strip().splitlines()[-1]
    r = run_cli(
        "train", "data.task=reasoning_gym:chain_sum", "data.task_kwargs={bogus: 1}", "--dry-run"
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "bogus" in r.stderr.strip().splitlines()[-1]


def test_data_list_names_every_task():
    names = task_names()
    assert {"arithmetic", "countdown", "code"} <= set(names)
    gym = [n for n in names if n.startswith("reasoning_gym:")]
    assert len(gym) >= 100 and "reasoning_gym:composite" in gym
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["data", "list"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert args.func(args) == 0
    assert [line.split("\t")[0] for line in out.getvalue().splitlines()] == names
