"""The one-step-off-policy driver (``pipeline.mode=colocate_async``).

Generation for step k+1 overlaps training on step k, on the same resources:

    generate batch 0 with version 0
    for each step k:
        start generating batch k+1 with version k      (in the background)
        train on batch k                               (version k -> k+1)
        wait for batch k+1, then push weights k+1      (nothing is generating during the push)

Batch k+1 is sampled by version k and trained at version k+1: every token is exactly one version
stale (step 0's batch is on-policy), which any η ≥ 1 admits. Because the push waits for the
batch being generated, no request ever straddles a weight update: no partial rollout, no aborts,
and the per-step wall time is max(generate, train) + sync instead of their sum. The trainer waits
when generating a batch takes longer than training on one; ``separate_async`` removes that wait.

The batches go through the same version-aware buffer as ``separate_async``
(``trident.pipeline.buffer``), which checks the staleness invariant on every token and keeps the
staleness histogram. Off-policy tokens are corrected by the trainer's importance weights
π_prox/μ (decoupled PPO; see ``separate_async``).

Simplification: the look-ahead is fixed at one step whatever η is; a larger η only loosens the
check.
"""

from __future__ import annotations

import asyncio
from typing import Any

from trident.pipeline.buffer import GroupTicket, RolloutBuffer
from trident.pipeline.separate_async import (
    AsyncRun,
    GroupMaker,
    StepHook,
    Trainer,
    generate_into,
)
from trident.sample import Sample
from trident.telemetry.trace import Trace


async def generate_batch(buffer: RolloutBuffer, make_group: GroupMaker, groups: int) -> None:
    """Put ``groups`` groups into the buffer (a group with nothing trainable is replaced)."""

    async def one() -> None:
        while (ticket := await buffer.admit()) is not None:
            if await generate_into(buffer, make_group, ticket):
                return

    await asyncio.gather(*(one() for _ in range(groups)))


async def run_colocate(
    buffer: RolloutBuffer,
    make_group: GroupMaker,
    trainer: Trainer,
    steps: int,
    trace: Trace,
    on_step: StepHook,
) -> None:
    """``steps`` training steps, each overlapped with generating the next step's batch."""
    per_step = buffer.groups_per_step
    with trace.span("queue wait", "trainer"):
        await generate_batch(buffer, make_group, per_step)
    for step in range(steps):
        t0 = trace.now()
        with trace.span("queue wait", "trainer"):
            samples = await buffer.next_batch()
        depth = buffer.depth
        following = None
        if step + 1 < steps:
            following = asyncio.create_task(generate_batch(buffer, make_group, per_step))
        t1 = trace.now()
        with trace.span("train", "trainer", step=step):
            metrics = await trainer.train_step(samples)
        t2 = trace.now()
        if following is not None:
            with trace.span("queue wait", "trainer"):
                await following
        t3 = trace.now()
        with trace.span("weight sync", "trainer", version=step + 1):
            sync = await trainer.sync_weights(step + 1)
        buffer.advance(step + 1)
        trace.counter("buffer", "buffer", **depth)
        metrics |= {f"sync/{k}": v for k, v in sync.items()}
        metrics |= {
            "time/wait_s": (t1 - t0) + (t3 - t2),
            "time/train_s": t2 - t1,
            "time/sync_s": trace.now() - t3,
        }
        metrics |= {f"buffer/{k}": float(v) for k, v in depth.items()}
        await on_step(step, samples, metrics)


async def train(cfg: Any, fleet: Any, trainer: Any, log: Any) -> dict[str, Any]:
    """``pipeline.mode=colocate_async``: the driver ``trident.pipeline.run`` starts."""
    run = AsyncRun(cfg, fleet, trainer, log)
    await run.begin()

    async def make_group(ticket: GroupTicket) -> list[Sample]:
        row = run.next_row()
        server = run.router.pick()  # the whole group (all its trajectories' turns) on one server
        with run.trace.span("generate", f"rollout {server.url}", version=ticket.version):
            samples = await run.rollout.generate(server, row, ticket.version)
        run.stats.segments += 1
        run.stats.generated_tokens += sum(s.num_response_tokens for s in samples)
        return await run.score(samples)

    await run_colocate(
        run.buffer, make_group, run.trainer, cfg.pipeline.steps, run.trace, run.on_step
    )
    return await run.finish()
