"""Which weight-transfer backend a run uses, on the trainer side and on the servers, and the
transport that carries it: the one place that tells the backends apart.

``sync.backend=auto`` is ``shm`` without GPUs (checksummed safetensors buckets in /dev/shm,
read by trident's vLLM plugin, fetched over HTTP by a server on another host). Where the trainer
ranks get GPUs (the Ray cluster has GPUs, so the placement plan gives every rank one; the
driver itself may run on a CPU node) it follows the plan:

- disaggregated (every actor its own GPU): ``nccl``, rank 0 broadcasting to each server;
- colocated with every server on trainer rank 0's GPU (a one-GPU box): ``ipc``. NCCL refuses
  two ranks of one communicator on one device, while CUDA IPC hands the engine the trainer's own
  memory (vLLM keys each handle by the GPU's UUID, so it reaches only servers on that GPU);
- colocated across several GPUs (server i beside rank i): ``shm``, since neither NCCL (server 0
  shares rank 0's device) nor IPC (servers 1.. are on other devices) reaches every server.

A LoRA policy with ``model.lora.sync=adapter`` is ``adapter`` whatever the placement: its
adapters alone, as files the servers load (``trident.weights.adapter``), under their own served
model name. A run resolves its backend once (``pipeline/run.py``) and hands the string down.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from trident.config.schema import LoraConfig, SyncConfig
from trident.rollout.engine import ADAPTER_MODEL, SERVED_MODEL

if TYPE_CHECKING:
    from trident.cluster.placement import Plan
    from trident.weights.sync import Transport

Backend = Literal["shm", "nccl", "ipc", "adapter"]

# trainer-side sync backend -> the server's --weight-transfer-config backend (adapters need no
# transfer engine; trident's plugin still serves the weight version)
SERVER_BACKENDS = {"shm": "trident_shm", "nccl": "nccl", "ipc": "ipc", "adapter": "trident_shm"}


def weight_backend(
    sync_cfg: SyncConfig, plan: Plan | None = None, lora: LoraConfig | None = None
) -> str:
    """The trainer-side backend ``sync.backend`` resolves to for the run's placement ``plan``
    (None: servers this run did not place, e.g. attached ones: GPUs on this cluster or not) and
    the policy's ``model.lora``."""
    if lora is not None and lora.sync == "adapter":
        return "adapter"
    if sync_cfg.backend != "auto":
        return sync_cfg.backend
    if plan is not None:
        if plan.mode == "cpu":
            return "shm"
        if plan.mode == "disaggregated":
            return "nccl"
        rank0 = plan.slot("trainer", 0).bundle
        servers = [s for s in plan.slots if s.role == "rollout"]
        return "ipc" if all(s.bundle == rank0 for s in servers) else "shm"
    import ray

    if ray.is_initialized():
        return "nccl" if ray.cluster_resources().get("GPU", 0) > 0 else "shm"
    import torch

    return "nccl" if torch.cuda.is_available() else "shm"


def server_backend(
    sync_cfg: SyncConfig, plan: Plan | None = None, lora: LoraConfig | None = None
) -> str:
    """The ``--weight-transfer-config`` backend the servers start with."""
    return SERVER_BACKENDS[weight_backend(sync_cfg, plan, lora)]


def served_model(backend: str) -> str:
    """The model name the rollout's requests and the sync's probe ask the servers for under
    ``backend``: the policy's adapter (``adapter``), else the served weights."""
    return ADAPTER_MODEL if backend == "adapter" else SERVED_MODEL


def make_transport(
    backend: str,
    sync_cfg: SyncConfig,
    *,
    keep_served: bool = False,
    remote: Iterable[str] = (),
    host: str = "127.0.0.1",
    timeout_s: float = 120.0,
    adapter_dir: str | Path | None = None,
    adapter_config: dict[str, Any] | None = None,
) -> Transport:
    """The trainer-side transport of ``backend`` (resolved: ``weight_backend``). ``keep_served``:
    keep a copy of the last pushed weights, to bring a restarted server back (shm); ``remote``:
    the servers on another host than this process, which fetch the buckets over HTTP from
    ``host`` (shm); ``host`` is also where vLLM's engines join the NCCL group (nccl);
    ``adapter_dir`` and ``adapter_config``: where the adapters go, which every server reads, and
    peft's config of them (adapter)."""
    if backend == "adapter":
        from trident.weights.adapter import AdapterTransport

        if adapter_dir is None or adapter_config is None:
            raise ValueError("the adapter backend needs adapter_dir and adapter_config")
        return AdapterTransport(adapter_dir, adapter_config, timeout_s=timeout_s)
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
        raise ValueError(f"unknown weight sync backend {backend!r}: shm | nccl | ipc | adapter")
    from trident.weights.nccl import VLLMEngineTransport

    if backend == "nccl":
        return VLLMEngineTransport.nccl(master_address=host, timeout_s=timeout_s)
    return VLLMEngineTransport.ipc(timeout_s=timeout_s)
