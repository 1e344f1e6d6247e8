"""The pieces every schedule is built from: groups into the buffer, a batch out of it, a train
step, a verified weight install. Each records its span on the trace and returns its figures,
so the three drivers time and name their stages the same way.

They take the buffer, gate, trainer and trace as parameters (no run object), so one code path
runs for real, in the tests and in the virtual-clock benchmark.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol

from trident.pipeline.buffer import GroupTicket, RolloutBuffer
from trident.pipeline.gate import WeightGate
from trident.sample import Sample
from trident.telemetry.trace import Trace


class Trainer(Protocol):
    """The policy trainer as the schedules see it (``trident.train.group.TrainerGroup``)."""

    async def train_step(self, samples: list[Sample]) -> dict[str, float]:
        """Called once per step with the step's samples (whole groups)."""
        ...

    async def sync_weights(self, version: int, urls: list[str]) -> dict[str, float]:
        """Called after each step, with every server idle: push ``version`` to ``urls`` (the
        servers up) and verify it."""
        ...


GroupMaker = Callable[[GroupTicket], Awaitable[list[Sample]]]
StepHook = Callable[[int, list[Sample], dict[str, float]], Awaitable[None]]
# A driver's schedule: (buffer, gate, make_group, trainer, steps, trace, on_step) -> None
Schedule = Callable[
    [RolloutBuffer, WeightGate, GroupMaker, Trainer, int, Trace, StepHook], Awaitable[None]
]


async def generate_into(buffer: RolloutBuffer, make_group: GroupMaker, ticket: GroupTicket) -> bool:
    """Generate and score one group into the buffer; False if it had nothing to train on (the
    buffer then admits a replacement)."""
    try:
        samples = await make_group(ticket)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # the trainer's next_batch re-raises it
        buffer.fail(e)
        return False
    if samples:
        buffer.put(ticket, samples)
        return True
    buffer.drop(ticket)
    return False


async def fill_batch(buffer: RolloutBuffer, make_group: GroupMaker, groups: int) -> None:
    """Put ``groups`` groups into the buffer, concurrently; a group with nothing to train on is
    replaced by a fresh prompt."""

    async def one() -> None:
        while (ticket := await buffer.admit()) is not None:
            if await generate_into(buffer, make_group, ticket):
                return

    await asyncio.gather(*(one() for _ in range(groups)))


async def take_batch(
    buffer: RolloutBuffer, trace: Trace, since: float | None = None
) -> tuple[list[Sample], dict[str, float]]:
    """The next batch of whole groups; ``time/wait_s`` is how long the trainer waited for it
    (from ``since`` when given, e.g. the start of a synchronous rollout)."""
    start = trace.now() if since is None else since
    with trace.span("queue wait", "trainer"):
        samples = await buffer.next_batch()
    depth = buffer.depth
    trace.counter("buffer", "buffer", **depth)
    metrics = {"time/wait_s": trace.now() - start}
    return samples, metrics | {f"buffer/{k}": float(v) for k, v in depth.items()}


async def train_on(
    trainer: Trainer, samples: list[Sample], step: int, trace: Trace
) -> dict[str, float]:
    """One training step (an optimizer round over the batch)."""
    start = trace.now()
    with trace.span("train", "trainer", step=step):
        metrics = await trainer.train_step(samples)
    return metrics | {"time/train_s": trace.now() - start}


async def install(
    gate: WeightGate, trainer: Trainer, buffer: RolloutBuffer, version: int, trace: Trace
) -> dict[str, float]:
    """Push and verify ``version`` through the gate; the buffer then admits for it."""
    start = trace.now()
    with trace.span("weight sync", "trainer", version=version):
        sync = await gate.update(version, lambda urls: trainer.sync_weights(version, urls))
    buffer.advance(version)
    return {f"sync/{k}": v for k, v in sync.items()} | {"time/sync_s": trace.now() - start}
