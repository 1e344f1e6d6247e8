"""Partial rollout: one group's requests under live weight updates (``pipeline.mode=separate_async``).

Every sample is its own request (``PartialRollout.sample``). A request that comes back aborted
(the weight gate closed for an update) is resubmitted as prompt + partial output with
``max_tokens`` reduced by what it already has, once the gate opens again; its KV cache is
recomputed by prefill under the new weights. Each segment's tokens carry the version the segment
was admitted under, and since weights change only while nothing is in flight, that is the version
that produced them. The Sample's ``versions`` thus differ along one response;
``metrics["resumes"]`` counts its interruptions. A request whose server died is resubmitted the
same way, from its prefix, to a server that is up (``trident.pipeline.recovery``).

``PartialResponse`` is one response so far: what a checkpoint keeps of a request in flight, so a
resumed run continues each response from its prefix.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field, replace

from trident.pipeline.gate import Server, ServerPool, WeightGate
from trident.pipeline.metrics import RolloutStats
from trident.rollout.engine import Completion, EngineError, FinishReason, SamplingParams
from trident.sample import Sample
from trident.telemetry.trace import Trace

# A request that keeps coming back aborted without the gate closing is a server problem.
MAX_RESUMES = 1000
# Consecutive failed requests of one sample before its group (and the run) fails.
MAX_SEGMENT_FAILURES = 3


@dataclass
class PartialResponse:
    """One response so far (``PartialRollout``): what a checkpoint keeps of a
    request in flight."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    resumes: int = 0
    finish: FinishReason | None = None  # set once the response is complete
    server: str = ""  # the server of the latest segment


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
