"""Ray: one local instance by default, or an existing cluster with ``cluster.address``.

Where each role's actors run is the placement plan's (``trident.cluster.placement``).
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
