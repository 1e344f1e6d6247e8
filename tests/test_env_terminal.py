"""The terminal environment (``env.name=terminal``): a persistent bash session in the sandbox, a
check script on the final file-system state.

Unit (real bubblewrap sessions): a row's demonstration, replayed through the env's own tools,
passes its check; doing nothing fails it; state persists between commands; a command's output
reaches the model capped; and a terminal trajectory reaches neither the host's files nor a
server listening on the host's loopback.

End to end (real vLLM, FSDP2, Ray): a tiny model warmed up for a few SFT steps on the ``write``
demonstrations trains two GRPO steps through ``trident train``. The engine's logprobs sit
exactly under the loss mask (step-0 mismatch ~1e-7), rewards come from the check script, and
some trajectories earn 1.0, which only a file the model's own command wrote can give.
"""

from __future__ import annotations

import asyncio
import re
import socket

import pytest

from tests.conftest import check_env_steps, train_on_env
from trident.envs import env_rows, make_env
from trident.tools.parsers import AssistantTurn, ToolCall


def _bash(command: str) -> ToolCall:
    return ToolCall(id="c", name="bash", arguments={"code": command})


async def _episode(row: dict, commands: list[str], **kwargs) -> tuple[float | None, list[str]]:
    """Run ``commands`` as the model's turns, then end the episode: (reward, tool outputs)."""
    env = make_env("terminal", **kwargs)
    outputs = []
    try:
        await env.reset(row)
        for command in commands:
            results = await env.tools.run([_bash(command)])
            outputs.append(results[0].content)
            await env.step(AssistantTurn("", "", [_bash(command)]), results)
        end = await env.step(AssistantTurn("Done.", "Done."), [])
        assert end.done
    finally:
        await env.close()
    return end.reward, outputs


def _demo_commands(row: dict) -> list[str]:
    return [
        call["function"]["arguments"]["code"]
        for m in row["messages"]
        for call in m.get("tool_calls", [])
    ]


def test_demonstrations_pass_their_checks_and_doing_nothing_fails():
    rows = env_rows("terminal", 9, "train", 0)
    assert {r["kind"] for r in rows} == {"write", "find", "fix"}
    for row in rows:
        reward, outputs = asyncio.run(_episode(row, _demo_commands(row)))
        assert reward == 1.0, (row["prompt"], outputs)
        demo_outputs = [m["content"] for m in row["messages"] if m["role"] == "tool"]
        assert outputs == demo_outputs  # the demonstration shows what the sandbox prints
        assert asyncio.run(_episode(row, []))[0] == 0.0, row["prompt"]
        assert asyncio.run(_episode(row, ["echo wrong > answer.txt"]))[0] == 0.0


def test_the_session_persists_and_output_is_capped():
    row = {"prompt": "p", "setup": "mkdir -p proj", "check": '[ "$(cat proj/x)" = 42 ]'}
    commands = ["cd proj", "X=42", "echo $X > x", "pwd", "seq 1 100000"]
    reward, outputs = asyncio.run(_episode(row, commands, max_output_chars=300))
    assert reward == 1.0  # cd and the variable carried over to the later commands
    assert outputs[3].endswith("/proj")
    assert len(outputs[4]) < 400 and "more characters]" in outputs[4]


def test_a_terminal_trajectory_reaches_nothing_outside_the_sandbox(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    row = {"prompt": "p", "setup": "", "check": "true"}
    commands = [
        f"cat {secret}",
        f"ls {tmp_path}",
        "cat /etc/shadow",
        f"exec 3<>/dev/tcp/127.0.0.1/{port} && echo CONNECTED",
        "exec 3<>/dev/tcp/1.1.1.1/53 && echo CONNECTED",
    ]
    try:
        _, outputs = asyncio.run(_episode(row, commands))
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing reached the host's listener
    finally:
        listener.close()
    for command, output in zip(commands, outputs, strict=True):
        assert "host secret" not in output and "CONNECTED" not in output, (command, output)
        assert re.search(r"\[exit code [12]\]$", output), (command, output)


# -- end to end -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def terminal_run(tiny_model, tmp_path_factory):
    # Measured over 64 trajectories: after 120 SFT steps 8% earn reward (CI once saw none in
    # two steps' 32), after 240 steps 88% (the model copies the word and the file name).
    return train_on_env(
        tiny_model,
        tmp_path_factory.mktemp("terminal"),
        "terminal",
        {"kinds": ["write"]},  # 8 x 20 prompts (the other kinds, thousands)
        ["sft.steps=240"],
        ["env.max_turns=3", "env.max_response_tokens=192", "pipeline.prompts_per_step=4"],
    )


def test_train_on_the_terminal_environment_end_to_end(terminal_run):
    cfg, metrics = terminal_run
    check_env_steps(cfg, metrics, 16)
    # reward 1.0 only if the check found the file the model's bash command wrote. Measured:
    # 88% of 64 trajectories (when the warm-up was set to 240 steps); 2026-12-03 at 2ec7042,
    # two runs' 32: 13/16 + 16/16 and 14/16 + 15/16 (90.6%). At least half: at 88%, 15 or fewer
    # of 32 has probability 2e-8, and 6e-4 for a host whose warm-up lands as low as 75%; 120
    # warm-up steps (8%) fail it.
    solved = sum(m["generated/accuracy"] * m["generated/samples"] for m in metrics)
    rate = solved / sum(m["generated/samples"] for m in metrics)
    assert rate >= 0.5, [m["generated/accuracy"] for m in metrics]
