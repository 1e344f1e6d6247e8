"""What one trajectory of the terminal and browser environments costs: seconds and memory.

Each trajectory replays a generated row's demonstration through the environment's own tools,
as the model would act (reset -> one tool call per turn -> a final turn that runs the check ->
close), so the figures are the environment's own cost with the model's time left out. Run with
``--concurrency`` trajectories at once as well as one at a time, since training runs a group's
trajectories together.

- seconds per trajectory (p50, p95), and trajectories per second at each concurrency;
- memory: the terminal's bubblewrap session (PSS of its process tree, taken before the check);
  the browser's Chromium tree (PSS) idle and with ``--concurrency`` contexts open, and from
  those the cost of one more context;
- beside each, its floor in the same run: the same setup, commands and check in a plain ``bash``
  on the host (no sandbox), and the same number of page fetches over plain HTTP from the site
  (no browser: what serving the pages costs without rendering them).

    PYTHONPATH=. .venv/bin/python benchmarks/env_cost.py --out-dir benchmarks/results
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

from trident.envs import env_rows, make_env
from trident.tools.parsers import AssistantTurn, ToolCall

MIB = 1 << 20


def tree_pss_mib(pid: int) -> float:
    root = psutil.Process(pid)
    return sum(p.memory_full_info().pss for p in [root, *root.children(recursive=True)]) / MIB


def demo_calls(row: dict[str, Any]) -> list[ToolCall]:
    return [
        ToolCall(id="c", name=c["function"]["name"], arguments=c["function"]["arguments"])
        for m in row["messages"]
        for c in m.get("tool_calls", [])
    ]


async def trajectory(name: str, row: dict[str, Any], memory: list[float], hold: Any) -> float:
    """Replay ``row``'s demonstration: its seconds; the session's PSS goes to ``memory``
    (terminal); ``hold`` (a barrier) keeps every context open until all are (browser)."""
    t0 = time.perf_counter()
    env: Any = make_env(name)
    try:
        await env.reset(row)
        for call in demo_calls(row):
            results = await env.tools.run([call])
            await env.step(AssistantTurn("", "", [call]), results)
        if name == "terminal" and env.session.pid:
            memory.append(await asyncio.to_thread(tree_pss_mib, env.session.pid))
        if hold is not None:
            await hold()
        end = await env.step(AssistantTurn("Done.", "Done."), [])
        assert end.reward == 1.0, row["prompt"]
    finally:
        await env.close()
    return time.perf_counter() - t0


async def run_many(name: str, rows: list[dict[str, Any]], concurrency: int, hold: Any = None):
    memory: list[float] = []
    sem = asyncio.Semaphore(concurrency)

    async def one(row: dict[str, Any]) -> float:
        async with sem:
            return await trajectory(name, row, memory, hold)

    t0 = time.perf_counter()
    seconds = await asyncio.gather(*(one(r) for r in rows))
    return list(seconds), time.perf_counter() - t0, memory


def seconds_summary(seconds: list[float], wall: float) -> dict[str, float]:
    ordered = sorted(seconds)
    return {
        "p50_s": round(statistics.median(ordered), 3),
        "p95_s": round(ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))], 3),
        "per_s": round(len(seconds) / wall, 2),
        "n": len(seconds),
    }


def bash_floor(rows: list[dict[str, Any]]) -> tuple[list[float], float]:
    """The terminal rows' setup, commands and check in a plain host bash, one process per call."""
    seconds = []
    for row in rows:
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as work:
            scripts = [row["setup"], *(c.arguments["code"] for c in demo_calls(row)), row["check"]]
            for script in scripts:
                proc = subprocess.Popen(["bash", "-c", script], cwd=work, stdout=subprocess.PIPE)
                proc.communicate()
            assert proc.returncode == 0, row["prompt"]
        seconds.append(time.perf_counter() - t0)
    sleeper = subprocess.Popen(["bash", "-c", "sleep 5"])  # one idle bash: its memory
    time.sleep(0.05)
    bash_pss = tree_pss_mib(sleeper.pid)
    sleeper.kill()
    sleeper.wait()
    return seconds, bash_pss


def http_floor(rows: list[dict[str, Any]]) -> list[float]:
    """As many GETs of the site's pages as each browser trajectory makes actions (+ the start
    page and the final read), over plain HTTP, no browser."""
    site = make_env("browser").pool.site
    seconds = []
    for row in rows:
        sid = site.open_session(row.get("people"))
        t0 = time.perf_counter()
        for _ in range(len(demo_calls(row)) + 2):
            request = urllib.request.Request(site.origin + "/", headers={"Cookie": f"sid={sid}"})
            with urllib.request.urlopen(request, timeout=10) as response:
                response.read()
        seconds.append(time.perf_counter() - t0)
        site.close_session(sid)
    return seconds


async def browser_memory(rows: list[dict[str, Any]], concurrency: int) -> dict[str, float]:
    pool = make_env("browser").pool  # the process's Chromium, as the trajectories use it
    idle = pool.memory_used_mb()
    seen: list[float] = []
    arrived = 0
    everyone = asyncio.Event()

    async def hold() -> None:
        nonlocal arrived
        arrived += 1
        if arrived == concurrency:
            await asyncio.sleep(1.0)  # let the renderers settle
            seen.append(pool.memory_used_mb())
            everyone.set()
        await everyone.wait()

    await run_many("browser", rows[:concurrency], concurrency, hold)
    return {
        "chromium_idle_pss_mib": round(idle, 1),
        f"chromium_{concurrency}_contexts_pss_mib": round(seen[0], 1),
        "per_context_pss_mib": round((seen[0] - idle) / concurrency, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--out-dir", default="benchmarks/results")
    args = parser.parse_args()
    n, c = args.trajectories, args.concurrency
    out: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_avg_1m": os.getloadavg()[0],
        }
    }

    rows = env_rows("terminal", n, "train", 0)
    serial, wall, pss = asyncio.run(run_many("terminal", rows, 1))
    parallel, pwall, _ = asyncio.run(run_many("terminal", rows, c))
    floor, bash_pss = bash_floor(rows)
    out["terminal"] = {
        "one_at_a_time": seconds_summary(serial, wall),
        f"{c}_at_once": seconds_summary(parallel, pwall),
        "host_bash_floor": seconds_summary(floor, sum(floor)),
        "session_pss_mib": round(statistics.median(pss), 1),
        "host_bash_pss_mib": round(bash_pss, 1),
    }

    rows = env_rows("browser", n, "train", 0)
    t0 = time.perf_counter()
    asyncio.run(run_many("browser", rows[:1], 1))  # Chromium starts on first use
    first = time.perf_counter() - t0
    serial, wall, _ = asyncio.run(run_many("browser", rows, 1))
    parallel, pwall, _ = asyncio.run(run_many("browser", rows, c))
    memory = asyncio.run(browser_memory(rows, c))
    floor = http_floor(rows)
    out["browser"] = {
        "first_trajectory_with_chromium_start_s": round(first, 2),
        "one_at_a_time": seconds_summary(serial, wall),
        f"{c}_at_once": seconds_summary(parallel, pwall),
        "http_floor": seconds_summary(floor, sum(floor)),
        **memory,
    }
    make_env("browser").pool.close()

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "env_cost.json").write_text(json.dumps(out, indent=2) + "\n")
    (out_dir / "env_cost.md").write_text(markdown(out, c))
    print(markdown(out, c))


def markdown(out: dict[str, Any], c: int) -> str:
    t, b = out["terminal"], out["browser"]
    rows = [
        "| per trajectory | terminal | its floor (host bash) | browser | its floor (HTTP GETs) |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, key in (("one at a time, p50 s", "one_at_a_time"), (f"{c} at once, p50 s", f"{c}_at_once")):  # fmt: skip
        tf, bf = t["host_bash_floor"], b["http_floor"]
        floor = key == "one_at_a_time"
        rows.append(
            f"| {label} | {t[key]['p50_s']} | {tf['p50_s'] if floor else ''} "
            f"| {b[key]['p50_s']} | {bf['p50_s'] if floor else ''} |"
        )
        rows.append(
            f"| {label.split(',')[0]}, trajectories/s | {t[key]['per_s']} | "
            f"{tf['per_s'] if floor else ''} | {b[key]['per_s']} | {bf['per_s'] if floor else ''} |"
        )
    rows.append(
        f"| memory, MiB (PSS) | {t['session_pss_mib']} a session | {t['host_bash_pss_mib']} a bash "
        f"| {b['per_context_pss_mib']} a context (+ {b['chromium_idle_pss_mib']} Chromium) | |"
    )
    rows.append(
        f"| first trajectory, Chromium's start included, s | | "
        f"| {b['first_trajectory_with_chromium_start_s']} | |"
    )
    load = out["machine"]["load_avg_1m"]
    return "\n".join(rows) + f"\n\n{out['machine']['cpus']} CPUs, load {load:.2f} at the start.\n"


if __name__ == "__main__":
    main()
