"""Servers joining and leaving a running job (``Membership``), answered by the run's driver.

Every second the run directory's ``fleet/`` is read for servers asking to join or leave
(``trident.rollout.membership``). A joiner is brought to the served version like a restarted
server (the kept copy, pushed and verified, under the weight gate's lock) and only then routed
to; a leaver gets no new request, and is answered once its requests in flight have finished where
they were. With fewer than ``rollout.min_servers`` up the run waits for a joiner, saying so; with
``min_servers=0`` (the default) and none up it stops (``ServerDiedError``).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from trident.pipeline.gate import WeightGate
from trident.rollout import membership
from trident.rollout.engine import VLLMClient
from trident.rollout.router import Router
from trident.train.group import TrainerRankError

NONE_UP = (
    "no rollout server is up, and none can be restarted (with rollout.min_servers=1 the run "
    "would wait for `trident rollout serve --join RUN_DIR`)"
)


class ServerDiedError(RuntimeError):
    """A rollout server died and could not be brought back (or did so too often), or none is
    left up."""


class Rejoiner(Protocol):
    """The trainer as recovery and membership use it (``trident.train.group.TrainerGroup``)."""

    async def rejoin(self, url: str) -> dict[str, float]:
        """Called once a restarted or joining server answers: push it the served version,
        verified."""
        ...


class Membership:
    """The servers that join and leave the run (module docstring). ``watch()`` answers them
    until cancelled; ``close()`` stops any answer under way and closes the run's ``fleet/``."""

    def __init__(
        self,
        router: Router,
        gate: WeightGate,
        trainer: Rejoiner,
        run_dir: Path,
        client: Callable[[str], VLLMClient],
        min_servers: int = 0,
        max_servers: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``run_dir``: whose ``fleet/`` joiners and leavers write to; ``client``: a client for a
        joiner's url; ``min_servers``/``max_servers``: ``rollout.min_servers`` and
        ``rollout.max_servers`` (0: any)."""
        self.router, self.gate, self.trainer = router, gate, trainer
        self.run_dir, self.client, self.clock = run_dir, client, clock
        self.min_servers, self.max_servers = min_servers, max_servers
        self._tasks: set[asyncio.Task] = set()
        self._asked: set[Path] = set()  # join and leave requests being answered
        router.min_up = max(1, min_servers)

    def short_of_servers(self) -> None:
        """After a server left or was left out: wait for joiners, saying so, or stop the run."""
        up, need = sum(self.router.up), self.router.min_up
        if up >= need:
            return
        if self.min_servers == 0:
            if not up:
                self.router.give_up(ServerDiedError(NONE_UP))
            return
        print(
            f"waiting for rollout servers: {up} up, rollout.min_servers={need}; join one with "
            f"`trident rollout serve --join {self.run_dir}`",
            file=sys.stderr,
            flush=True,
        )

    async def watch(self) -> None:
        """Every second, until cancelled: answer the servers asking to join or leave."""
        self.short_of_servers()  # e.g. rollout.min_servers above the servers it started with
        membership.open_fleet(self.run_dir)
        while True:
            for kind, url, request in membership.pending(self.run_dir):
                if request in self._asked:
                    continue
                self._asked.add(request)
                handle = self._join if kind == "join" else self._leave
                task = asyncio.get_running_loop().create_task(handle(url.rstrip("/"), request))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            await asyncio.sleep(1.0)

    async def _join(self, url: str, request: Path) -> None:
        t0 = self.clock()
        here = [i for i in self._at(url) if self.router.up[i]]
        if here:  # already routed to
            membership.answer(
                request, "joined", index=here[0], version=self.gate.version, seconds=0.0
            )
            return
        cap = self.max_servers
        if cap and sum(self.router.up) >= cap:
            membership.answer(request, "refused", reason=f"rollout.max_servers={cap} are up")
            return
        client = self.client(url)
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
            self.short_of_servers()
        membership.answer(request, "left", seconds=self.clock() - t0)

    def _at(self, url: str) -> list[int]:
        """The router's indices of the server at ``url`` (one per time it was added)."""
        return [i for i, c in enumerate(self.router.clients) if c.url == url]

    async def close(self) -> None:
        membership.close_fleet(self.run_dir)
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
