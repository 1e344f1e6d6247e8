"""Environment adapters: verifiers and OpenEnv environments as trident environments.

The frameworks are optional extras (``pip install 'trident[verifiers]'``, ``'trident[openenv]'``);
the tests of one adapter skip, with the reason, when its extra is missing. The environments are
small ones built here: verifiers ``SingleTurnEnv`` (exact-match rubric), ``ToolEnv`` (a Python
tool) and ``MultiTurnEnv`` (a guessing game with its own stop condition); an OpenEnv
guess-the-number ``Environment`` served by OpenEnv's own FastAPI app on localhost (uvicorn in a
thread) or run in-process. The adapters are driven with fixed assistant turns, and once each
through the real agent loop with a scripted engine (fixed texts tokenized by the tiny model's
tokenizer; no vLLM).
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import sys
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from trident.agent.loop import AgentConfig, run_trajectory
from trident.models.load import load_tokenizer
from trident.rollout.engine import Completion, SamplingParams
from trident.sandbox import InfraError
from trident.tools.parsers import AssistantTurn, ToolCall


def _turn(content: str = "", calls: tuple[tuple[str, dict], ...] = ()) -> AssistantTurn:
    tool_calls = [ToolCall(id=f"call_{i}", name=n, arguments=a) for i, (n, a) in enumerate(calls)]
    return AssistantTurn(text=content, content=content, tool_calls=tool_calls)


def _call_text(name: str, arguments: dict) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


class ScriptedEngine:
    """A rollout engine whose turns are fixed texts (each ends with the EOS token)."""

    def __init__(self, tokenizer, texts: list[str]) -> None:
        self.tokenizer, self.texts = tokenizer, list(texts)

    async def generate(self, prompt_ids, params, session_id=None) -> list[Completion]:
        ids = self.tokenizer.encode(self.texts.pop(0), add_special_tokens=False)
        ids.append(self.tokenizer.eos_token_id)
        return [Completion(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop")]


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return load_tokenizer(tiny_model)


def _run(tokenizer, env, row, texts: list[str]):
    engine = ScriptedEngine(tokenizer, texts)
    params = SamplingParams(temperature=0.0, max_tokens=64, seed=0)
    config = AgentConfig(max_turns=6, max_response_tokens=512, max_total_tokens=2048)

    async def go():
        try:
            return await run_trajectory(
                engine, tokenizer, env, row, params, 0, sample_id="s", group_id="g", config=config
            )
        finally:
            await env.close()

    return asyncio.run(go())


# -- missing extras ------------------------------------------------------------------------------


def test_missing_extras_name_the_install(monkeypatch):
    from trident.envs.adapters.openenv_env import OpenEnvEnv
    from trident.envs.adapters.verifiers_env import VerifiersEnv

    monkeypatch.setitem(sys.modules, "verifiers", None)
    with pytest.raises(ImportError, match=r"pip install 'trident\[verifiers\]'"):
        VerifiersEnv(env="some-env")
    monkeypatch.setitem(sys.modules, "openenv.core", None)
    with pytest.raises(ImportError, match=r"pip install 'trident\[openenv\]'"):
        OpenEnvEnv(url="http://127.0.0.1:1")


# -- verifiers -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vf():
    vf = pytest.importorskip(
        "verifiers", reason="needs the extra: pip install 'trident[verifiers]'"
    )
    if not hasattr(vf, "MultiTurnEnv"):
        pytest.skip(f"verifiers {vf.__version__} has no classic vf.Environment API (0.2-0.3)")
    return vf


def exact(parser, completion, answer) -> float:
    """The last assistant message is exactly the answer."""
    return float((parser.parse_answer(completion) or "").strip() == answer)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


VF_DATA = [
    {"question": "What is 2 + 3?", "answer": "5"},
    {"question": "What is 4 + 4?", "answer": "8"},
]


def make_vf_envs(vf) -> SimpleNamespace:
    from datasets import Dataset

    class GuessGame(vf.MultiTurnEnv):
        """Guess the answer; the environment says higher or lower until the guess is right."""

        async def env_response(self, messages, state, **kwargs):
            guess = int(messages[-1]["content"].strip())
            hint = "higher" if guess < int(state["answer"]) else "lower"
            return [{"role": "user", "content": f"Try {hint}."}]

        @vf.stop
        async def guessed(self, state) -> bool:
            trajectory = state["trajectory"]
            return bool(trajectory) and (
                trajectory[-1]["completion"][-1]["content"].strip() == state["answer"]
            )

    data = Dataset.from_list(VF_DATA)

    def rubric():
        return vf.Rubric(funcs=[exact])

    return SimpleNamespace(
        single=vf.SingleTurnEnv(
            dataset=data, system_prompt="Reply with a number.", rubric=rubric()
        ),
        tools=vf.ToolEnv(dataset=data, tools=[add], max_turns=4, rubric=rubric()),
        game=GuessGame(dataset=data, max_turns=5, rubric=rubric()),
    )


@pytest.fixture(scope="module")
def vf_envs(vf) -> SimpleNamespace:
    return make_vf_envs(vf)


def _vf_row(vf_env, i: int = 0) -> dict:
    return dict(vf_env.get_dataset()[i])


def test_verifiers_single_turn_is_scored_by_its_rubric(vf_envs):
    from trident.envs.adapters.verifiers_env import VerifiersEnv

    async def episode(answer: str):
        env = VerifiersEnv(env=vf_envs.single)
        try:
            messages = await env.reset(_vf_row(vf_envs.single))
            return messages, env.tools.schemas(), await env.step(_turn(answer), [])
        finally:
            await env.close()

    messages, schemas, right = asyncio.run(episode("5"))
    assert messages == [
        {"role": "system", "content": "Reply with a number."},
        {"role": "user", "content": "What is 2 + 3?"},
    ]
    assert schemas == []
    assert right.done and right.reward == 1.0 and right.observations == []
    assert right.metrics["exact"] == 1.0 and right.metrics["num_turns"] == 1.0
    _, _, wrong = asyncio.run(episode("6"))
    assert wrong.done and wrong.reward == 0.0


def test_verifiers_tool_env_runs_its_tools_and_shows_their_schemas(vf_envs):
    from trident.envs.adapters.verifiers_env import VerifiersEnv

    async def episode():
        env = VerifiersEnv(env=vf_envs.tools)
        try:
            await env.reset(_vf_row(vf_envs.tools))
            call = _turn(calls=(("add", {"a": 2, "b": 3}),))
            results = await env.tools.run(call.tool_calls)  # the environment runs the calls
            first = await env.step(call, results)
            last = await env.step(_turn("5"), [])
            return env.tools.schemas(), results, first, last
        finally:
            await env.close()

    schemas, results, first, last = asyncio.run(episode())
    (schema,) = schemas
    assert schema["function"]["name"] == "add"
    assert schema["function"]["parameters"]["required"] == ["a", "b"]
    assert results == []
    assert first.observations == [
        {"role": "tool", "tool_call_id": "call_0", "name": "add", "content": "5"}
    ]
    assert not first.done and first.reward is None
    assert last.done and last.reward == 1.0
    assert last.metrics["add_calls"] == 1.0 and last.metrics["num_turns"] == 2.0


def test_verifiers_multi_turn_env_response_and_stop_condition(vf_envs):
    from trident.envs.adapters.verifiers_env import VerifiersEnv

    async def episode():
        env = VerifiersEnv(env=vf_envs.game)
        try:
            await env.reset(_vf_row(vf_envs.game, 1))  # the answer is 8
            return [await env.step(_turn(guess), []) for guess in ("3", "9", "8")], env.state
        finally:
            await env.close()

    (low, high, right), state = asyncio.run(episode())
    assert low.observations == [{"role": "user", "content": "Try higher."}] and not low.done
    assert high.observations == [{"role": "user", "content": "Try lower."}] and not high.done
    assert right.done and right.reward == 1.0 and right.metrics["num_turns"] == 3.0
    assert state["stop_condition"] == "guessed"


def test_verifiers_close_mid_episode_cancels_the_rollout(vf_envs):
    from trident.envs.adapters.verifiers_env import VerifiersEnv

    async def episode():
        env = VerifiersEnv(env=vf_envs.game)
        await env.reset(_vf_row(vf_envs.game))
        await env.step(_turn("1"), [])
        task = env._task
        await env.close()
        return task

    task = asyncio.run(episode())
    assert task.done() and task.cancelled()


def test_verifiers_environment_by_name_and_its_rows(vf, tmp_path, monkeypatch):
    from trident.envs.adapters.verifiers_env import VerifiersEnv, load_environment, make_rows

    (tmp_path / "tiny_vf_env.py").write_text(
        "import verifiers as vf\n"
        "from datasets import Dataset\n"
        "def load_environment(n=2):\n"
        "    rows = [{'question': f'{i} + {i}?', 'answer': str(2 * i)} for i in range(n)]\n"
        "    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows),\n"
        "                            eval_dataset=Dataset.from_list(rows[:1]))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    name, args = "tiny_vf_env:load_environment", {"n": 5}
    rows = make_rows(3, "train", 0, env=name, env_args=args)
    assert len(rows) == 3 and all(r["prompt"][-1]["role"] == "user" for r in rows)
    assert len(make_rows(3, "test", 0, env=name, env_args=args)) == 1
    assert make_rows(3) == []  # no environment named: no rows (the registry's listing calls)
    assert VerifiersEnv(env=name, env_args=args).vf_env is load_environment(name, args)  # cached


def test_verifiers_env_through_the_agent_loop(vf_envs, tokenizer):
    from trident.envs.adapters.verifiers_env import VerifiersEnv

    env = VerifiersEnv(env=vf_envs.tools)
    texts = [_call_text("add", {"a": 2, "b": 3}), "5"]
    sample = _run(tokenizer, env, _vf_row(vf_envs.tools), texts)
    assert sample.status == "ok" and sample.reward == 1.0
    assert sample.metrics["turns"] == 2 and sample.metrics["tool_calls"] == 1
    assert sample.metrics["env/add_calls"] == 1.0 and sample.metrics["token_drift"] == 0.0
    roles = [m["role"] for m in sample.metadata["messages"]]
    assert roles == ["user", "assistant", "tool", "assistant"]
    assert sample.metadata["messages"][2]["content"] == "5"


# -- OpenEnv -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def guess():
    """A guess-the-number OpenEnv environment: the number (1-10) follows from the reset seed."""
    pytest.importorskip("openenv.core", reason="needs the extra: pip install 'trident[openenv]'")
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation, State
    from pydantic import Field

    class GuessAction(Action):
        message: str = Field(..., description="A whole number from 1 to 10.")

    class GuessObservation(Observation):
        feedback: str = ""

    class GuessEnv(Environment[GuessAction, GuessObservation, State]):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self) -> None:
            super().__init__()
            self._state, self.target = State(step_count=0), 0

        def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
            self._state, self.target = State(step_count=0), target(seed)
            return GuessObservation(feedback="Guess a number from 1 to 10.")

        def step(self, action, timeout_s=None, **kwargs) -> GuessObservation:
            self._state.step_count += 1
            out_of_turns = self._state.step_count >= 4
            text = action.message.strip()
            if not text.isdigit():
                return GuessObservation(feedback="Not a number.", reward=0.0, done=out_of_turns)
            if int(text) == self.target:
                return GuessObservation(feedback="Correct!", reward=1.0, done=True)
            hint = "higher" if int(text) < self.target else "lower"
            return GuessObservation(feedback=f"Try {hint}.", reward=0.0, done=out_of_turns)

        @property
        def state(self) -> State:
            return self._state

    return SimpleNamespace(Env=GuessEnv, Action=GuessAction, Observation=GuessObservation)


def target(seed: int | None) -> int:
    return random.Random(seed).randint(1, 10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def guess_url(guess) -> Iterator[str]:
    """The environment served by OpenEnv's own app on localhost."""
    import uvicorn
    from openenv.core.env_server import create_fastapi_app

    app = create_fastapi_app(guess.Env, guess.Action, guess.Observation, max_concurrent_envs=4)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the OpenEnv server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def _guesses(seed: int) -> list[str]:
    """A wrong guess, then the right one."""
    right = target(seed)
    return [str(1 if right != 1 else 2), str(right)]


def test_openenv_text_actions_over_the_server(guess_url):
    from trident.envs.adapters.openenv_env import OpenEnvEnv

    async def episode():
        env = OpenEnvEnv(url=guess_url, system_prompt="You play games.")
        try:
            messages = await env.reset({"prompt": "Play.", "reset_kwargs": {"seed": 3}})
            steps = [await env.step(_turn(g), []) for g in _guesses(3)]
            return messages, env.tools.schemas(), steps
        finally:
            await env.close()

    messages, schemas, (wrong, right) = asyncio.run(episode())
    assert messages == [
        {"role": "system", "content": "You play games."},
        {"role": "user", "content": "Play.\n\nGuess a number from 1 to 10."},
    ]
    assert schemas == []
    assert wrong.observations[0]["role"] == "user"
    assert wrong.observations[0]["content"].startswith("Try ")
    assert wrong.reward == 0.0 and not wrong.done
    assert right.observations == [{"role": "user", "content": "Correct!"}]
    assert right.reward == 1.0 and right.done


def test_openenv_tool_actions_over_the_server(guess_url):
    from trident.envs.adapters.openenv_env import OpenEnvEnv

    async def episode():
        env = OpenEnvEnv(url=guess_url, tool="act")
        try:
            await env.reset({"reset_kwargs": {"seed": 5}})
            wrong, right = _guesses(5)
            turn = _turn(calls=(("act", {"message": wrong}), ("act", {"message": right})))
            results = await env.tools.run(turn.tool_calls)  # in call order, one step each
            step = await env.step(turn, results)
            late = await env.tools.run(_turn(calls=(("act", {"message": right}),)).tool_calls)
            return env.tools.schemas(), results, step, late
        finally:
            await env.close()

    (schema,), results, step, (late,) = asyncio.run(episode())
    assert schema["function"]["name"] == "act"
    parameters = schema["function"]["parameters"]
    assert list(parameters["properties"]) == ["message"] and parameters["required"] == ["message"]
    assert [r.error for r in results] == [False, False]
    assert results[0].content.startswith("Try ") and results[1].content == "Correct!"
    assert step.reward == 1.0 and step.done and step.observations == []
    assert late.error and "episode is over" in late.content


def test_openenv_environment_class_in_process(guess):
    from trident.envs.adapters.openenv_env import OpenEnvEnv

    async def episode():
        env = OpenEnvEnv(env=guess.Env, tool="act", reset_kwargs={"seed": 7})
        try:
            await env.reset({})
            bad = await env.tools.run(_turn(calls=(("act", {"message": 7}),)).tool_calls)
            (right,) = await env.tools.run(
                _turn(calls=(("act", {"message": _guesses(7)[1]}),)).tool_calls
            )
            return bad, right, await env.step(_turn(calls=(("act", {}),)), [])
        finally:
            await env.close()

    (bad,), right, step = asyncio.run(episode())
    assert bad.error and "must be of type string" in bad.content  # checked against the schema
    assert right.content == "Correct!" and step.reward == 1.0 and step.done


def test_openenv_unreachable_server_is_an_infra_error():
    pytest.importorskip("openenv.core", reason="needs the extra: pip install 'trident[openenv]'")
    from trident.envs.adapters.openenv_env import OpenEnvEnv

    env = OpenEnvEnv(url=f"http://127.0.0.1:{_free_port()}", timeout_s=5)
    with pytest.raises(InfraError, match="OpenEnv environment"):
        asyncio.run(env.reset({}))


def test_openenv_rows_are_seeded_episodes():
    from trident.envs.adapters.openenv_env import make_rows

    train, test = make_rows(50, "train", 0), make_rows(50, "test", 0)
    seeds = {r["reset_kwargs"]["seed"] for r in train}
    assert len(seeds) == 50 and not seeds & {r["reset_kwargs"]["seed"] for r in test}
    assert make_rows(2, prompt="Play.", reset_kwargs={"level": 1})[0] == {
        "reset_kwargs": {"level": 1, "seed": 0},
        "messages": [],
        "prompt": "Play.",
    }


def test_openenv_env_through_the_agent_loop(guess_url, tokenizer):
    from trident.envs.adapters.openenv_env import OpenEnvEnv

    env = OpenEnvEnv(url=guess_url, tool="act")
    wrong, right = _guesses(11)
    texts = [_call_text("act", {"message": wrong}), _call_text("act", {"message": right})]
    sample = _run(tokenizer, env, {"prompt": "Play.", "reset_kwargs": {"seed": 11}}, texts)
    assert sample.status == "ok" and sample.reward == 1.0
    assert sample.metrics["turns"] == 2 and sample.metrics["tool_calls"] == 2
    assert sample.metrics["tool_errors"] == 0 and sample.metrics["token_drift"] == 0.0
    assert sample.metadata["messages"][-1] == {
        "role": "tool",
        "tool_call_id": "call_0",
        "name": "act",
        "content": "Correct!",
    }
