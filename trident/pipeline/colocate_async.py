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

The batches go through the same version-aware buffer as every mode (``trident.pipeline.buffer``),
which checks the staleness invariant on every token and keeps the staleness histogram. Off-policy tokens are corrected by the trainer's importance weights
π_prox/μ (decoupled PPO; see ``separate_async``).

Simplification: the look-ahead is fixed at one step whatever η is; a larger η only loosens the
check.
"""

from __future__ import annotations

import asyncio

from trident.pipeline.buffer import RolloutBuffer
from trident.pipeline.gate import WeightGate
from trident.pipeline.harness import RunHarness
from trident.pipeline.stages import (
    GroupMaker,
    StepHook,
    Trainer,
    fill_batch,
    install,
    take_batch,
    train_on,
)
from trident.telemetry.trace import Trace


async def train(h: RunHarness) -> None:
    """``pipeline.mode=colocate_async``: each group on one server, one step of look-ahead."""
    await h.run(run_colocate, h.group_on_one_server)


async def run_colocate(
    buffer: RolloutBuffer,
    gate: WeightGate,
    make_group: GroupMaker,
    trainer: Trainer,
    steps: int,
    trace: Trace,
    on_step: StepHook,
) -> None:
    """Training steps (from the buffer's steps taken up to ``steps``), each overlapped with
    generating the next step's batch."""
    per_step, first, start = buffer.groups_per_step, buffer.steps_taken, trace.now()
    if buffer.depth["ready"] < per_step:  # a resumed run has its next batch waiting already
        await fill_batch(buffer, make_group, per_step)
    for step in range(first, steps):
        samples, metrics = await take_batch(buffer, trace, since=start if step == first else None)
        following = None
        if step + 1 < steps:
            following = asyncio.create_task(fill_batch(buffer, make_group, per_step))
        metrics |= await train_on(trainer, samples, step, trace)
        if following is not None:
            start = trace.now()
            with trace.span("queue wait", "trainer"):
                await following
            metrics["time/wait_s"] += trace.now() - start
        metrics |= await install(gate, trainer, buffer, step + 1, trace)
        await on_step(step, samples, metrics)
