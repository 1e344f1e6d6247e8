"""Which weight-transfer backend a run uses, on the trainer side and on the servers.

``sync.backend=auto`` is ``nccl`` where the trainer ranks get GPUs (the Ray cluster has GPUs,
so the placement plan gives every rank one; the driver itself may run on a CPU node) and ``shm``
(checksummed safetensors buckets in /dev/shm, read by trident's vLLM plugin, fetched over HTTP
by a server on another host) elsewhere.
"""

from __future__ import annotations

from trident.config.schema import SyncConfig

# trainer-side sync backend -> the server's --weight-transfer-config backend
SERVER_BACKENDS = {"shm": "trident_shm", "nccl": "nccl", "ipc": "ipc"}


def weight_backend(sync_cfg: SyncConfig) -> str:
    """The trainer-side backend ``sync.backend`` resolves to on this machine."""
    if sync_cfg.backend != "auto":
        return sync_cfg.backend
    import ray

    if ray.is_initialized():
        return "nccl" if ray.cluster_resources().get("GPU", 0) > 0 else "shm"
    import torch

    return "nccl" if torch.cuda.is_available() else "shm"


def server_backend(sync_cfg: SyncConfig) -> str:
    """The ``--weight-transfer-config`` backend the servers start with."""
    return SERVER_BACKENDS[weight_backend(sync_cfg)]
