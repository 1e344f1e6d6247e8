"""Black-box agent programs as rollouts (``env.name=agent_program``).

Each of a prompt's ``rollout.n`` trajectories runs the user's unmodified agent program
(``env.kwargs.command``, e.g. ``[python, my_agent.py]``) as a subprocess with:

- ``OPENAI_BASE_URL``: its own session of an ``AgentProxy`` (``trident.agent.proxy``), which
  serves the chat-completions calls from the rollout engine token-in/token-out, with the weight
  version of this group (and, in ``separate_async``, the per-token versions the engine reports);
- ``OPENAI_API_KEY`` set to a placeholder (the ``openai`` client insists on one);
- the prompt row as JSON on stdin and in ``TRIDENT_ROW``.

What the program prints on stdout is its answer: it is scored by the run's ``reward`` like a
single-turn response, against the row. The proxy's recorded conversation becomes the Samples
(one per segment: an agent that rewrites its history starts a new one), every segment of a
trajectory with the trajectory's reward, all in the prompt's group. A program that exits
non-zero or runs past ``env.kwargs.timeout_s`` (default 120 s) is the infrastructure's failure,
as for any environment: its samples are ``infra_error`` and left out of the loss, never scored
zero. A program that never called the model contributes no sample.

One proxy per group (an aiohttp site on a free port, started and stopped with the group), so
nothing outlives the group and each group's version is the one it was generated at.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import uuid
from collections.abc import Sequence
from typing import Any

from trident.agent.proxy import AgentProxy
from trident.rollout.engine import RolloutEngine, SamplingParams
from trident.sample import Sample

STDERR_TAIL = 2000


async def rollout_program_group(
    engine: RolloutEngine,
    tokenizer: Any,
    row: dict[str, Any],
    params: SamplingParams,
    version: int,
    n: int,
    *,
    command: Sequence[str],
    timeout_s: float = 120.0,
    parser: str = "hermes",
    group_id: str | None = None,
) -> list[Sample]:
    """``n`` runs of the agent program on ``row``; the Samples are not scored yet (the caller
    scores ``metadata["response"]``, the program's stdout), except infrastructure failures."""
    if not command:
        raise ValueError("env.name=agent_program needs env.kwargs.command (the program to run)")
    group_id = group_id or f"{row.get('id', 'row')}-{uuid.uuid4().hex[:8]}"
    proxy = AgentProxy(engine, tokenizer, params, version, parser=parser)
    await proxy.start()
    try:
        runs = [_run(proxy, f"{group_id}-{k}", group_id, row, command, timeout_s) for k in range(n)]
        return [s for samples in await asyncio.gather(*runs) for s in samples]
    finally:
        await proxy.stop()


async def _run(
    proxy: AgentProxy,
    session_id: str,
    group_id: str,
    row: dict[str, Any],
    command: Sequence[str],
    timeout_s: float,
) -> list[Sample]:
    row_json = json.dumps(row, default=str)
    env = {
        **os.environ,
        "OPENAI_BASE_URL": proxy.session_url(session_id),
        "OPENAI_API_KEY": "trident",
        "TRIDENT_ROW": row_json,
    }
    error = None
    stdout = b""
    try:
        proc = await asyncio.create_subprocess_exec(
            *command,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
    except OSError as e:
        proc, error = None, f"agent program {list(command)} did not start: {e}"
    if proc is not None:
        try:
            stdout, stderr = await asyncio.wait_for(proc.communicate(row_json.encode()), timeout_s)
            if proc.returncode != 0:
                tail = stderr.decode(errors="replace")[-STDERR_TAIL:]
                error = f"agent program exited with code {proc.returncode}: {tail}"
        except TimeoutError:
            error = f"agent program ran past env.kwargs.timeout_s={timeout_s:g}"
        finally:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
    samples = proxy.collect(session_id, 0.0, row, group_id=group_id)
    response = stdout.decode(errors="replace").strip()
    for s in samples:
        s.metadata["response"] = response
        if error:
            s.status, s.reward = "infra_error", None
            s.metadata["error"] = error
    return samples
