"""``TrainerGroup``: the policy's FSDP2 ranks (``PolicyWorker``) as Ray actors, driven as one.

Every method goes to all ranks (they run collectives together) and returns rank 0's result; each
is awaitable (Ray object refs are futures), so a driver's event loop keeps generating while the
trainer works. Leaving the ``with`` block kills the actors, so no trainer process outlives the
run. Start-up is bounded: ranks that are not up within ``START_TIMEOUT_S`` (e.g. the cluster has
no room for them) fail with a message instead of waiting forever.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, OutOfMemoryError, RayActorError

from trident.cluster.net import free_port, node_ip
from trident.cluster.placement import Plan, make_plan
from trident.cluster.process import jemalloc_env
from trident.cluster.ray_cluster import out_of_memory
from trident.config import TridentConfig
from trident.sample import Sample
from trident.train.policy import PolicyWorker

START_TIMEOUT_S = 600.0
RELEASE_TIMEOUT_S = 2.0  # what a rank gets to delete its files at exit, before it is killed


class TrainerStartError(RuntimeError):
    """The trainer ranks could not be started (no room on the cluster, or a rank crashed)."""


class TrainerRankError(RuntimeError):
    """A trainer rank died mid-run (its process was killed, its node lost, out of memory)."""


class TrainerOutOfMemory(TrainerRankError):
    """Ray's memory monitor killed a trainer rank: a restart would run out again."""


def rank_error(method: str, rank: int | str, pid: int | str, error: BaseException) -> Exception:
    """One line for a rank's death during ``method``; killed for memory, what to change."""
    oom = out_of_memory(error)
    if oom is not None:
        return TrainerOutOfMemory(
            f"trainer rank {rank} ran out of memory during {method} (pid {pid}): {oom}"
        )
    return TrainerRankError(
        f"trainer rank {rank} died during {method} (pid {pid}): its process was killed, or its "
        "node or memory ran out"
    )


@ray.remote
def _address() -> tuple[str, int]:
    return node_ip(), free_port()


def _rendezvous(plan: Plan) -> tuple[str, int]:
    """Where the ranks rendezvous: rank 0 hosts the store, so its node's address and a port
    free there, asked of a task placed on rank 0's bundle (the driver's own address when there
    is no placement group: then everything runs where the driver does)."""
    if plan.group is None:
        return node_ip(), free_port()
    task = _address.options(**plan.actor_options("trainer", 0))
    return ray.get(task.remote(), timeout=START_TIMEOUT_S)


class TrainerGroup(AbstractContextManager):
    def __init__(
        self,
        cfg: TridentConfig,
        plan: Plan | None = None,
        worker: type = PolicyWorker,
        worker_args: tuple = (),
    ) -> None:
        """``plan``: where the ranks run (``trident.cluster.placement``); by default each asks
        for its share of a device of the cluster, outside any placement group. ``worker``: the
        rank's class, made as ``worker(*worker_args, cfg, rank, world, master_addr,
        master_port)`` (another than ``PolicyWorker``: driven through :meth:`call`)."""
        self.cfg = cfg
        self.plan = plan
        self.worker, self.worker_args = worker, worker_args
        self.workers: list[Any] = []  # ray actor handles of PolicyWorker
        self.pids: dict[str, int] = {}  # rank -> process id (for stack dumps)

    def __enter__(self) -> TrainerGroup:
        self.launch()
        return self.ready()

    def launch(self) -> None:
        """Create the rank actors; returns once they are asked to start (``ready`` waits), so
        that the rollout servers can start meanwhile."""
        n = self.cfg.trainer.num_ranks
        c = self.cfg.cluster
        plan = self.plan = self.plan or make_plan(
            c.placement, n, 0, ray.cluster_resources(), c.role_resources
        )
        actor_cls = ray.remote(self.worker)
        addr, port = _rendezvous(plan)
        options = [plan.actor_options("trainer", rank) for rank in range(n)]
        if plan.mode == "cpu" and not c.address and (env := jemalloc_env(self.cfg.model.path)):
            # ranks on this host's CPUs: jemalloc (its path is this host's; ~0.5 s of the
            # rank's start, which the servers' start hides)
            options = [o | {"runtime_env": {"env_vars": env}} for o in options]
        self.workers = [
            actor_cls.options(**options[rank]).remote(
                *self.worker_args, self.cfg, rank, n, addr, port
            )
            for rank in range(n)
        ]

    def ready(self) -> TrainerGroup:
        """Wait until every rank launched has built its model and joined the group (stopping
        them all if one does not)."""
        n = self.cfg.trainer.num_ranks
        try:
            ray.get([w.__ray_ready__.remote() for w in self.workers], timeout=START_TIMEOUT_S)
        except GetTimeoutError:
            self.__exit__(None, None, None)
            resources = self.plan.slot("trainer", 0).resources if self.plan else {}
            raise TrainerStartError(
                f"{n} trainer rank(s) asking for {resources} each did not start within "
                f"{START_TIMEOUT_S:.0f} s; cluster resources: {ray.cluster_resources()}"
            ) from None
        except RayActorError:
            self.__exit__(None, None, None)
            raise
        self.pids = {
            f"trainer_rank{r}": pid
            for r, pid in enumerate(ray.get([w.pid.remote() for w in self.workers], timeout=60))
        }
        return self

    async def _all(self, method: str, *args: Any, ranks: int | None = None) -> Any:
        """``method`` on every rank (the first ``ranks``); rank 0's result. A rank that dies
        fails the call at once, naming it, even while the others wait for it in a collective
        (they are killed on exit)."""
        workers = self.workers[:ranks]
        calls = [asyncio.ensure_future(getattr(w, method).remote(*args)) for w in workers]
        try:
            results = await asyncio.gather(*calls)
        except (RayActorError, OutOfMemoryError) as e:
            dead = [r for r, c in enumerate(calls) if c.done() and c.exception() is not None]
            for c in calls:
                c.cancel()
            rank = dead[0] if dead else "?"
            pid = self.pids.get(f"trainer_rank{rank}", "?")
            raise rank_error(method, rank, pid, e) from None
        return results[0]

    async def call(self, method: str, *args: Any) -> Any:
        """``worker.method(*args)`` on every rank, rank 0's result, for a ``worker`` other
        than ``PolicyWorker`` (a dead rank is named at once, as for every call here)."""
        return await self._all(method, *args)

    async def connect(
        self, urls: list[str], backend: str, nodes: Mapping[str, str] | None = None
    ) -> None:
        """``PolicyWorker.connect``: once, after the rollout servers are up."""
        await self._all("connect", urls, backend, dict(nodes or {}))

    async def train_step(self, samples: list[Sample]) -> dict[str, float]:
        """``PolicyWorker.train_step``: one optimizer round over the step's samples; each
        sample's mean advantage and engine-vs-trainer mismatch go into its ``metrics``."""
        metrics = await self._all("train_step", samples)
        for s, (advantage, mismatch) in zip(samples, metrics.pop("per_sample"), strict=True):
            s.metrics["advantage"] = advantage
            if not math.isnan(mismatch):  # NaN: not measured (the engine's logprobs were pi_old)
                s.metrics["mismatch"] = mismatch
        return metrics

    async def sync_weights(self, version: int, urls: list[str] | None = None) -> dict[str, float]:
        """``PolicyWorker.sync_weights``: push ``version`` to ``urls`` (default: every server)
        and verify it."""
        return await self._all("sync_weights", version, urls)

    async def rejoin(self, url: str) -> dict[str, float]:
        """``PolicyWorker.rejoin`` (rank 0 alone): bring a restarted server to the last pushed
        version, verified. Runs after the rank's current call (a train step) finishes."""
        return await self._all("rejoin", url, ranks=1)

    async def save(self, out_dir: Path) -> None:
        """``PolicyWorker.save_state``: the HF export and the full training state in ``out_dir``."""
        await self._all("save_state", str(out_dir))

    async def load(self, ckpt_dir: Path) -> None:
        """``PolicyWorker.load_state``: continue from a checkpoint ``save`` wrote."""
        await self._all("load_state", str(ckpt_dir))

    def __exit__(self, *exc: object) -> None:
        # Each rank first deletes its bucket files in /dev/shm; one still busy or hung in a call
        # after the wait is killed as it is (the next run on its host deletes them).
        if self.workers:
            released = [w.release.remote() for w in self.workers]
            ray.wait(released, num_returns=len(released), timeout=RELEASE_TIMEOUT_S)
        for w in self.workers:
            ray.kill(w)
        self.workers = []
