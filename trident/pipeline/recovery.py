"""A dead rollout server survived: taken out at once, restarted, brought to the served weights,
back in.

1. **Detection.** A request that fails asks the server's ``/health``; a server that does not
   answer is taken out of the router at once (``Router.failed``), and the periodic check
   (``rollout.health_check_s``) takes out one that fails two checks in a row even while nothing
   is sent to it.

   A frozen server is a dead one. A stopped (``SIGSTOP``) or wedged engine core leaves its API
   server answering ``/health``, so liveness is checked by the engine's work instead
   (``Liveness``): a server that has requests of ours pending (``VLLMClient.outstanding``) and
   whose engine makes no progress for ``rollout.liveness_timeout_s`` (read from ``/metrics``
   every fifth of that: tokens prefilled, tokens generated, KV-cache usage;
   ``VLLMClient.progress``) is taken out like a dead one; its restart kills its process group.
   Why a live server cannot trip it: a busy one progresses every engine step, whatever its
   queue. With a full batch, the running requests decode a token each step (vLLM schedules
   its running requests before any waiting one), so the generated-token count moves however
   long the waiting queue; a long prompt is prefilled in chunks alongside those decodes, and
   each chunk takes KV-cache blocks (usage moves) before the prompt's first token counts; the
   only step with none of these is
   one whose requests are all mid-prefill, bounded by one ``max_model_len`` prompt's prefill,
   seconds where the default timeout is a minute. A paused server has none of ours pending: the
   weight gate drains (aborts and awaits) every request before a sync pauses the servers, and
   an idle one has none either, so neither is judged. A frozen API server no longer answers
   ``/health`` (nor ``/metrics``) and is taken out by the health check after two misses.
2. **Resubmission.** The request that failed is sent again to a server that is up: a streamed
   sample from the prefix it had already received (``separate_async.PartialRollout``: every
   token keeps the version that produced it), a whole group again from its prompt (``sync``,
   ``colocate_async``, eval). Token in, token out: nothing is re-tokenized, nothing is counted
   twice (a failed request returned no tokens). With every server down, requests wait.
3. **Restart.** The server's actor stops what is left of it (the whole process group) and
   starts it again on the same node and port (``RolloutFleet.restart``), at most
   ``rollout.max_restarts`` times per server; after that, or if it does not come back, the run
   stops with the server's log tail (killed by Ray's memory monitor: with that one line).
4. **Rejoin.** The restarted server serves the start-up weights, so rank 0 pushes it its kept
   copy of the version being served (``WeightSync.rejoin``: whatever the trainer has learned
   since is not in it) and verifies it with that version's probe, like every sync. This holds the
   weight gate's lock, so no weight update runs meanwhile; then the router sends to it again. A
   server that dies during its rejoin (it no longer answers ``/health``) is restarted again,
   within ``rollout.max_restarts``.

5. **Join and leave** (``members``): every second the run directory's ``fleet/`` is read for
   servers asking to join or leave (``trident.rollout.membership``). A joiner is brought to the
   served version like a restarted server (the kept copy, pushed and verified, under the weight
   gate's lock) and only then routed to; a leaver gets no new request, and is answered once its
   requests in flight have finished where they were. A server this run did not start (attached,
   joined) that dies is left out, not restarted. With fewer than ``rollout.min_servers`` up the
   run waits for a joiner, saying so; with ``min_servers=0`` (the default) and none up it stops.

Each recovery is timed (detected -> back in) into ``rollout/recovery_s``; ``rollout/restarts``
counts them over the run; ``rollout/servers`` is the servers up at each step. It is also a
``restart`` span on the server in the run's trace, so a hang during one is reported as that
stage.

Simplifications: the server restarts where its actor lives (a lost node is not replaced); a
weight update that fails because a server died during it is repeated once without that server
(``WeightGate.update``), a second failure stops the run (resume it with ``--resume``); only the shm
weight backend can bring a server back (the GPU backends stop the run); an environment's
trajectory on a dead server ends as ``infra_error`` (counted by the ledger, not trained).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from trident.cluster.ray_cluster import out_of_memory
from trident.pipeline.gate import WeightGate
from trident.rollout import membership
from trident.rollout.engine import VLLMClient
from trident.rollout.router import Router
from trident.rollout.vllm_server import log_tail
from trident.telemetry.trace import Trace
from trident.train.group import TrainerRankError


@dataclass
class Elastic:
    """Servers joining and leaving the run (module docstring, 5.)."""

    run_dir: Path  # whose ``fleet/`` joiners and leavers write to
    client: Callable[[str], VLLMClient]  # a client for a joiner's url
    min_servers: int = 0  # rollout.min_servers
    max_servers: int = 0  # rollout.max_servers (0: any)


class ServerDiedError(RuntimeError):
    """A rollout server died and could not be brought back (or did so too often)."""


class ServerRestarter(Protocol):
    """The rollout servers' owner (``trident.rollout.fleet.RolloutFleet``)."""

    nodes: dict[str, str]  # each server's url -> the Ray node it runs on

    async def restart(self, i: int) -> VLLMClient:
        """Called for each recovery: restart server ``i`` on its url, return a client for it."""
        ...

    def log_path(self, i: int) -> Path: ...


class Rejoiner(Protocol):
    """The trainer as recovery uses it (``trident.train.group.TrainerGroup``)."""

    async def rejoin(self, url: str) -> dict[str, float]:
        """Called once a restarted server answers: push it the served version, verified."""
        ...


class Liveness:
    """The frozen-engine rule for one server (module docstring, 1.): how long its engine has
    made no progress while requests of ours were pending on it."""

    def __init__(self) -> None:
        self.mark: tuple[float, ...] | None = None  # the progress last seen
        self.since: float | None = None  # when it was seen with requests pending

    def stalled_s(self, now: float, pending: int, progress: tuple[float, ...] | None) -> float:
        """Called every check with the requests of ours in flight and ``progress`` as read
        (None: unreadable, then nothing is judged); the seconds without progress since requests
        were pending, 0 when none are or the engine moved."""
        if not pending or progress is None or progress != self.mark:
            self.mark, self.since = progress, now if pending and progress is not None else None
            return 0.0
        if self.since is None:
            self.since = now
        return now - self.since


class ServerRecovery:
    """See the module docstring. ``watch()`` runs the periodic health and liveness checks;
    ``close()`` stops any recovery under way."""

    def __init__(
        self,
        router: Router,
        gate: WeightGate,
        trainer: Rejoiner,
        fleet: ServerRestarter | None,
        max_restarts: int,
        health_check_s: float,
        trace: Trace | None = None,
        clock: Callable[[], float] = time.monotonic,
        liveness_timeout_s: float = 0.0,
        elastic: Elastic | None = None,
    ) -> None:
        """``fleet``: what restarts the servers this run started (None: it started none);
        ``elastic``: where joiners ask, and the fleet's bounds (None: no joining)."""
        self.router, self.gate, self.trainer, self.fleet = router, gate, trainer, fleet
        self.trace = trace or Trace()  # a recovery is a span (``restart``) the watchdog can name
        self.max_restarts, self.health_check_s, self.clock = max_restarts, health_check_s, clock
        self.liveness_timeout_s = liveness_timeout_s
        self.elastic = elastic
        self.owned = len(router.clients) if fleet is not None else 0  # servers we can restart
        self.restarts: Counter[int] = Counter()
        self.last_recovery_s: float | None = None  # detected -> back in, the latest recovery
        self._tasks: set[asyncio.Task] = set()
        self._asked: set[Path] = set()  # join and leave requests being answered
        router.on_down = self.down
        router.min_up = max(1, elastic.min_servers if elastic else 0)

    def down(self, i: int) -> None:
        """``Router.on_down``: server ``i`` was taken out; restart it (or give up)."""
        url = self.router.clients[i].url
        if i >= self.owned:  # attached or joined: not ours to restart
            self.router.retire(i)
            note = "left out (this run did not start it)"
            print(f"rollout server {i} ({url}) is down: {note}", file=sys.stderr)
            self._short_of_servers()
            return
        if self.restarts[i] >= self.max_restarts:
            self.router.give_up(ServerDiedError(self._too_often(i)))
            return
        self.restarts[i] += 1
        print(
            f"rollout server {i} ({url}) is down: restarting it "
            f"({self.restarts[i]}/{self.max_restarts})",
            file=sys.stderr,
        )
        task = asyncio.get_running_loop().create_task(self._recover(i, self.clock()))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _recover(self, i: int, detected: float) -> None:
        with self.trace.span("restart", f"rollout {self.router.clients[i].url}"):
            await self._restart(i, detected)

    async def _restart(self, i: int, detected: float) -> None:
        assert self.fleet is not None  # only the servers it started are restarted
        while True:
            try:
                client = await self.fleet.restart(i)
            except Exception as e:
                oom = out_of_memory(e)
                if oom:  # Ray's memory monitor (a trainer rank often in the same sweep): one
                    # line, what it killed and what to lower; the server's log says nothing of it
                    error = ServerDiedError(f"rollout server {i} ran out of memory: {oom}")
                else:
                    error = ServerDiedError(
                        f"rollout server {i} died and could not be restarted: {e}\n{self._log(i)}"
                    )
                self.router.give_up(error)
                return
            try:
                async with self.gate.exclusive():  # no weight update between rejoin and back in
                    await self.trainer.rejoin(client.url)
                    self.router.bring_in(i, client)
                    version = self.gate.version
                break
            except Exception as e:
                # A trainer's failure (a dead rank, a failed verify of a live server) stops the
                # run; a server that died again during its rejoin is restarted again.
                if isinstance(e, TrainerRankError) or await client.healthy():
                    self.router.give_up(e)
                    return
                await client.aclose()
                if self.restarts[i] >= self.max_restarts:
                    self.router.give_up(ServerDiedError(f"{self._too_often(i)}; {e}"))
                    return
                self.restarts[i] += 1
                print(
                    f"rollout server {i} ({client.url}) died during its rejoin: restarting it "
                    f"({self.restarts[i]}/{self.max_restarts})",
                    file=sys.stderr,
                )
        seconds = self.clock() - detected
        self.last_recovery_s = seconds
        print(
            f"rollout server {i} is back at weight version {version} after {seconds:.1f} s",
            file=sys.stderr,
        )

    def _short_of_servers(self) -> None:
        """After a server left or was left out: wait for joiners, saying so, or stop the run."""
        up, need = sum(self.router.up), self.router.min_up
        if up >= need:
            return
        if self.elastic is None or self.elastic.min_servers == 0:
            if not up:
                self.router.give_up(
                    ServerDiedError(
                        "no rollout server is up, and none can be restarted (with "
                        "rollout.min_servers=1 the run would wait for `trident rollout serve "
                        "--join RUN_DIR`)"
                    )
                )
            return
        print(
            f"waiting for rollout servers: {up} up, rollout.min_servers={need}; join one with "
            f"`trident rollout serve --join {self.elastic.run_dir}`",
            file=sys.stderr,
            flush=True,
        )

    async def watch(self) -> None:
        """The periodic checks, until cancelled: health, liveness, joiners and leavers."""
        await asyncio.gather(self._health(), self._liveness(), self._members())

    async def _members(self) -> None:
        """Every second: answer the servers asking to join or leave (module docstring, 5.)."""
        if self.elastic is None:
            return
        self._short_of_servers()  # e.g. rollout.min_servers above the servers it started with
        membership.open_fleet(self.elastic.run_dir)
        while True:
            for kind, url, request in membership.pending(self.elastic.run_dir):
                if request in self._asked:
                    continue
                self._asked.add(request)
                handle = self._join if kind == "join" else self._leave
                task = asyncio.get_running_loop().create_task(handle(url.rstrip("/"), request))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            await asyncio.sleep(1.0)

    async def _join(self, url: str, request: Path) -> None:
        assert self.elastic is not None
        t0 = self.clock()
        here = [i for i in self._at(url) if self.router.up[i]]
        if here:  # already routed to
            membership.answer(
                request, "joined", index=here[0], version=self.gate.version, seconds=0.0
            )
            return
        cap = self.elastic.max_servers
        if cap and sum(self.router.up) >= cap:
            membership.answer(request, "refused", reason=f"rollout.max_servers={cap} are up")
            return
        client = self.elastic.client(url)
        try:
            async with self.gate.exclusive():  # no weight update between rejoin and routing
                await self.trainer.rejoin(url)
                i = self.router.add(client)
                version = self.gate.version
        except Exception as e:
            await client.aclose()
            membership.answer(request, "refused", reason=f"{type(e).__name__}: {e}")
            if isinstance(e, TrainerRankError):
                self.router.give_up(e)
            return
        seconds = self.clock() - t0
        membership.answer(request, "joined", index=i, version=version, seconds=seconds)
        print(
            f"rollout server {i} ({url}) joined at weight version {version} in {seconds:.1f} s",
            file=sys.stderr,
        )

    async def _leave(self, url: str, request: Path) -> None:
        t0 = self.clock()
        here = self._at(url)
        i = here[-1] if here else None
        if i is not None and i not in self.router.retired:
            self.router.retire(i)
            client = self.router.clients[i]
            pending = client.outstanding
            while client.outstanding:  # its requests in flight finish where they are
                await asyncio.sleep(0.1)
            seconds = self.clock() - t0
            print(
                f"rollout server {i} ({url}) left after {seconds:.1f} s "
                f"({pending} requests in flight finished)",
                file=sys.stderr,
            )
            self._short_of_servers()
        membership.answer(request, "left", seconds=self.clock() - t0)

    def _at(self, url: str) -> list[int]:
        """The router's indices of the server at ``url`` (one per time it was added)."""
        return [i for i, c in enumerate(self.router.clients) if c.url == url]

    async def _health(self) -> None:
        """Every ``rollout.health_check_s``: take out a server that failed two checks in a row."""
        if self.health_check_s <= 0:
            return
        misses: Counter[int] = Counter()
        while True:
            await asyncio.sleep(self.health_check_s)
            for i, client in enumerate(list(self.router.clients)):
                if not self.router.up[i]:
                    misses[i] = 0
                    continue
                misses[i] = 0 if await client.healthy() else misses[i] + 1
                if misses[i] >= 2:
                    self.router.take_out(i)

    async def _liveness(self) -> None:
        """Every fifth of ``rollout.liveness_timeout_s``: take out a server whose engine made no
        progress for that long with requests of ours pending (``Liveness``)."""
        if self.liveness_timeout_s <= 0:
            return
        rules: dict[int, Liveness] = {}
        while True:
            await asyncio.sleep(self.liveness_timeout_s / 5)
            for i in range(len(self.router.clients)):
                rules.setdefault(i, Liveness())
            await asyncio.gather(*(self._judge(i, rule) for i, rule in rules.items()))

    async def _judge(self, i: int, rule: Liveness) -> None:
        """One liveness check of server ``i``: take it out if ``rule`` finds it frozen."""
        client = self.router.clients[i]
        pending = client.outstanding if self.router.up[i] else 0
        progress = await client.progress() if pending else None
        stalled = rule.stalled_s(self.clock(), pending, progress)
        if stalled < self.liveness_timeout_s or self.router.clients[i] is not client:
            return
        if self.router.up[i]:
            print(
                f"rollout server {i} ({client.url}) is frozen: {pending} requests pending and "
                f"no engine progress for {stalled:.0f} s "
                f"(rollout.liveness_timeout_s={self.liveness_timeout_s:g})",
                file=sys.stderr,
            )
            self.router.take_out(i)

    def metrics(self) -> dict[str, float]:
        out = {
            "rollout/restarts": float(sum(self.restarts.values())),
            "rollout/servers": float(sum(self.router.up)),
        }
        if self.last_recovery_s is not None:
            out["rollout/recovery_s"] = self.last_recovery_s
        return out

    def _too_often(self, i: int) -> str:
        return (
            f"rollout server {i} ({self.router.clients[i].url}) died and has been restarted "
            f"{self.restarts[i]} times already (rollout.max_restarts={self.max_restarts}); "
            f"{self._log(i)}"
        )

    def _log(self, i: int) -> str:
        if self.fleet is None:
            return "its log is where it was started"
        return f"its log ({self.fleet.log_path(i)}) ends:\n{log_tail(self.fleet.log_path(i))}"

    async def close(self) -> None:
        if self.elastic is not None:
            membership.close_fleet(self.elastic.run_dir)
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
