"""The browser environment (``env.name=browser``): headless Chromium (Debian's ``chromium``,
driven by playwright) on the small web app the environment serves on loopback.

Unit (a real Chromium): every kind's demonstration, replayed through the env's own tools, shows
exactly the pages the demonstration shows and passes its check; doing nothing or typing the wrong
thing fails it; a missing link or a URL off the site is an error result the model reads; a dead
browser, an expired context and a browser over its memory bound are infrastructure errors.
Security: nothing the browser does reaches a server listening on the host's loopback or any
other host: the site's proxy refuses it and counts it.

End to end (real vLLM, FSDP2, Ray): a tiny model warmed up on the ``subscribe`` demonstrations
(starting on the form: type the name, click Send) trains two GRPO steps through ``trident
train``; some trajectories earn 1.0, which only the page the site renders after the model typed
the right name and clicked Send can give.
"""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from tests.conftest import check_env_steps, train_on_env
from trident.envs import env_rows, make_env
from trident.envs.browser import BrowserEnv
from trident.tools.parsers import AssistantTurn, ToolCall
from trident.tools.toolset import ToolInfraError


def _call(name: str, **arguments: str) -> ToolCall:
    return ToolCall(id="c", name=name, arguments=arguments)


async def _episode(row: dict, calls: list[ToolCall], **kwargs) -> tuple[float | None, list, str]:
    """Run ``calls`` one per turn, then end the episode: (reward, results, first prompt)."""
    env = make_env("browser", **kwargs)
    results = []
    try:
        prompt = (await env.reset(row))[-1]["content"]
        for call in calls:
            result = await env.tools.run([call])
            results += result
            await env.step(AssistantTurn("", "", [call]), result)
        end = await env.step(AssistantTurn("Done.", "Done."), [])
        assert end.done
    finally:
        await env.close()
    return end.reward, results, prompt


def _demo_calls(row: dict) -> list[ToolCall]:
    return [
        _call(c["function"]["name"], **c["function"]["arguments"])
        for m in row["messages"]
        for c in m.get("tool_calls", [])
    ]


def test_demonstrations_replay_in_chromium_and_doing_nothing_fails():
    rows = env_rows("browser", 9, "train", 0)
    assert {r["kind"] for r in rows} == {"subscribe", "note", "lookup"}
    for row in rows:
        reward, results, prompt = asyncio.run(_episode(row, _demo_calls(row)))
        assert reward == 1.0, (row["prompt"], [r.content for r in results])
        assert prompt == row["messages"][0]["content"]  # the start page as the browser shows it
        demo = [m["content"] for m in row["messages"] if m["role"] == "tool"]
        assert [r.content for r in results] == demo
        assert asyncio.run(_episode(row, []))[0] == 0.0
        # the right clicks with the wrong text typed: the final page shows another value
        wrong = [
            _call("type", field=c.arguments["field"], text="Zed") if c.name == "type" else c
            for c in _demo_calls(row)
        ]
        assert asyncio.run(_episode(row, wrong))[0] == 0.0


def test_the_model_s_mistakes_are_results_it_reads():
    row = env_rows("browser", 1, "train", 0, kinds=["subscribe"])[0]
    calls = [_call("click", text="Nowhere"), _call("type", field="Name", text="x")]
    calls += [_call("goto", url="/missing"), _call("goto", url="/subscribe")]
    calls += [_call("type", field="Name", text="Ada"), _call("read")]
    reward, results, _ = asyncio.run(_episode(row, calls))
    assert reward == 0.0
    assert [r.error for r in results] == [True, True, True, False, False, False]
    assert "no link or button named 'Nowhere'" in results[0].content
    assert "no text field labelled 'Name'" in results[1].content  # the home page has none
    assert "HTTP 404" in results[2].content
    assert '- textbox "Name": Ada' in results[5].content


def test_a_dead_browser_an_expired_context_and_memory_are_infra_errors():
    row = env_rows("browser", 1, "train", 0, kinds=["subscribe"])[0]

    async def after(kill, **kwargs) -> None:
        env = BrowserEnv(**kwargs)
        try:
            await env.reset(row)
            await kill(env)
            with pytest.raises(ToolInfraError):
                await env.tools.run([_call("read")])
        finally:
            await env.close()

    async def kill_chromium(env: BrowserEnv) -> None:
        env.pool._kill()

    async def wait(env: BrowserEnv) -> None:
        await asyncio.sleep(1.5)

    async def over_memory(env: BrowserEnv) -> None:
        env.pool.memory_mb = 20  # Chromium's process tree holds far more than 20 MiB
        await asyncio.sleep(1.5)

    asyncio.run(after(kill_chromium))
    asyncio.run(after(wait, ttl_s=1.0))  # the context outlived its ttl_s: closed under it
    own = BrowserEnv(memory_mb=4096).pool  # a pool of its own for the memory bound
    try:
        asyncio.run(after(over_memory, memory_mb=4096))
        assert own.kills >= 1 and own.memory_used_mb() == 0.0
    finally:
        own.close()
    # and the next trajectory gets a fresh browser (the default pool is still healthy)
    reward, _, _ = asyncio.run(_episode(row, _demo_calls(row)))
    assert reward == 1.0


def test_a_browser_trajectory_reaches_nothing_but_the_site():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    outside = [f"http://127.0.0.1:{port}/", "http://example.com/", "https://1.1.1.1/"]
    row = env_rows("browser", 1, "train", 0, kinds=["subscribe"])[0]

    async def probe() -> tuple[list, list, list]:
        env = BrowserEnv()
        try:
            await env.reset(row)
            calls = [_call("goto", url=u) for u in [*outside, "file:///etc/passwd"]]
            tool_results = await env.tools.run(calls)
            page = env.context.pages[0]

            async def from_the_page() -> tuple[list, list]:
                # what the tools refuse, the page itself tries: navigations, fetch, WebSocket
                statuses = []
                for url in outside:
                    try:
                        response = await page.goto(url)
                        statuses.append(response.status if response else None)
                    except Exception as e:
                        statuses.append(type(e).__name__)
                fresh = await page.context.new_page()  # away from the last one's error page
                await fresh.goto(env.pool.site.origin + "/")
                script = """async (port) => {
                    const out = [];
                    try { await fetch(`http://127.0.0.1:${port}/x`); out.push('fetched'); }
                    catch (e) { out.push('blocked'); }
                    const ws = new WebSocket(`ws://127.0.0.1:${port}/`);
                    out.push(await new Promise(r => { ws.onopen = () => r('open');
                                                     ws.onerror = () => r('blocked'); }));
                    return out;
                }"""
                return statuses, await fresh.evaluate(script, port)

            statuses, in_page = await env.pool.call(from_the_page())
        finally:
            await env.close()
        return tool_results, statuses, in_page

    try:
        refused_before = len(BrowserEnv().pool.site.refused)
        tool_results, statuses, in_page = asyncio.run(probe())
        time.sleep(0.5)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing reached the host's listener
    finally:
        listener.close()
    assert all(r.error and "only this site's pages" in r.content for r in tool_results)
    assert statuses[0] == 403 and statuses[1] == 403  # the proxy's refusal, not the page
    assert statuses[2] != 200  # HTTPS: the proxy refused the CONNECT
    assert in_page == ["blocked", "blocked"]
    refused = BrowserEnv().pool.site.refused[refused_before:]
    assert any(f"127.0.0.1:{port}" in r for r in refused) and any(
        "example.com" in r for r in refused
    )
    assert any(r.startswith("CONNECT 1.1.1.1:443") for r in refused)


# -- end to end -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser_run(tiny_model, tmp_path_factory):
    return train_on_env(
        tiny_model,
        tmp_path_factory.mktemp("browser"),
        "browser",
        {"kinds": ["subscribe"], "start_on_form": True},
        ["sft.steps=240", "sft.max_seq_len=384"],  # a demonstration is ~300 tokens
        [
            "env.max_turns=4",
            "env.max_response_tokens=384",
            "pipeline.prompts_per_step=8",  # 12.5% of trajectories earn reward (measured, 64)
        ],
    )


def test_train_on_the_browser_environment_end_to_end(browser_run):
    cfg, metrics = browser_run
    check_env_steps(cfg, metrics, 32)
    # 1.0 only if the page the site rendered after the model's clicks shows the typed name.
    # Measured: 12.5% of 64 trajectories; 2026-12-03 at 2ec7042, this run's 64: 5/32 then 2/32
    # (10.9%). 64 trajectories at ~11% bound it from below at one success only (none: p 6e-4;
    # one or none: 5e-3, too flaky); from above, 35% (23 or more of 64: p 1e-7) is a site
    # that rewards without the typed name, or a warm-up that changed: measure again.
    solved = sum(m["generated/accuracy"] * m["generated/samples"] for m in metrics)
    rate = solved / sum(m["generated/samples"] for m in metrics)
    assert 1 / 64 <= rate <= 0.35, [m["generated/accuracy"] for m in metrics]
