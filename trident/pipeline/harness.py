"""``RunHarness``: everything a training run does around its schedule, written once.

A driver (``sync``, ``colocate_async``, ``separate_async``) is only its schedule: when groups are
generated, when the trainer takes a batch, when weights are installed. The harness owns the rest,
the same in every mode:

- set-up: tokenizer, the prompt stream (``PromptCursor``), the group rollout and its rewards, the
  version-aware buffer (η = ``pipeline.max_staleness``; ``sync`` runs it at η = 0), the weight
  gate, the trace; connecting the trainer to the servers and installing its weights as version
  0; the eval before;
- groups: the next prompt with a deterministic group id (``<row id>-g<draw>``, so two runs on
  one seed train the same ids), scoring, the trainability filters and dynamic sampling
  (``SignalFilter``, the one implementation);
- each step: the metrics (``trident.pipeline.metrics``: one definition and one meaning of every
  key in every mode), the log line, the progress bar, the checkpoint cadence;
- the token ledger (``trident.pipeline.ledger``): every generated sample and response token is
  trained, waiting in the buffer, or discarded for a named reason; checked at every step (an
  imbalance stops the run), logged as ``ledger/*``;
- per-sample lineage (``telemetry.samples``): trained and discarded samples to ``samples/``;
- checkpoints (``trident.pipeline.checkpoint``): the harness's own state (``state_dict``) beside
  the trainer's, and resuming from them (``restore``);
- the end: ``trace.json`` and ``pipeline.json`` in the run directory, the final checkpoint, the
  eval after.

The run's state lives here and in the trainer, nowhere else: a checkpoint is exactly those two.
"""

from __future__ import annotations

import asyncio
import copy
import json
import random
import zlib
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from trident.agent.loop import agent_metrics
from trident.config import TridentConfig
from trident.data.loaders import PromptCursor
from trident.models.load import load_tokenizer
from trident.pipeline import checkpoint
from trident.pipeline.buffer import GroupTicket, RolloutBuffer
from trident.pipeline.checkpoint import read_run_state
from trident.pipeline.eval import evaluate, heldout_rows
from trident.pipeline.gate import WeightGate
from trident.pipeline.groups import GroupRollout, SignalFilter, split_rows, trainable
from trident.pipeline.ledger import DISCARD_REASONS, Ledger
from trident.pipeline.ledger import LedgerError as LedgerError  # raised by ``account``
from trident.pipeline.members import Membership, Rejoiner
from trident.pipeline.metrics import (
    TRAINER_BUSY,
    RolloutStats,
    generated_metrics,
    overlong_metrics,
    pipeline_summary,
    staleness_metrics,
    trained_metrics,
)
from trident.pipeline.partial import PartialResponse
from trident.pipeline.progress import StepProgress
from trident.pipeline.recovery import ServerRecovery, ServerRestarter
from trident.pipeline.stages import GroupMaker, Schedule, Trainer
from trident.pipeline.watchdog import Watchdog
from trident.rollout.engine import EngineError, RolloutEngine, SamplingParams
from trident.rollout.fleet import clients
from trident.rollout.router import Router
from trident.sample import Sample
from trident.telemetry.lineage import SampleLog
from trident.telemetry.metrics import MetricsLogger
from trident.telemetry.trace import Trace


class RunTrainer(Trainer, Rejoiner, Protocol):
    """The trainer as the harness sees it (``trident.train.group.TrainerGroup``): the schedule's
    two calls plus connecting, checkpointing and bringing back a restarted server."""

    async def connect(self, urls: list[str], backend: str, nodes: Mapping[str, str]) -> None:
        """Called once by ``begin``, before the first install; ``nodes``: the Ray node of each
        server the run started (the others' hosts are told by their urls)."""
        ...

    async def save(self, out_dir: Path) -> None:
        """Called by ``checkpoint``: the HF export and the full training state in ``out_dir``."""
        ...

    async def load(self, ckpt_dir: Path) -> None:
        """Called by ``begin`` on resume, before the first install."""
        ...


@dataclass
class InFlight:
    """A group admitted and not yet in the buffer: what a checkpoint keeps of it."""

    ticket: GroupTicket
    row: dict
    group_id: str
    progress: list[PartialResponse] = field(default_factory=list)  # per sample, when streamed


class RunHarness:
    """One training run's state and its set-up, per-step and tear-down work (module docstring)."""

    def __init__(
        self,
        cfg: TridentConfig,
        router: Router,
        trainer: RunTrainer,
        log: MetricsLogger,
        backend: str,
        pids: dict[str, int] | None = None,
        fleet: ServerRestarter | None = None,
    ) -> None:
        """``backend``: the run's weight backend, resolved once (``pipeline/run.py``);
        ``fleet``: what restarts a dead rollout server this run started (without one, a dead
        server is left out: ``trident.pipeline.recovery``)."""
        p = cfg.pipeline
        self.cfg, self.router, self.trainer, self.log = cfg, router, trainer, log
        self.backend, self.fleet = backend, fleet
        self.run_dir = Path(cfg.derived.run_dir)
        self.tokenizer = load_tokenizer(cfg.model.path)
        self.cursor = PromptCursor(split_rows(cfg, "train"), cfg.run.seed, cfg.data.shuffle)
        self.rollout = GroupRollout(cfg, self.tokenizer)
        self.trace = Trace(asyncio.get_running_loop().time)
        self.stats = RolloutStats()
        self.buffer = RolloutBuffer(
            p.prompts_per_step,
            p.max_staleness if p.mode != "sync" else 0,
            total_groups=p.prompts_per_step * p.steps,
            max_running=p.max_running_groups or None,
        )
        self.gate = WeightGate(
            router,
            answer_within_s=cfg.rollout.liveness_timeout_s,
            sleep_level=cfg.rollout.sleep_level,
        )
        rc = cfg.rollout
        model = router.clients[0].model  # a joiner serves the policy as the others do
        members = Membership(
            router,
            self.gate,
            trainer,
            self.run_dir,
            lambda url: clients(cfg, [url], model)[0],
            rc.min_servers,
            rc.max_servers,
        )
        self.recovery = ServerRecovery(
            router,
            self.gate,
            trainer,
            fleet,
            rc.max_restarts,
            rc.health_check_s,
            self.trace,
            liveness_timeout_s=rc.liveness_timeout_s,
            members=members,
        )
        self.signal = SignalFilter(p.dynamic_sampling_max_dropped or 2 * p.prompts_per_step)
        self.progress = StepProgress(p.steps, enabled=cfg.telemetry.progress)
        t = cfg.telemetry
        self.lineage = SampleLog(self.run_dir, t.samples, t.sample_text_chars)
        self.results: dict[str, Any] = {}
        self.draws = 0
        self.ledger = Ledger()  # cumulative, over the whole run (and its resumes)
        self.generated: list[Sample] = []  # samples generated since the previous step's log
        self.discarded: list[tuple[str, Sample]] = []  # (reason, sample) since the previous log
        self.inflight: dict[int, InFlight] = {}  # ticket index -> group being generated
        self.restored: dict[int, InFlight] = {}  # groups a resumed run generates again
        self.start = self.step_start = 0.0
        self.watchdog = Watchdog(cfg.run.hang_timeout_s, self.run_dir, self.trace, pids)
        self._health: asyncio.Task | None = None

    # -- set-up and tear-down -------------------------------------------------------------------

    async def begin(self, resume_from: Path | None = None) -> None:
        """Connect the trainer to the servers; on resume load the checkpoint's trainer and run
        state; install the trainer's weights as the current version (verified like every sync,
        so the next step is generated by exactly the weights the trainer holds, whatever the
        servers served before) and evaluate the starting policy (the original eval on resume)."""
        nodes = self.fleet.nodes if self.fleet is not None else {}
        await self.trainer.connect(self.router.urls, self.backend, nodes)
        if resume_from is not None:
            with self.trace.span("load checkpoint", "trainer"):
                await self.trainer.load(resume_from)
                self.load_state_dict(read_run_state(resume_from))
        version = self.buffer.version
        await self.gate.update(version, lambda urls: self.trainer.sync_weights(version, urls))
        before = self.run_dir / "eval_before.json"
        if resume_from is not None and before.exists():
            self.results["before"] = json.loads(before.read_text())
        elif self.cfg.eval.before_after:
            self.results["before"] = await self.evaluate()
        self.start = self.step_start = self.trace.now()
        self.watchdog.beat()
        self._health = asyncio.create_task(self.recovery.watch())

    async def close(self) -> None:
        """Stop the health check and any server recovery under way (after ``finish`` or an
        error)."""
        if self._health is not None:
            self._health.cancel()
            await asyncio.gather(self._health, return_exceptions=True)
        await self.recovery.close()

    async def finish(self) -> dict[str, Any]:
        """Pipeline summary (over the steps), final checkpoint, trace and summary to the run
        directory, eval after."""
        end = self.trace.now()
        self.progress.close()
        summary = pipeline_summary(
            self.trace, self.buffer, self.stats, self.router.urls, self.start, end
        )
        summary |= {"mode": self.cfg.pipeline.mode, "max_staleness": self.buffer.max_staleness}
        self.results["final_checkpoint"] = str(await self.checkpoint("final"))
        self.watchdog.beat()
        self.trace.write(self.run_dir / "trace.json")
        (self.run_dir / "pipeline.json").write_text(json.dumps(summary, indent=2) + "\n")
        self.results["pipeline"] = summary
        if self.cfg.eval.before_after:
            self.results["after"] = await self.evaluate()
        return self.results

    async def run(self, schedule: Schedule, make_group: GroupMaker) -> None:
        """Run a driver's schedule with this run's buffer, gate, trainer, trace and step hook."""
        steps = self.cfg.pipeline.steps
        await schedule(
            self.buffer, self.gate, make_group, self.trainer, steps, self.trace, self.on_step
        )

    async def evaluate(self) -> dict[str, Any]:
        rows, rewards = heldout_rows(self.cfg), self.rollout.rewards
        return await evaluate(self.router, self.tokenizer, rows, self.cfg, rewards=rewards)

    # -- groups ---------------------------------------------------------------------------------

    def next_prompt(self) -> tuple[dict, str]:
        """The next prompt row and its group's id (deterministic in the seed and the draw)."""
        (row,) = self.cursor.next_batch(1)
        self.draws += 1
        return row, f"{row.get('id', 'row')}-g{self.draws - 1}"

    def open_group(self, ticket: GroupTicket) -> InFlight:
        """The group ``ticket`` generates: a fresh prompt, or (after a resume) the group the
        checkpoint caught in flight, with its partial responses."""
        group = self.restored.pop(ticket.index, None)
        if group is None:
            row, group_id = self.next_prompt()
            group = InFlight(ticket, row, group_id)
        self.inflight[ticket.index] = group
        return group

    def sampling(self, group_id: str) -> SamplingParams:
        """The group's sampling parameters; ``run.deterministic`` seeds them from the group id,
        so a resumed run samples what the uninterrupted run sampled."""
        params = self.rollout.params
        if not self.cfg.run.deterministic:
            return params
        return replace(params, seed=zlib.crc32(f"{self.cfg.run.seed}:{group_id}".encode()))

    async def generate(self, engine: RolloutEngine, group: InFlight) -> list[Sample]:
        """The group's samples through ``engine`` (rewards not yet computed)."""
        return await self.rollout.generate(
            engine, group.row, group.ticket.version, group.group_id, self.sampling(group.group_id)
        )

    async def group_on_one_server(self, ticket: GroupTicket) -> list[Sample]:
        """A ``GroupMaker`` for schedules without weight updates mid-generation: the whole group
        (all its trajectories' turns) on one server."""
        group = self.open_group(ticket)
        while True:
            await self.router.available()
            server = self.router.pick()
            try:
                with self.trace.span("generate", f"rollout {server.url}", version=ticket.version):
                    samples = await self.generate(server, group)
                break
            except EngineError as e:  # its server died: the whole group again, on another
                if not await self.router.failed(server, e):
                    raise
                self.stats.resubmitted += 1
        for s in samples:
            s.metadata["server"] = server.url
        self.stats.segments += 1
        self.stats.generated_tokens += sum(s.num_response_tokens for s in samples)
        return await self.score(group, samples)

    async def score(self, group: InFlight, samples: list[Sample]) -> list[Sample]:
        """Rewards for a group, then what the loss can use: infrastructure failures leave it
        (``reward.exclude_infra_errors``), so do samples without a model-written token; with
        ``algo.dynamic_sampling`` a group without signal comes back empty (the buffer then
        admits a fresh prompt in its place). Every sample's fate goes into the ledger."""
        with self.trace.span("reward", "reward", samples=len(samples)):
            await self.rollout.finish(samples)
        del self.inflight[group.ticket.index]
        self.generated += samples
        kept = trainable(samples, self.cfg.reward.exclude_infra_errors)
        kept_ids = {id(s) for s in kept}  # identity: equal-looking samples are still two samples
        for s in samples:
            if id(s) not in kept_ids:
                self.discard("infra_error" if s.status == "infra_error" else "untrainable", s)
        if self.cfg.algo.dynamic_sampling and kept and not self.signal.keep(kept):
            for s in kept:
                self.discard("no_signal", s)
            return []
        return kept

    def resumed_tickets(self) -> list[GroupTicket]:
        """The groups a resumed run generates again first (admitted by the checkpoint)."""
        return [g.ticket for g in self.restored.values()]

    def discard(self, reason: str, sample: Sample) -> None:
        self.discarded.append((reason, sample))

    # -- each step ------------------------------------------------------------------------------

    async def on_step(self, step: int, samples: list[Sample], metrics: dict[str, float]) -> None:
        """Log step ``step`` (trained on ``samples``; ``metrics`` from the schedule's stages),
        then checkpoint when ``checkpoint.every`` says so."""
        cfg, now = self.cfg, self.trace.now()
        metrics = trained_metrics(samples) | generated_metrics(self.generated) | metrics
        metrics |= self.account(samples)
        metrics |= overlong_metrics(samples)
        if cfg.env.name:
            metrics |= agent_metrics(samples)
        if cfg.algo.dynamic_sampling:
            metrics |= self.signal.metrics()
        metrics |= staleness_metrics(samples, step, self.buffer.max_staleness)
        metrics |= self.stats.metrics()
        metrics |= self.recovery.metrics()
        wall = max(now - self.step_start, 1e-9)
        metrics |= {
            "version": float(step + 1),
            "time/step_s": wall,
            "rollout_tokens_per_s": metrics["generated/tokens"] / wall,
            # over this step's window [end of the previous step, now]
            "trainer_idle_fraction": self.trace.idle_fraction(
                ["trainer"], self.step_start, now, TRAINER_BUSY
            ),
            "rollout_idle_fraction": self.trace.idle_fraction(
                [f"rollout {u}" for u in self.router.urls], self.step_start, now, {"generate"}
            ),
        }
        self.write_lineage(step, samples)
        self.generated, self.discarded = [], []
        self.step_start = now
        self.log.log(step, metrics)
        self.progress.update(step, metrics)
        self.watchdog.beat()
        if self.checkpoint_due(step):
            await self.checkpoint(f"step_{step + 1}", cfg.checkpoint.keep_last)

    def account(self, trained: list[Sample]) -> dict[str, float]:
        """The token ledger after a step (``trident.pipeline.ledger``), with its discards also
        under the names the step log has always had."""
        out = self.ledger.account(
            self.generated,
            trained,
            self.discarded,
            self.buffer.waiting,
            self.buffer.steps_taken,
            self.cfg.algo.mask_truncated,
        )
        out["infra_errors"] = out["ledger/discarded/infra_error_samples"]
        out["untrainable_samples"] = out["ledger/discarded/untrainable_samples"]
        return out

    def write_lineage(self, step: int, trained: list[Sample]) -> None:
        self.lineage.write(step, trained, trained=True, reason=None, version=step + 1)
        for reason in DISCARD_REASONS:
            dropped = [s for r, s in self.discarded if r == reason]
            self.lineage.write(step, dropped, trained=False, reason=reason, version=step)

    # -- checkpoints ----------------------------------------------------------------------------

    def checkpoint_due(self, step: int) -> bool:
        """A periodic checkpoint after step ``step`` (the final one is always written)."""
        every, done = self.cfg.checkpoint.every, step + 1
        return bool(every) and done % every == 0 and done < self.cfg.pipeline.steps

    async def checkpoint(self, name: str, keep_last: int | None = None) -> Path:
        """Write checkpoint ``name`` (``trident.pipeline.checkpoint``). Generation is held at
        the gate meanwhile (requests in flight come back with their partial output), so the
        groups in flight are caught exactly as far as they got."""
        with self.trace.span("checkpoint", "trainer"):
            await self.gate.close_and_drain()
            try:
                state = self.state_dict()
                return await checkpoint.write(
                    self.run_dir, name, self.trainer.save, state, keep_last
                )
            finally:
                self.gate.reopen()

    def state_dict(self) -> dict[str, Any]:
        """The harness's share of a checkpoint (the trainer keeps its own)."""
        return {
            "step": self.buffer.steps_taken,
            "version": self.gate.version,
            "cursor": self.cursor.state_dict(),
            "draws": self.draws,
            "ledger": self.ledger.state_dict(),
            # scored since the step's log (during the checkpoint's drain): the ledger counts them
            # at the next step, and the buffer may hold them already
            "generated": list(self.generated),
            "discarded": list(self.discarded),
            "stats": asdict(self.stats),
            "buffer": self.buffer.state_dict(),
            "inflight": copy.deepcopy(list(self.inflight.values())),
            "signal": vars(self.signal) | {},
            "rng": {"python": random.getstate(), "numpy": np.random.get_state()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state_dict()``: the groups caught in flight are generated again from
        their partial responses (``restored``) before any new prompt is drawn."""
        self.cursor.load_state_dict(state["cursor"])
        self.draws = state["draws"]
        self.ledger = Ledger(state["ledger"])
        self.generated = list(state.get("generated", []))
        self.discarded = list(state.get("discarded", []))
        self.stats = RolloutStats(**state["stats"])
        vars(self.signal).update(state["signal"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        self.restored = {g.ticket.index: g for g in state["inflight"]}
        self.buffer.load_state_dict(state["buffer"], [g.ticket for g in state["inflight"]])
        self.gate.version = state["version"]
