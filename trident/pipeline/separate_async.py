"""The streaming asynchronous driver (``pipeline.mode=separate_async``), with partial rollout.

Rollout and training run side by side and never wait for each other's whole batch:

    rollout:  while the buffer admits a group: generate its samples, score them, put the group
    trainer:  for each step k:  take B finished groups -> train -> push weights k+1 -> log

The buffer (``trident.pipeline.buffer``) owns the staleness bound η: it admits a group only while
it can still be trained within η versions, and hands the trainer whole groups as they finish.

Weight updates while generation continues, through the ``WeightGate``:

1. close the gate: new requests (fresh or resumed) wait;
2. abort every in-flight request (``/abort_requests``) and wait until each has come back with its
   partial output; the abort is repeated until nothing of ours is in flight, because a request
   still on its way into the engine misses an abort;
3. push and verify the new weights (``PolicyWorker.sync_weights``);
4. reset every server's prefix cache (``/reset_prefix_cache``), so no request reuses KV blocks
   computed by the old weights;
5. bump the served version and open the gate.

Partial rollout (``PartialRollout``): every sample is its own request. A request that comes back
aborted is resubmitted as prompt + partial output with ``max_tokens`` reduced by what it already
has, once the gate opens again; its KV cache is recomputed by prefill under the new weights. Each
segment's tokens carry the version the segment was admitted under, and since weights change only
while nothing is in flight, that is the version that produced them. The Sample's ``versions``
thus differ along one response; ``metrics["resumes"]`` counts its interruptions.

Off-policy correction: the trainer recomputes log π_prox with the weights it is about to update
and weights each token by min(π_prox/μ, cap) (``algo.is_*``, token TIS by default), μ being the
engine logprob of the version that sampled the token. With PPO clipping around π_prox that is
decoupled PPO (Hilton et al. 2021; AReaL) exactly, so stale tokens need no trainer change.

Environments (``env.name``): each trajectory's turns are requests through the same
``PartialRollout``, so a weight update can interrupt a turn (resumed like any request) or fall
between two turns; each token keeps the version that produced it (``VersionedCompletion``).

Dynamic sampling (``algo.dynamic_sampling``): a group whose rewards are all equal is dropped and
the buffer admits a fresh prompt in its place, at most ``(dynamic_sampling_rounds - 1) ·
prompts_per_step`` groups in a row (then such groups are trained on, with zero advantages, until
a group with signal comes back), so a saturated policy cannot stall the run.

Simplifications: one weight sync per optimizer round (every step); the gate stops all servers
during a sync (vLLM cannot generate while its weights are swapped in place anyway).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from trident.agent.loop import agent_metrics
from trident.data.loaders import PromptCursor
from trident.eval import evaluate, heldout_rows
from trident.models.load import load_tokenizer
from trident.pipeline.buffer import GroupTicket, RolloutBuffer
from trident.pipeline.progress import StepProgress
from trident.pipeline.rollout import (
    GroupRollout,
    SignalFilter,
    no_tokens,
    overlong_metrics,
    rollout_metrics,
    sampling_params,
    split_rows,
    trainable,
)
from trident.pipeline.run import save_checkpoint, weight_backend
from trident.rewards import RewardModel
from trident.rollout.engine import Completion, EngineError, SamplingParams
from trident.sample import Sample
from trident.telemetry.trace import Trace

# A request that keeps coming back aborted without the gate closing is a server problem.
MAX_RESUMES = 1000
# Consecutive failed requests of one sample before its group (and the run) fails.
MAX_SEGMENT_FAILURES = 3
# Trainer spans that are work; the rest of its time ("queue wait" or nothing) is idle.
TRAINER_BUSY = {"train", "weight sync", "checkpoint"}


class Server(Protocol):
    url: str

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, session_id: str | None = None
    ) -> list[Completion]:
        """Called for every request segment (one sample, ``n=1``)."""


class Fleet(Protocol):
    """The rollout servers as the async drivers use them (``trident.rollout.router.Router``)."""

    urls: list[str]

    def pick(self, session_id: str | None = None) -> Server:
        """Called for each request segment: the least-loaded server."""

    async def abort(self) -> int:
        """Called by a weight update: abort every in-flight request on every server."""

    async def reset_prefix_cache(self) -> bool:
        """Called by a weight update once nothing is in flight."""


class Trainer(Protocol):
    """The policy trainer as the async drivers see it (awaitable; Ray calls run in threads)."""

    async def train_step(self, samples: list[Sample]) -> dict[str, float]:
        """Called once per step with the step's samples (whole groups)."""

    async def sync_weights(self, version: int) -> dict[str, float]:
        """Called after each step, with every server idle: push ``version`` and verify it."""


@dataclass
class RolloutStats:
    """Counts over the whole run: request segments, interruptions, tokens generated."""

    segments: int = 0
    aborted: int = 0
    resumed: int = 0
    failed_segments: int = 0
    generated_tokens: int = 0


class WeightGate:
    """The weight version the servers serve, and the door every generation request goes through
    (see the module docstring for the update protocol)."""

    def __init__(self, fleet: Fleet, version: int = 0) -> None:
        self.fleet, self.version = fleet, version
        self.inflight = 0
        self._open = asyncio.Event()
        self._open.set()
        self._drained = asyncio.Event()
        self._drained.set()

    async def enter(self) -> int:
        """Called before each request segment; returns the version that will serve it."""
        while not self._open.is_set():
            await self._open.wait()
        self.inflight += 1
        self._drained.clear()
        return self.version

    def leave(self) -> None:
        """Called when a request segment has returned (finished or aborted)."""
        self.inflight -= 1
        if self.inflight == 0:
            self._drained.set()

    async def close_and_drain(self) -> int:
        """Stop new segments, abort the running ones and wait until all are back."""
        self._open.clear()
        aborted = 0
        while self.inflight:
            aborted += await self.fleet.abort()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drained.wait(), timeout=0.05)
        return aborted

    async def update(
        self, version: int, push: Callable[[], Awaitable[dict[str, float]]]
    ) -> dict[str, float]:
        """Install ``version`` with ``push()`` while nothing generates; reopen afterwards."""
        try:
            aborted = await self.close_and_drain()
            metrics = await push()
            if not await self.fleet.reset_prefix_cache():
                raise EngineError("a server refused /reset_prefix_cache with nothing in flight")
            self.version = version
        finally:
            self._open.set()
        return {**metrics, "aborted_requests": float(aborted)}


@dataclass
class VersionedCompletion(Completion):
    """A completion put together from segments: the version of each of its tokens."""

    versions: list[int] = field(default_factory=list)


class PartialRollout:
    """``generate`` for one group under live weight updates: each of the ``n`` samples is its own
    request, resumed from prompt + partial output whenever an update aborts it. After
    ``generate``, ``tag(samples)`` writes each token's true version into the Samples."""

    def __init__(self, fleet: Fleet, gate: WeightGate, trace: Trace, stats: RolloutStats) -> None:
        self.fleet, self.gate, self.trace, self.stats = fleet, gate, trace, stats
        self.versions: list[list[int]] = []
        self.resumes: list[int] = []

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, session_id: str | None = None
    ) -> list[Completion]:
        results = await asyncio.gather(
            *(
                self.sample(prompt_ids, replace(params, n=1, seed=_nth_seed(params.seed, i)))
                for i in range(params.n)
            )
        )
        self.versions = [versions for _, versions, _ in results]
        self.resumes = [resumes for _, _, resumes in results]
        return [completion for completion, _, _ in results]

    async def sample(
        self, prompt_ids: list[int], params: SamplingParams
    ) -> tuple[Completion, list[int], int]:
        """One response: its completion, the version of each token, how often it was resumed."""
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        resumes = failures = 0
        aborted = False
        while resumes <= MAX_RESUMES:
            version = await self.gate.enter()
            if aborted:
                self.stats.resumed += 1
                aborted = False
            server = self.fleet.pick()
            segment = replace(params, max_tokens=params.max_tokens - len(tokens))
            try:
                with self.trace.span(
                    "generate", f"rollout {server.url}", version=version, prefix=len(tokens)
                ):
                    (out,) = await server.generate(prompt_ids + tokens, segment)
            except EngineError:
                # A dropped connection (e.g. a keep-alive socket the server just closed) loses
                # at most this segment: resume from what came back before, a few times.
                failures += 1
                self.stats.failed_segments += 1
                if failures > MAX_SEGMENT_FAILURES:
                    raise
                continue
            finally:
                self.gate.leave()
            failures = 0
            tokens += out.token_ids
            logprobs += out.logprobs
            versions += [version] * len(out.token_ids)
            self.stats.segments += 1
            self.stats.generated_tokens += len(out.token_ids)
            if out.finish_reason != "abort":
                done = VersionedCompletion(tokens, logprobs, out.finish_reason, version, versions)
                return done, versions, resumes
            self.stats.aborted += 1
            if len(tokens) >= params.max_tokens:  # aborted right at the end: it is complete
                done = VersionedCompletion(tokens, logprobs, "length", version, versions)
                return done, versions, resumes
            resumes += 1
            aborted = True
        raise EngineError(f"a request came back aborted {MAX_RESUMES} times")

    def tag(self, samples: list[Sample]) -> list[Sample]:
        """Per-token versions and resume counts of the samples built from the last
        ``generate`` (``trident.pipeline.rollout.generate_group`` keeps the order)."""
        for s, versions, resumes in zip(samples, self.versions, self.resumes, strict=True):
            s.versions[s.prompt_len :] = versions
            s.metrics["resumes"] = float(resumes)
        return samples


def _nth_seed(seed: int | None, i: int) -> int | None:
    # n requests of one group with one seed would all sample the same response
    return None if seed is None else seed + i


# ---------------------------------------------------------------------------------------------
# The loop (shared by the real run, the tests and the simulated benchmark)

GroupMaker = Callable[[GroupTicket], Awaitable[list[Sample]]]
StepHook = Callable[[int, list[Sample], dict[str, float]], Awaitable[None]]


async def run_separate(
    buffer: RolloutBuffer,
    gate: WeightGate,
    make_group: GroupMaker,
    trainer: Trainer,
    steps: int,
    trace: Trace,
    on_step: StepHook,
) -> None:
    """``steps`` training steps with rollout streaming into ``buffer`` all along."""
    rollout = asyncio.create_task(keep_generating(buffer, make_group))
    try:
        for step in range(steps):
            t0 = trace.now()
            with trace.span("queue wait", "trainer"):
                samples = await buffer.next_batch()
            depth = buffer.depth
            t1 = trace.now()
            with trace.span("train", "trainer", step=step):
                metrics = await trainer.train_step(samples)
            t2 = trace.now()
            with trace.span("weight sync", "trainer", version=step + 1):
                sync = await gate.update(step + 1, lambda v=step + 1: trainer.sync_weights(v))
            buffer.advance(step + 1)
            trace.counter("buffer", "buffer", **depth)
            metrics |= {f"sync/{k}": v for k, v in sync.items()}
            metrics |= _times(t0, t1, t2, trace.now()) | _depth(depth)
            await on_step(step, samples, metrics)
    finally:
        # partial outputs come back and are counted (bounded: the servers may be the problem)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(gate.close_and_drain(), timeout=60)
        rollout.cancel()
        await asyncio.gather(rollout, return_exceptions=True)


async def keep_generating(buffer: RolloutBuffer, make_group: GroupMaker) -> None:
    """Start a group whenever the buffer admits one; each group runs as its own task."""
    groups: set[asyncio.Task] = set()
    try:
        while (ticket := await buffer.admit()) is not None:
            task = asyncio.create_task(generate_into(buffer, make_group, ticket))
            groups.add(task)
            task.add_done_callback(groups.discard)
    finally:
        for task in groups:
            task.cancel()
        await asyncio.gather(*groups, return_exceptions=True)


async def generate_into(buffer: RolloutBuffer, make_group: GroupMaker, ticket: GroupTicket) -> bool:
    """Generate and score one group into the buffer; False if it had nothing trainable."""
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


def _times(t0: float, t1: float, t2: float, t3: float) -> dict[str, float]:
    return {"time/wait_s": t1 - t0, "time/train_s": t2 - t1, "time/sync_s": t3 - t2}


def _depth(depth: dict[str, int]) -> dict[str, float]:
    return {f"buffer/{k}": float(v) for k, v in depth.items()}


def staleness_metrics(samples: list[Sample], version: int, max_staleness: int) -> dict[str, float]:
    """Per-token staleness of a batch trained at ``version``: mean, max and histogram."""
    ages = Counter(
        version - v for s in samples for v, m in zip(s.versions, s.loss_mask, strict=True) if m
    )
    total = sum(ages.values()) or 1
    out = {
        "staleness/mean": sum(a * n for a, n in ages.items()) / total,
        "staleness/max": float(max(ages, default=0)),
    }
    out |= {f"staleness/frac_{a}": ages.get(a, 0) / total for a in range(max_staleness + 1)}
    return out


def pipeline_summary(
    trace: Trace,
    buffer: RolloutBuffer,
    stats: RolloutStats,
    servers: list[str],
    start: float,
    end: float,
) -> dict[str, Any]:
    """The run's pipeline figures: throughput, idle fractions, staleness, interruptions, waste."""
    wall = end - start
    trained = buffer.stats.trained_samples
    thrown_away = max(stats.generated_tokens - buffer.stats.trained_tokens, 0)
    return {
        "wall_s": wall,
        "trained_samples": trained,
        "seconds_per_trained_sample": wall / max(trained, 1),
        "trainer_idle_fraction": trace.idle_fraction(["trainer"], start, end, TRAINER_BUSY),
        "rollout_idle_fraction": trace.idle_fraction(
            [f"rollout {url}" for url in servers], start, end, {"generate"}
        ),
        "staleness_histogram": {str(a): n for a, n in sorted(buffer.stats.staleness.items())},
        "staleness_fractions": {str(a): f for a, f in buffer.stats.staleness_fractions().items()},
        "aborted_requests": stats.aborted,
        "resumed_requests": stats.resumed,
        "failed_requests": stats.failed_segments,
        "generated_tokens": stats.generated_tokens,
        "trained_tokens": buffer.stats.trained_tokens,
        "tokens_thrown_away": thrown_away,
        "wasted_token_fraction": thrown_away / max(stats.generated_tokens, 1),
        "dropped_groups": buffer.stats.dropped_groups,
    }


# ---------------------------------------------------------------------------------------------
# The real run: vLLM servers, the FSDP2 trainer on Ray, prompts, rewards, logging


class RayTrainer:
    """``Trainer`` over ``TrainerGroup`` (blocking Ray calls, run in a worker thread)."""

    def __init__(self, group: Any) -> None:
        self.group = group

    async def train_step(self, samples: list[Sample]) -> dict[str, float]:
        return await asyncio.to_thread(self.group.call, "train_step", samples)

    async def sync_weights(self, version: int) -> dict[str, float]:
        return await asyncio.to_thread(self.group.call, "sync_weights", version)


class AsyncRun:
    """What both async drivers do around their loop: prompts and rewards, the per-step log
    (metrics, progress, checkpoints), evals, the trace and the summary in the run directory."""

    def __init__(self, cfg: Any, fleet: Any, trainer: Any, log: Any) -> None:
        self.cfg, self.group, self.log = cfg, trainer, log
        self.router = fleet.router
        self.run_dir = Path(cfg.derived.run_dir)
        self.tokenizer = load_tokenizer(cfg.model.path)
        self.cursor = PromptCursor(split_rows(cfg, "train"), cfg.run.seed, cfg.data.shuffle)
        self.rewards = RewardModel.from_config(cfg.reward)
        self.rollout = GroupRollout(cfg, self.tokenizer, self.rewards)
        self.params = sampling_params(cfg.rollout)
        self.trainer = RayTrainer(trainer)
        self.trace = Trace(asyncio.get_running_loop().time)
        self.stats = RolloutStats()
        self.buffer = RolloutBuffer(
            cfg.pipeline.prompts_per_step,
            cfg.pipeline.max_staleness,
            total_groups=cfg.pipeline.prompts_per_step * cfg.pipeline.steps,
            max_running=cfg.pipeline.max_running_groups or None,
        )
        self.progress = StepProgress(cfg.pipeline.steps, enabled=cfg.telemetry.progress)
        self.results: dict[str, Any] = {}
        self.start = self.step_start = 0.0
        self.window: Counter[str] = Counter()  # counts since the last step's log
        rounds = cfg.pipeline.dynamic_sampling_rounds
        self.signal = SignalFilter((rounds - 1) * cfg.pipeline.prompts_per_step)

    async def begin(self) -> None:
        await asyncio.to_thread(
            self.group.call, "connect", self.router.urls, weight_backend(self.cfg)
        )
        if self.cfg.eval.before_after:
            self.results["before"] = await evaluate(
                self.router, self.tokenizer, heldout_rows(self.cfg), self.cfg
            )
        self.start = self.step_start = self.trace.now()

    def next_row(self) -> dict:
        return self.cursor.next_batch(1)[0]

    async def score(self, samples: list[Sample]) -> list[Sample]:
        """Rewards for a group, then what the loss can use: infrastructure failures leave it
        (``reward.*``), so do samples without a model-written token; with dynamic sampling a
        group without signal comes back empty (the buffer then starts a fresh prompt)."""
        with self.trace.span("reward", "reward", samples=len(samples)):
            await self.rollout.finish(samples)
        kept = trainable(samples, self.cfg.reward.exclude_infra_errors)
        self.window["infra_errors"] += sum(s.status == "infra_error" for s in samples)
        self.window["untrainable_samples"] += sum(no_tokens(s) for s in samples)
        if self.cfg.algo.dynamic_sampling and kept and not self.signal.keep(kept):
            return []
        return kept

    async def on_step(self, step: int, samples: list[Sample], metrics: dict[str, float]) -> None:
        cfg, now = self.cfg, self.trace.now()
        metrics = rollout_metrics(samples) | metrics
        metrics["infra_errors"] = self.window["infra_errors"]
        metrics["untrainable_samples"] = float(self.window["untrainable_samples"])
        metrics |= overlong_metrics(samples)
        if cfg.env.name:
            metrics |= agent_metrics(samples)
        if cfg.algo.dynamic_sampling:
            metrics |= self.signal.metrics()
        self.window.clear()
        metrics |= staleness_metrics(samples, step, cfg.pipeline.max_staleness)
        metrics |= {
            "version": step + 1,
            "rollout/segments": self.stats.segments,
            "rollout/aborted": self.stats.aborted,
            "rollout/resumed": self.stats.resumed,
            "rollout/generated_tokens": self.stats.generated_tokens,
            # over this step's window [end of the previous step, now]
            "trainer_idle_fraction": self.trace.idle_fraction(
                ["trainer"], self.step_start, now, TRAINER_BUSY
            ),
            "rollout_idle_fraction": self.trace.idle_fraction(
                [f"rollout {u}" for u in self.router.urls], self.step_start, now, {"generate"}
            ),
        }
        self.step_start = now
        self.log.log(step, metrics)
        self.progress.update(step, metrics)
        every = cfg.checkpoint.every
        if every and (step + 1) % every == 0 and step + 1 < cfg.pipeline.steps:
            with self.trace.span("checkpoint", "trainer"):
                await asyncio.to_thread(
                    save_checkpoint,
                    self.group,
                    self.run_dir,
                    f"step_{step + 1}",
                    cfg.checkpoint.keep_last,
                )

    async def finish(self) -> dict[str, Any]:
        end = self.trace.now()
        self.progress.close()
        summary = pipeline_summary(
            self.trace, self.buffer, self.stats, self.router.urls, self.start, end
        )
        summary |= {
            "mode": self.cfg.pipeline.mode,
            "max_staleness": self.cfg.pipeline.max_staleness,
        }
        self.trace.write(self.run_dir / "trace.json")
        (self.run_dir / "pipeline.json").write_text(json.dumps(summary, indent=2) + "\n")
        self.results["pipeline"] = summary
        self.results["final_checkpoint"] = await asyncio.to_thread(
            save_checkpoint, self.group, self.run_dir, "final", None
        )
        if self.cfg.eval.before_after:
            self.results["after"] = await evaluate(
                self.router, self.tokenizer, heldout_rows(self.cfg), self.cfg
            )
        return self.results


async def train(cfg: Any, fleet: Any, trainer: Any, log: Any) -> dict[str, Any]:
    """``pipeline.mode=separate_async``: the driver ``trident.pipeline.run`` starts."""
    run = AsyncRun(cfg, fleet, trainer, log)
    await run.begin()
    gate = WeightGate(run.router)

    async def make_group(ticket: GroupTicket) -> list[Sample]:
        row = run.next_row()
        partial = PartialRollout(run.router, gate, run.trace, run.stats)
        samples = await run.rollout.generate(partial, row, ticket.version)
        if not cfg.env.name:  # trajectories take their versions from each turn's completion
            partial.tag(samples)
        return await run.score(samples)

    await run_separate(
        run.buffer, gate, make_group, run.trainer, cfg.pipeline.steps, run.trace, run.on_step
    )
    return await run.finish()
