"""The streaming asynchronous driver (``pipeline.mode=separate_async``), with partial rollout.

Rollout and training run side by side and never wait for each other's whole batch:

    rollout:  while the buffer admits a group: generate its samples, score them, put the group
    trainer:  for each step k:  take B finished groups -> train -> push weights k+1 -> log

The buffer (``trident.pipeline.buffer``) owns the staleness bound η: it admits a group only while
it can still be trained within η versions, and hands the trainer whole groups as they finish.

Weight updates happen while generation continues, through the ``WeightGate``
(``trident.pipeline.gate``): close, abort what is in flight and wait for it, push and verify,
reset the prefix caches, bump the version, reopen.

Partial rollout (``PartialRollout``): every sample is its own request. A request that comes back
aborted is resubmitted as prompt + partial output with ``max_tokens`` reduced by what it already
has, once the gate opens again; its KV cache is recomputed by prefill under the new weights. Each
segment's tokens carry the version the segment was admitted under, and since weights change only
while nothing is in flight, that is the version that produced them. The Sample's ``versions``
thus differ along one response; ``metrics["resumes"]`` counts its interruptions. A request whose
server died is resubmitted the same way, from its prefix, to a server that is up
(``trident.pipeline.recovery``).

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
import uuid
from collections.abc import Sequence
from dataclasses import replace

from trident.pipeline.buffer import GroupTicket, RolloutBuffer
from trident.pipeline.gate import Server, ServerPool, WeightGate
from trident.pipeline.harness import PartialResponse, RunHarness
from trident.pipeline.metrics import RolloutStats
from trident.pipeline.stages import (
    GroupMaker,
    StepHook,
    Trainer,
    generate_into,
    install,
    take_batch,
    train_on,
)
from trident.rollout.engine import Completion, EngineError, SamplingParams
from trident.sample import Sample
from trident.telemetry.trace import Trace

# A request that keeps coming back aborted without the gate closing is a server problem.
MAX_RESUMES = 1000
# Consecutive failed requests of one sample before its group (and the run) fails.
MAX_SEGMENT_FAILURES = 3


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


class PartialRollout:
    """``generate`` for one group under live weight updates: each of the ``n`` samples is its own
    request, resumed from prompt + partial output whenever an update aborts it. ``progress``
    holds each response so far (a checkpoint saves it; a resumed run passes it back in, and the
    responses continue from their prefixes). After ``generate``, ``tag(samples)`` writes each
    sample's resume count.

    Every request of a group goes to one server, its samples and their resumed segments alike
    (the prompt's prefix cache is there), and so do an agent session's turns (``session_id``);
    a server that goes down moves the session to another (``Router.pick``)."""

    def __init__(
        self,
        servers: ServerPool,
        gate: WeightGate,
        trace: Trace,
        stats: RolloutStats,
        progress: list[PartialResponse] | None = None,
    ) -> None:
        self.servers, self.gate, self.trace, self.stats = servers, gate, trace, stats
        # the group's record (None: an environment's turns, each call its own responses)
        self.progress = progress
        self.group = f"group-{uuid.uuid4().hex}"  # the group's session on the servers

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, session_id: str | None = None
    ) -> list[Completion]:
        if self.progress is None:
            progress = [PartialResponse() for _ in range(params.n)]
        else:  # in place: the run harness's record of the group holds this list
            if not self.progress:
                self.progress.extend(PartialResponse() for _ in range(params.n))
            progress = self.progress
        session = session_id or self.group
        try:
            return list(
                await asyncio.gather(
                    *(
                        self.sample(
                            prompt_ids,
                            replace(params, n=1, seed=_nth_seed(params.seed, i)),
                            p,
                            session,
                        )
                        for i, p in enumerate(progress)
                    )
                )
            )
        finally:
            if session_id is None:  # an agent's session ends with its trajectory
                self.end_session(session)

    def end_session(self, session_id: str) -> None:
        """The agent loop's call when a trajectory is done."""
        self.servers.end_session(session_id)

    async def sample(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        p: PartialResponse,
        session: str | None = None,
    ) -> Completion:
        """One response, continued from ``p`` and recorded in it as segments come back;
        ``session``: the requests go where its earlier ones went."""
        failures = 0
        aborted = False
        while p.finish is None:
            if p.resumes > MAX_RESUMES:
                raise EngineError(f"a request came back aborted {MAX_RESUMES} times")
            await self.servers.available()  # outside the gate: an update need not wait for it
            version = await self.gate.enter()
            if aborted:
                self.stats.resumed += 1
                aborted = False
            server: Server | None = None
            out: Completion | None = None
            error = EngineError("no answer")
            try:
                server = self.servers.pick(session)
                p.server = server.url
                segment = replace(params, max_tokens=params.max_tokens - len(p.tokens))
                with self.trace.span(
                    "generate", f"rollout {server.url}", version=version, prefix=len(p.tokens)
                ):
                    (out,) = await server.generate(prompt_ids + p.tokens, segment)
            except EngineError as e:
                error = e
            finally:
                self.gate.leave()
            if out is None:
                self.stats.failed_segments += 1
                if server is None or await self.servers.failed(server, error):
                    # its server is down (or none was up): resubmit the prefix elsewhere
                    self.stats.resubmitted += 1
                    continue
                # A dropped connection (e.g. a keep-alive socket the server just closed) loses
                # at most this segment: resume from what came back before, a few times.
                failures += 1
                if failures > MAX_SEGMENT_FAILURES:
                    raise error
                continue
            failures = 0
            p.tokens += out.token_ids
            p.logprobs += out.logprobs
            p.versions += [version] * len(out.token_ids)
            self.stats.segments += 1
            self.stats.generated_tokens += len(out.token_ids)
            if out.finish_reason != "abort":
                p.finish = out.finish_reason
            elif len(p.tokens) >= params.max_tokens:  # aborted right at the end: it is complete
                self.stats.aborted += 1
                p.finish = "length"
            else:
                self.stats.aborted += 1
                p.resumes += 1
                aborted = True
        last = p.versions[-1] if p.versions else self.gate.version
        return Completion(list(p.tokens), list(p.logprobs), p.finish, last, list(p.versions))

    def tag(self, samples: list[Sample]) -> list[Sample]:
        """Resume counts of the samples built from the last ``generate`` (``generate_group``
        keeps the order)."""
        for s, p in zip(samples, self.progress or [], strict=True):
            s.metrics["resumes"] = float(p.resumes)
            s.metadata["server"] = p.server
        return samples


def _nth_seed(seed: int | None, i: int) -> int | None:
    # n requests of one group with one seed would all sample the same response
    return None if seed is None else seed + i
