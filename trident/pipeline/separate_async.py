"""The streaming asynchronous driver (``pipeline.mode=separate_async``), with partial rollout.

Rollout and training run side by side and never wait for each other's whole batch:

    rollout:  while the buffer admits a group: generate its samples, score them, put the group
    trainer:  for each step k:  take B finished groups -> train -> push weights k+1 -> log

The buffer (``trident.pipeline.buffer``) owns the staleness bound η: it admits a group only while
it can still be trained within η versions, and hands the trainer whole groups as they finish.

Weight updates happen while generation continues, through the ``WeightGate``
(``trident.pipeline.gate``): close, abort what is in flight and wait for it, push and verify,
reset the prefix caches, bump the version, reopen.

Partial rollout (``trident.pipeline.partial``): every sample is its own request, resumed from
prompt + partial output when an update aborts it; each token keeps the version that produced it.

Off-policy correction: the trainer recomputes log π_prox with the weights it is about to update
and weights each token by min(π_prox/μ, cap) (``algo.is_*``, token TIS by default), μ being the
engine logprob of the version that sampled the token. With PPO clipping around π_prox that is
decoupled PPO (Hilton et al. 2021; AReaL) exactly, so stale tokens need no trainer change.

Environments (``env.name``): each trajectory's turns are requests through the same
``PartialRollout``, so a weight update can interrupt a turn (resumed like any request) or fall
between two turns; each token keeps the version that produced it (``Completion.versions``).

Everything around the schedule (prompts, rewards, dynamic sampling, metrics, checkpoints, evals,
the trace) is the run harness's (``trident.pipeline.harness``).

Simplifications: one weight sync per optimizer round (every step); the gate stops all servers
during a sync (vLLM cannot generate while its weights are swapped in place anyway).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Sequence

from trident.pipeline.buffer import GroupTicket, RolloutBuffer
from trident.pipeline.gate import WeightGate
from trident.pipeline.harness import RunHarness
from trident.pipeline.partial import PartialRollout
from trident.pipeline.stages import (
    GroupMaker,
    StepHook,
    Trainer,
    generate_into,
    install,
    take_batch,
    train_on,
)
from trident.sample import Sample
from trident.telemetry.trace import Trace


async def train(h: RunHarness) -> None:
    """``pipeline.mode=separate_async``: rollout streams into the buffer while the trainer
    trains; every request goes through the weight gate and is resumed across updates."""

    async def make_group(ticket: GroupTicket) -> list[Sample]:
        group = h.open_group(ticket)
        # an environment's trajectories are not resumed from a checkpoint's prefixes
        progress = group.progress if not h.cfg.env.name else None
        partial = PartialRollout(h.router, h.gate, h.trace, h.stats, progress)
        samples = await h.generate(partial, group)
        if not h.cfg.env.name:
            partial.tag(samples)
        return await h.score(group, samples)

    await h.run(functools.partial(run_separate, resumed=h.resumed_tickets()), make_group)


async def run_separate(
    buffer: RolloutBuffer,
    gate: WeightGate,
    make_group: GroupMaker,
    trainer: Trainer,
    steps: int,
    trace: Trace,
    on_step: StepHook,
    resumed: Sequence[GroupTicket] = (),
) -> None:
    """Training steps (from the buffer's steps taken up to ``steps``) with rollout streaming
    into ``buffer`` all along; ``resumed`` groups (caught in flight by a checkpoint) first."""
    rollout = asyncio.create_task(keep_generating(buffer, make_group, resumed))
    try:
        for step in range(buffer.steps_taken, steps):
            samples, metrics = await take_batch(buffer, trace)
            metrics |= await train_on(trainer, samples, step, trace)
            metrics |= await install(gate, trainer, buffer, step + 1, trace)
            await on_step(step, samples, metrics)
    finally:
        # partial outputs come back and are counted (bounded: the servers may be the problem)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(gate.close_and_drain(), timeout=60)
        rollout.cancel()
        await asyncio.gather(rollout, return_exceptions=True)


async def keep_generating(
    buffer: RolloutBuffer, make_group: GroupMaker, resumed: Sequence[GroupTicket] = ()
) -> None:
    """Start a group whenever the buffer admits one (after the ``resumed`` ones, admitted
    already); each group runs as its own task."""
    groups: set[asyncio.Task] = set()

    def start(ticket: GroupTicket) -> None:
        task = asyncio.create_task(generate_into(buffer, make_group, ticket))
        groups.add(task)
        task.add_done_callback(groups.discard)

    try:
        for ticket in resumed:
            start(ticket)
        while (ticket := await buffer.admit()) is not None:
            start(ticket)
    finally:
        for task in groups:
            task.cancel()
        await asyncio.gather(*groups, return_exceptions=True)
