"""Ray: one local instance by default, or an existing cluster with ``cluster.address``.

Each role declares its resources on its actor: a rollout server takes one GPU on a GPU node (a CPU
on a CPU node), a trainer rank likewise (``role_resources``).
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import ray

from trident.config.schema import ClusterConfig


def init_ray(cluster_cfg: ClusterConfig) -> None:
    """Start (or join, with ``cluster.address``) Ray; a no-op when it is running already."""
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


def role_resources() -> dict[str, Any]:
    """One GPU per role where the cluster has GPUs; a fraction of a CPU otherwise (CPU roles share
    the few cores of a laptop; the OS, not Ray, schedules them)."""
    if ray.cluster_resources().get("GPU", 0) > 0:
        return {"num_gpus": 1, "num_cpus": 1}
    return {"num_cpus": 0.5}


class PlacementError(RuntimeError):
    """The roles a run asks for do not fit the cluster's resources."""


def check_fits(roles: dict[str, int]) -> None:
    """Fail in seconds, before anything starts, when ``roles`` (role name -> how many actors,
    each taking ``role_resources()``) cannot all be placed on the cluster at once."""
    have = ray.cluster_resources()
    each = role_resources()
    need = {
        {"num_gpus": "GPU", "num_cpus": "CPU"}.get(k, k): v * sum(roles.values())
        for k, v in each.items()
    }
    short = {k: (v, have.get(k, 0.0)) for k, v in need.items() if v > have.get(k, 0.0) + 1e-9}
    if short:
        asked = " + ".join(f"{n} {role}" for role, n in roles.items())
        missing = ", ".join(
            f"{v:g} {k} needed, {h:g} in the cluster" for k, (v, h) in short.items()
        )
        raise PlacementError(
            f"the run does not fit: {asked}, each {each}: {missing} "
            "(lower rollout.num_servers / trainer.num_ranks, or add nodes)"
        )
