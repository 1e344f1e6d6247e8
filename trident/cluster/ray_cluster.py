"""Ray: one local instance by default, or an existing cluster with ``cluster.address``.

Where each role's actors run is the placement plan's (``trident.cluster.placement``).
"""

from __future__ import annotations

import os
import re
import signal
import threading
from typing import Any

import ray
from ray.exceptions import OutOfMemoryError

from trident.cluster.placement import PlacementError
from trident.config.schema import ClusterConfig


def init_ray(cluster_cfg: ClusterConfig) -> None:
    """Start (or join, with ``cluster.address``) Ray; a no-op when it is running already."""
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    kwargs: dict[str, Any] = {"log_to_driver": False, "include_dashboard": False}
    on_sigterm = signal.getsignal(signal.SIGTERM)
    # Ray lowers its workers to nice 15 (RAY_worker_niceness). On a CPU host that leaves the
    # trainer ranks what every other process leaves: beside a vLLM server at the default
    # priority (attached, or a joiner) a CI host trained a step in 10-14 s that took 0.8 s
    # alone. This run's workers keep the default priority: through the environment of the
    # instance started here, through the job's runtime environment on a cluster (which costs
    # each actor's start ~1 s, so not on the local instance).
    niceness = {"RAY_worker_niceness": "0"}
    if cluster_cfg.address:
        ray.init(address=cluster_cfg.address, runtime_env={"env_vars": niceness}, **kwargs)
    else:
        for key, value in niceness.items():
            os.environ.setdefault(key, value)
        ray.init(num_cpus=cluster_cfg.num_cpus or max(4, os.cpu_count() or 1), **kwargs)
    if callable(on_sigterm) and threading.current_thread() is threading.main_thread():
        # ray.init replaces the SIGTERM handler with one that aborts the driver; put back the
        # CLI's, which unwinds and stops servers, trainer and Ray on the way out
        signal.signal(signal.SIGTERM, on_sigterm)


SMALLER = (
    "lower trainer.micro_batch_tokens or trainer.logprob_chunk_tokens, or set "
    "trainer.activation_checkpointing=true, model.lora, or rollout.max_restarts=0 "
    "(no kept copy of the served weights)"
)


def out_of_memory(error: BaseException) -> str | None:
    """One line for Ray's memory monitor killing the run's workers (``error``: what the driver
    got, a page of memory tables), or None for any other error: what was killed, with its
    memory, the node's usage, and the settings that make the run smaller."""
    text = str(error)
    if not isinstance(error, OutOfMemoryError) and "memory usage threshold" not in text:
        return None
    selected = text.split("Selected to kill:", 1)[-1]
    killed = [
        f"{name.split('.')[0]} ({used})"
        for name, used in re.findall(r"task name=([\w.]+)[^\n]*?memory used=([\d.]+ ?GB)", selected)
    ]
    node = re.search(r"was ([\d.]+ ?GB)(?: used)? / ([\d.]+ ?GB)", text)
    return (
        f"Ray's memory monitor killed {', '.join(dict.fromkeys(killed)) or 'a worker'}"
        + (f" with the node at {node[1]} of {node[2]}" if node else "")
        + f": the run does not fit in memory; {SMALLER}"
    )


@ray.remote(num_cpus=0)
def _missing(paths: list[str]) -> list[str]:
    return [p for p in paths if not os.path.exists(p)]


def check_shared(paths: dict[str, str]) -> None:
    """Every other live node of the cluster sees each of ``paths`` (setting -> path): the
    servers and ranks there read the model from it and write logs and checkpoints into the run
    directory. Fails in seconds, before anything starts, with one line naming the node and what
    it does not see; a no-op on one node."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    others = [n for n in ray.nodes() if n["Alive"] and n["NodeID"] != here]
    asked = {
        n["NodeManagerAddress"]: _missing.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
        ).remote(list(paths.values()))
        for n in others
    }
    for address, missing in zip(asked, ray.get(list(asked.values()), timeout=120), strict=True):
        if missing:
            unseen = ", ".join(f"{k}={v}" for k, v in paths.items() if v in missing)
            raise PlacementError(
                f"node {address} does not see {unseen}: trident reads the model and writes the "
                "run directory from every node, so they must be on a filesystem every node "
                "mounts at the same path (NFS, a shared volume)"
            )
