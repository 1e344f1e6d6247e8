"""A dead rollout server survived: taken out at once, restarted, brought to the served weights,
back in. The whole story, with what each step was tested and measured by: ``docs/failures.md``
("Recovering a rollout server").

1. **Detection**: a failed request whose server's ``/health`` does not answer, two missed
   periodic checks (``rollout.health_check_s``), or a frozen engine: requests of ours pending
   and no engine progress for ``rollout.liveness_timeout_s`` (``Liveness``; why a live server
   cannot trip it is argued in the doc).
2. **Resubmission**: the failed request goes to a server that is up, a streamed sample from its
   prefix (``trident.pipeline.partial``), a whole group from its prompt.
3. **Restart**: on the same node and port (``ServerRestarter.restart``), at most
   ``rollout.max_restarts`` times per server, else the run stops with the server's log tail.
4. **Rejoin**: rank 0 pushes the kept copy of the served version and verifies it
   (``Rejoiner.rejoin``) under the weight gate's lock, then the router sends to it again.

Servers that join and leave are ``trident.pipeline.members``. Each recovery is timed into
``rollout/recovery_s`` and is a ``restart`` span in the trace. Simplifications: a lost node is
not replaced; a weight update that a dying server fails is repeated once without it; only the
shm weight backend can bring a server back.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from trident.cluster.ray_cluster import out_of_memory
from trident.pipeline.gate import WeightGate
from trident.pipeline.members import NONE_UP, Membership, Rejoiner, ServerDiedError
from trident.rollout.engine import VLLMClient
from trident.rollout.router import Router
from trident.rollout.vllm_server import log_tail
from trident.telemetry.trace import Trace
from trident.train.group import TrainerRankError


class ServerRestarter(Protocol):
    """The rollout servers' owner (``trident.rollout.fleet.RolloutFleet``)."""

    nodes: dict[str, str]  # each server's url -> the Ray node it runs on

    async def restart(self, i: int) -> VLLMClient:
        """Called for each recovery: restart server ``i`` on its url, return a client for it."""
        ...

    def log_path(self, i: int) -> Path: ...


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
        members: Membership | None = None,
    ) -> None:
        """``fleet``: what restarts the servers this run started (None: it started none);
        ``members``: the servers joining and leaving (None: no joining)."""
        self.router, self.gate, self.trainer, self.fleet = router, gate, trainer, fleet
        self.trace = trace or Trace()  # a recovery is a span (``restart``) the watchdog can name
        self.max_restarts, self.health_check_s, self.clock = max_restarts, health_check_s, clock
        self.liveness_timeout_s = liveness_timeout_s
        self.members = members
        self.owned = len(router.clients) if fleet is not None else 0  # servers we can restart
        self.restarts: Counter[int] = Counter()
        self.last_recovery_s: float | None = None  # detected -> back in, the latest recovery
        self._tasks: set[asyncio.Task] = set()
        router.on_down = self.down

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
        """After a server was left out: wait for joiners (``Membership``), or stop the run."""
        if self.members is not None:
            self.members.short_of_servers()
        elif not any(self.router.up):
            self.router.give_up(ServerDiedError(NONE_UP))

    async def watch(self) -> None:
        """The periodic checks, until cancelled: health, liveness, joiners and leavers."""
        members = [self.members.watch()] if self.members is not None else []
        await asyncio.gather(self._health(), self._liveness(), *members)

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
        if self.members is not None:
            await self.members.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
