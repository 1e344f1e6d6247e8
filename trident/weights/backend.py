"""Which weight-transfer backend a run uses, on the trainer side and on the servers, and the
transport that carries it: the one place that tells the backends apart.

``sync.backend=auto`` is ``nccl`` where the trainer ranks get GPUs (the Ray cluster has GPUs,
so the placement plan gives every rank one; the driver itself may run on a CPU node) and ``shm``
(checksummed safetensors buckets in /dev/shm, read by trident's vLLM plugin, fetched over HTTP
by a server on another host) elsewhere.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Literal

from trident.config.schema import SyncConfig

if TYPE_CHECKING:
    from trident.weights.sync import Transport

Backend = Literal["shm", "nccl", "ipc"]

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


def make_transport(
    backend: str,
    sync_cfg: SyncConfig,
    *,
    keep_served: bool = False,
    remote: Iterable[str] = (),
    host: str = "127.0.0.1",
    timeout_s: float = 120.0,
) -> Transport:
    """The trainer-side transport of ``backend`` (resolved: ``weight_backend``). ``keep_served``:
    keep a copy of the last pushed weights, to bring a restarted server back (shm); ``remote``:
    the servers on another host than this process, which fetch the buckets over HTTP from
    ``host`` (shm); ``host`` is also where vLLM's engines join the NCCL group (nccl)."""
    if backend == "shm":
        from trident.weights.shm import ShmTransport

        return ShmTransport(
            bucket_bytes=sync_cfg.bucket_bytes,
            timeout_s=timeout_s,
            delta=sync_cfg.delta,
            full_every=sync_cfg.full_every,
            on_base_mismatch=sync_cfg.on_base_mismatch,
            keep_served=keep_served,
            remote=remote,
            serve_host=host,
        )
    if backend not in ("nccl", "ipc"):
        raise ValueError(f"unknown weight sync backend {backend!r}: shm | nccl | ipc")
    from trident.weights.nccl import VLLMEngineTransport

    if backend == "nccl":
        return VLLMEngineTransport.nccl(master_address=host, timeout_s=timeout_s)
    return VLLMEngineTransport.ipc(timeout_s=timeout_s)


def stream_passes(backend: str, servers: int) -> int:
    """How many times one push to ``servers`` servers iterates, and so gathers, the weight
    stream: once for shm (every server reads the same bucket files), once per server for nccl
    and ipc (vLLM's engines send to one server at a time). The ranks that only take part in the
    gathers drain the stream as many times."""
    return 1 if backend == "shm" else servers
