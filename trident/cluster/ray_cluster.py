"""Ray: one local instance by default, or an existing cluster with ``cluster.address``.

Each role declares its resources on its actor: a rollout server takes one GPU on a GPU node (a CPU
on a CPU node), a trainer rank likewise. ``RolloutFleet`` starts the vLLM servers inside Ray
actors (so they land on whichever node has room) and stops them on exit, exception or Ctrl-C.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import ray

from trident.rollout.engine import VLLMClient
from trident.rollout.router import Router
from trident.rollout.vllm_server import check_port_free


def init_ray(cluster_cfg: Any) -> None:
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    kwargs: dict[str, Any] = {"log_to_driver": False, "include_dashboard": False}
    on_sigterm = signal.getsignal(signal.SIGTERM)
    if cluster_cfg.address:
        ray.init(address=cluster_cfg.address, **kwargs)
    else:
        ray.init(num_cpus=cluster_cfg.num_cpus or max(4, os.cpu_count() or 1), **kwargs)
    if callable(on_sigterm) and threading.current_thread() is threading.main_thread():
        # ray.init replaces the SIGTERM handler with one that aborts the driver; put back the
        # CLI's, which unwinds and stops servers, trainer and Ray on the way out
        signal.signal(signal.SIGTERM, on_sigterm)


def role_resources() -> dict[str, float]:
    """One GPU per role where the cluster has GPUs; a fraction of a CPU otherwise (CPU roles share
    the few cores of a laptop; the OS, not Ray, schedules them)."""
    if ray.cluster_resources().get("GPU", 0) > 0:
        return {"num_gpus": 1, "num_cpus": 1}
    return {"num_cpus": 0.5}


@ray.remote
class RolloutServerActor:
    """Hosts one VLLMServer process on the node Ray placed this actor on."""

    def __init__(self, model_path: str, log_path: str, options: dict[str, Any]) -> None:
        from trident.rollout.vllm_server import VLLMServer

        self.server = VLLMServer(model_path, log_path, host=_node_ip(), **options)

    def start(self, timeout_s: float) -> str:
        return self.server.start(timeout_s)

    def healthy(self) -> bool:
        return self.server.healthy()

    def stop(self) -> None:
        self.server.stop()


def _node_ip() -> str:
    ip = ray.util.get_node_ip_address()
    return "127.0.0.1" if ip in ("127.0.0.1", "localhost") or _single_node() else ip


def _single_node() -> bool:
    return len([n for n in ray.nodes() if n.get("Alive")]) <= 1


class RolloutFleet(AbstractContextManager):
    """Starts ``rollout.num_servers`` vLLM servers; ``.router`` talks to them; stops them on exit."""

    def __init__(
        self, cfg: Any, model_path: str, run_dir: str | Path, weight_transfer: str | None = None
    ) -> None:
        self.cfg, self.model_path = cfg, model_path
        self.log_dir = Path(run_dir) / "logs"
        self.weight_transfer = weight_transfer
        self.actors: list[Any] = []
        self.router: Router | None = None

    def __enter__(self) -> RolloutFleet:
        rc = self.cfg.rollout
        options = dict(
            dtype=self.cfg.model.dtype,
            max_model_len=rc.max_model_len,
            kv_cache_gib=rc.kv_cache_gib,
            gpu_memory_utilization=rc.gpu_memory_utilization,
            weight_transfer_backend=self.weight_transfer,
            extra_args=list(rc.extra_server_args),
            seed=self.cfg.run.seed,
        )
        res = role_resources()
        ports = [rc.base_port + i if rc.base_port else 0 for i in range(rc.num_servers)]
        if _single_node():  # fail before any actor starts; on a cluster the actor's node checks
            for port in filter(None, ports):
                check_port_free(port)
        for i, port in enumerate(ports):
            log = str((self.log_dir / f"vllm_server_{i}.log").resolve())
            actor = RolloutServerActor.options(**res).remote(
                self.model_path, log, {**options, "port": port}
            )
            self.actors.append(actor)
        try:
            urls = ray.get([a.start.remote(rc.startup_timeout_s) for a in self.actors])
        except ray.exceptions.RayTaskError as e:
            self.__exit__(None, None, None)
            raise e.as_instanceof_cause() from None
        self.router = Router([VLLMClient(u, timeout_s=rc.request_timeout_s) for u in urls])
        return self

    def __exit__(self, *exc: object) -> None:
        self.router = None  # its HTTP clients belong to the event loops that used them
        for a in self.actors:
            # The actor may already be dead; killing it kills its server too (PR_SET_PDEATHSIG).
            with contextlib.suppress(Exception):
                ray.get(a.stop.remote(), timeout=30)
            ray.kill(a)
        self.actors = []
