"""Environments: the registry, the built-in environments and their SFT data generators.

The demonstrations are checked by replaying them through the environments' own tools (a real
bubblewrap sandbox for the code interpreter): every tool output a demonstration teaches must be
what the live tool returns, and every demonstration must earn the full reward.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO
from trident.cli.envs import register
from trident.config import load_config
from trident.data.loaders import load_rows
from trident.data.tasks import split_of
from trident.envs import REGISTRY, env_rows, get_spec, make_env
from trident.envs.calc_lookup import CalcLookupEnv
from trident.envs.task import TaskEnv
from trident.models.load import load_tokenizer
from trident.tools.parsers import AssistantTurn, ToolCall
from trident.train.sft import encode_example

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")


def test_registry_lists_builtins_and_makes_fresh_envs():
    assert {"task", "calc_lookup", "code_interpreter"} <= set(REGISTRY)
    assert all(spec.description for spec in REGISTRY.values())
    a, b = make_env("calc_lookup"), make_env("calc_lookup")
    assert isinstance(a, CalcLookupEnv) and a is not b  # one per trajectory
    assert isinstance(make_env("trident.envs.task:TaskEnv", task="arithmetic"), TaskEnv)
    with pytest.raises(KeyError, match="unknown environment 'nope'; registered: .*calc_lookup"):
        make_env("nope")
    with pytest.raises(KeyError, match="no data generator"):
        env_rows("task", 1)
    assert get_spec("calc_lookup").data == "trident.envs.calc_lookup:make_rows"


def test_registry_is_lazy():
    code = (
        "import sys, trident.envs; "
        "print(any(m in sys.modules for m in ('trident.envs.code_interpreter', 'trident.sandbox.pool', 'torch')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _turn(message: dict) -> AssistantTurn:
    calls = [
        ToolCall(f"call_{i}", c["function"]["name"], c["function"]["arguments"])
        for i, c in enumerate(message.get("tool_calls", []))
    ]
    return AssistantTurn(text=message["content"], content=message["content"], tool_calls=calls)


async def _replay(env, row: dict, errors: bool = False) -> float:
    """Act out the row's demonstration in ``env``; tool outputs must match it (failed calls only
    with ``errors``). Returns the reward."""
    await env.reset(row)
    assert env.tools.schemas() == row["tools"]  # what SFT renders is what the model will see
    messages, reward, i = row["messages"], 0.0, 1
    while i < len(messages):
        turn = _turn(messages[i])
        results = await env.tools.run(turn.tool_calls)
        expected = messages[i + 1 : i + 1 + len(results)]
        assert [r.content for r in results] == [m["content"] for m in expected]
        assert [r.error for r in results] == [errors and m["content"].startswith("Error:")
                                              for m in expected]  # fmt: skip
        step = await env.step(turn, results)
        reward += step.reward or 0.0
        i += 1 + len(results)
        assert step.done == (i == len(messages))
    await env.close()
    return reward


def test_calc_lookup_rows_are_deterministic_disjoint_and_need_the_tools():
    rows = env_rows("calc_lookup", 50, "train", seed=1)
    assert rows == env_rows("calc_lookup", 50, "train", seed=1)
    assert all(split_of(r["prompt"]) == "train" for r in rows)
    test_prompts = {r["prompt"] for r in env_rows("calc_lookup", 20, "test", seed=1)}
    assert not test_prompts & {r["prompt"] for r in rows}
    for row in rows:
        assert asyncio.run(_replay(CalcLookupEnv(), row)) == 1.0
        calls = [m for m in row["messages"] if m["role"] == "assistant" and m.get("tool_calls")]
        names = [c["function"]["name"] for m in calls for c in m["tool_calls"]]
        assert names.count("lookup") == 2 and names.count("calc") == 1
        assert len(row["corpus"]) == 4  # two keys asked, two distractors
    parallel = sum(len(m.get("tool_calls", [])) == 2 for r in rows for m in r["messages"])
    assert 0 < parallel < len(rows)  # both parallel and one-call-per-turn demonstrations


def test_calc_lookup_data_options_make_it_easier_or_more_varied():
    options = dict(distractors=0, low=1, high=9, operations=["plus"], parallel_fraction=1.0)
    formats = ["Answer: {answer}", "= {answer}"]
    rows = env_rows("calc_lookup", 40, "train", seed=2, answer_formats=formats, **options)
    finals = [r["messages"][-1]["content"] for r in rows]
    rewards = [asyncio.run(_replay(CalcLookupEnv(), r)) for r in rows]
    for row, final, reward in zip(rows, finals, rewards, strict=True):
        assert len(row["corpus"]) == 2 and " plus " in row["prompt"]
        assert all(1 <= int(v) <= 9 for v in row["corpus"].values())
        assert len(row["messages"][1]["tool_calls"]) == 2  # both lookups in the first turn
        assert final in (f"Answer: {row['answer']}", f"= {row['answer']}")
        assert reward == float(final.startswith("Answer:"))  # only the required style earns
    assert 0 < sum(rewards) < len(rows)
    with pytest.raises(ValueError, match="operations"):
        env_rows("calc_lookup", 1, operations=["divide"])
    # a broken strategy mixed in: the calculator on the key names, refused, then giving up
    rows = env_rows("calc_lookup", 40, "train", seed=2, shortcut_fraction=0.5)
    broken = [r for r in rows if r["messages"][-1]["content"] == "I cannot tell."]
    assert 0 < len(broken) < len(rows)
    for row in broken:
        (call,) = row["messages"][1]["tool_calls"]
        assert call["function"]["name"] == "calc" and row["messages"][2]["content"].startswith(
            "Error:"
        )
        assert asyncio.run(_replay(CalcLookupEnv(), row, errors=True)) == 0.0


def test_calc_lookup_rewards_only_a_final_correct_answer():
    row = env_rows("calc_lookup", 1)[0]

    async def reward_of(text: str, calls: list[ToolCall] = ()) -> tuple[float | None, bool]:
        env = CalcLookupEnv()
        await env.reset(row)
        step = await env.step(AssistantTurn(text, text, list(calls)), [])
        return step.reward, step.done

    assert asyncio.run(reward_of(f"Answer: {row['answer']}")) == (1.0, True)
    assert asyncio.run(reward_of("Answer: 0")) == (0.0, True)
    assert asyncio.run(reward_of("I do not know")) == (0.0, True)
    call = ToolCall("c", "calc", {"expression": "1+1"})
    assert asyncio.run(reward_of(f"Answer: {row['answer']}", [call])) == (None, False)

    async def penalized() -> list[float | None]:
        env = CalcLookupEnv(tool_error_penalty=0.25)
        await env.reset(row)
        calls = [ToolCall("a", "lookup", {"key": "??"}), ToolCall("b", "calc", {"expression": "2*3"}),
                 ToolCall("c", "nope", {}), ToolCall("d", "lookup", {}, error="not valid JSON")]  # fmt: skip
        failing = await env.step(AssistantTurn("", "", calls), await env.tools.run(calls))
        fine = await env.step(AssistantTurn("", "", calls[1:2]), await env.tools.run(calls[1:2]))
        return [failing.reward, fine.reward]

    assert asyncio.run(penalized()) == [-0.75, None]  # three of the four calls failed


def test_task_env_scores_with_the_task_verifier():
    async def main() -> list[float | None]:
        env = make_env("task")
        row = {"prompt": "12+30", "answer": "42", "task": "arithmetic"}
        assert await env.reset(row) == [{"role": "user", "content": "12+30"}]
        good = await env.step(AssistantTurn("Answer: 42", "Answer: 42"), [])
        bad = await env.step(AssistantTurn("Answer: 41", "Answer: 41"), [])
        assert good.done and bad.done and len(env.tools) == 0
        return [good.reward, bad.reward]

    assert asyncio.run(main()) == [1.0, 0.0]


@needs_bwrap
def test_code_env_demonstrations_run_in_a_real_sandbox():
    from trident.sandbox.pool import SandboxPool

    rows = env_rows("code_interpreter", 6, "train", seed=0)
    with SandboxPool(max_concurrency=2) as pool:

        async def main() -> list[float]:
            return list(
                await asyncio.gather(
                    *(_replay(make_env("code_interpreter", sandbox=pool), r) for r in rows)
                )
            )

        assert asyncio.run(main()) == [1.0] * len(rows)
        assert pool.open_sessions == 0  # every episode closed its session


@needs_bwrap
def test_code_env_keeps_state_and_reports_errors_to_the_model():
    async def main() -> list[str]:
        # No sandbox given: the env starts (and closes) a private pool.
        env = make_env("code_interpreter", kinds=("python", "bash"))
        await env.reset({"prompt": "x", "answer": "1"})
        calls = [
            ToolCall("c0", "python", {"code": "x = 6 * 7"}),
            ToolCall("c1", "python", {"code": "x"}),
            ToolCall("c2", "python", {"code": "1/0"}),
            ToolCall("c3", "bash", {"code": "echo hi; exit 3"}),
        ]
        out = [(await env.tools.run_one(c)).content for c in calls]
        await env.close()
        return out

    set_x, read_x, error, bash = asyncio.run(main())
    assert set_x == "[no output]" and read_x == "42"
    assert "ZeroDivisionError" in error and error.endswith("[exit code 1]")
    assert bash == "hi\n[exit code 3]"


def test_sft_rows_from_the_cli(tiny_model, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["env", "list"])
    assert args.func(args) == 0
    assert "calc_lookup" in capsys.readouterr().out
    out = tmp_path / "calc.jsonl"
    args = parser.parse_args(["env", "data", "calc_lookup", str(out), "--n", "4"])
    assert args.func(args) == 0
    rows = load_rows(out)
    assert len(rows) == 4 and rows == env_rows("calc_lookup", 4)
    lean = tmp_path / "lean.jsonl"
    options = '{"distractors": 0}'
    args = parser.parse_args(["env", "data", "calc_lookup", str(lean), "--n", "2", "--no-tools",
                              "--options", options])  # fmt: skip
    assert args.func(args) == 0
    assert load_rows(lean) == env_rows("calc_lookup", 2, show_tools=False, distractors=0)
    assert all("tools" not in r and len(r["corpus"]) == 2 for r in load_rows(lean))
    # a recipe's env.data_kwargs and env.show_tools; --options still override
    recipe = REPO / "configs" / "agent_demo.yaml"
    env = load_config([recipe]).env
    args = parser.parse_args(["env", "data", "calc_lookup", str(lean), "--n", "3", "-c",
                              str(recipe), "--options", options])  # fmt: skip
    assert args.func(args) == 0
    expected = env_rows("calc_lookup", 3, show_tools=env.show_tools,
                        **(env.data_kwargs | {"distractors": 0}))  # fmt: skip
    assert load_rows(lean) == expected and not env.show_tools
    # `trident sft` trains on every assistant turn of a row's demonstration.
    tokenizer = load_tokenizer(tiny_model)
    ids, mask = encode_example(tokenizer, rows[0])
    trained = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert trained.count("<tool_call>") == 3 and f"Answer: {rows[0]['answer']}" in trained
