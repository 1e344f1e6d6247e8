"""``TrainerGroup``: the policy's FSDP2 ranks as Ray actors, driven as one object.

Every call goes to all ranks (they run collectives together) and returns rank 0's result.
Leaving the ``with`` block kills the actors, so no trainer process outlives the run.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import ray

from trident.cluster.ray_cluster import role_resources
from trident.train.policy import PolicyWorker


class TrainerGroup(AbstractContextManager):
    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.workers: list[Any] = []

    def __enter__(self) -> TrainerGroup:
        from trident.rollout.vllm_server import free_port

        n = self.cfg.trainer.num_ranks
        actor_cls = ray.remote(**role_resources())(PolicyWorker)
        addr, port = ray.util.get_node_ip_address(), free_port()
        if len([node for node in ray.nodes() if node.get("Alive")]) <= 1:
            addr = "127.0.0.1"
        self.workers = [actor_cls.remote(self.cfg, rank, n, addr, port) for rank in range(n)]
        try:
            ray.get([w.__ray_ready__.remote() for w in self.workers])
        except ray.exceptions.RayActorError:
            self.__exit__(None, None, None)
            raise
        return self

    def call(self, method: str, *args: Any) -> Any:
        results = ray.get([getattr(w, method).remote(*args) for w in self.workers])
        return results[0]

    def __exit__(self, *exc: object) -> None:
        for w in self.workers:
            ray.kill(w)
        self.workers = []
