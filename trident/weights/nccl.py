"""The GPU transports: vLLM's own trainer-side weight-transfer engines (``nccl``, ``ipc``).

``WeightTransferTrainerFactory`` makes one engine per server (one NCCL group each for ``nccl``);
each engine drives the server's weight-update routes itself (start, update, finish) through
``EngineRoutes``, while ``WeightSync`` holds the servers paused, and ``WeightSync.verify`` checks
the result as for shm.

Simplifications: the weights are gathered once per server (vLLM's engines send to one server at a
time), so the ranks that only gather drain the stream as many times
(``WeightSender.push``); nothing is kept, so a restarted server cannot be brought back.
"""

from __future__ import annotations

import base64
import pickle
from collections.abc import Callable, Iterator
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

from trident.rollout.engine import SERVED_MODEL
from trident.weights.control import WeightRoutes, WeightSyncError, timed
from trident.weights.tensors import full_tensor


class VLLMEngineTransport:
    """Sends the weights through one vLLM trainer-side engine per server; ``name`` is the
    engine's (``nccl``, ``ipc``), ``init_info`` makes each engine's init info."""

    served_model = SERVED_MODEL

    def __init__(self, name: str, init_info: Callable[[], Any], timeout_s: float = 120.0) -> None:
        self.name, self.init_info, self.timeout_s = name, init_info, timeout_s
        self._engines: dict[str, tuple[EngineRoutes, Any]] = {}

    @classmethod
    def nccl(
        cls, master_address: str = "127.0.0.1", engine_world_size: int = 1, timeout_s: float = 120.0
    ) -> VLLMEngineTransport:
        """``master_address``: where the engines join this process's group from their hosts;
        ``engine_world_size``: a server's TP x PP x DP ranks."""

        def init_info() -> Any:
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            from trident.cluster.net import free_port

            return NCCLTrainerInitInfo(
                master_address=master_address,
                master_port=free_port(),
                world_size=1 + engine_world_size,
                rank=0,
            )

        return cls("nccl", init_info, timeout_s)

    @classmethod
    def ipc(cls, timeout_s: float = 120.0) -> VLLMEngineTransport:
        def init_info() -> Any:
            from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

            return IPCTrainerInitInfo(rank=0)

        return cls("ipc", init_info, timeout_s)

    def passes(self, servers: int) -> int:
        """Once per server: vLLM's engines send to one server at a time."""
        return servers

    def init(self, urls: list[str]) -> None:
        """Called once by ``WeightSync.init``, after the servers are up: one trainer-side engine
        per server (``/init_weight_transfer_engine``)."""
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        for url in urls:
            client = EngineRoutes(url, self.timeout_s)
            try:
                engine = WeightTransferTrainerFactory.trainer_init(
                    self.init_info(), client=client, source=ShardSource([])
                )
            except WeightSyncError:
                raise
            except Exception as e:
                raise WeightSyncError(f"{url}: {self.name} trainer_init failed: {e}") from e
            self._engines[url] = (client, engine)

    def send(
        self, stream: Iterator[tuple[str, torch.Tensor]], version: int, targets: list[str]
    ) -> dict[str, float]:
        """Called by ``WeightSync.push`` while ``targets`` are paused: each target's engine
        sends the whole stream (start, update, finish as ``version``)."""
        if not self._engines:
            raise WeightSyncError(f"backend {self.name!r}: call init() before push()")
        m: dict[str, float] = {"update_s": 0.0}
        pairs = list(stream)  # shards: nothing gathered yet (global shapes known)
        m["bytes"] = float(sum(t.numel() * t.element_size() for _, t in pairs))
        m["num_tensors"] = float(len(pairs))
        source = ShardSource(pairs)  # gathers each tensor as vLLM's engine sends it
        with timed(m, "update_s"):
            for url in targets:  # the servers that are up: every rank gathers for each
                client, engine = self._engines[url]
                client.weight_version = str(version)
                engine.source = source
                try:
                    engine.send_weights()
                except WeightSyncError:
                    raise
                except Exception as e:
                    raise WeightSyncError(f"{url}: {self.name} send_weights failed: {e}") from e
        return m

    def resend(self, url: str) -> tuple[int, Callable[[], dict[str, float]]]:
        """Called by ``WeightSync.rejoin``: refused, nothing is kept."""
        raise WeightSyncError(
            f"{url}: a restarted server can be brought back only by the shm backend with a "
            f"kept copy of the served weights (backend {self.name!r}, copy kept: False, holding "
            "a whole version: False; a push that failed leaves it holding none until the next "
            "one succeeds)"
        )

    def close(self) -> None:
        """Called once, at the end of the run: release the GPU transfer groups."""
        for _, engine in self._engines.values():
            engine.shutdown()
        self._engines.clear()


class EngineRoutes:
    """vLLM's ``VLLMWeightSyncClient`` protocol for one server over ``WeightRoutes``, used by
    vLLM's trainer-side engines (they call it from worker threads, hence blocking)."""

    def __init__(self, url: str, timeout_s: float) -> None:
        self.url, self.routes = url, WeightRoutes(timeout_s)
        self.weight_version: str | None = None  # set by VLLMEngineTransport.send before each send

    def _post(self, path: str, payload: dict) -> None:
        self.routes.post_blocking(self.url, path, payload)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._post("/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._post("/start_weight_update", {})

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        infos = update_info if isinstance(update_info, list) else [update_info]
        safe = [_pickle_ipc_handles(info) for info in infos]
        self._post(
            "/update_weights", {"update_info": safe if isinstance(update_info, list) else safe[0]}
        )

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._post(
            "/finish_weight_update", {"weight_version": weight_version or self.weight_version}
        )


def _pickle_ipc_handles(info: dict[str, Any]) -> dict[str, Any]:
    """CUDA IPC handles are not JSON: vLLM accepts them pickled and base64-encoded (the server
    needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``)."""
    if info.get("ipc_handles") is None:
        return info
    out = {k: v for k, v in info.items() if k != "ipc_handles"}
    out["ipc_handles_pickled"] = base64.b64encode(pickle.dumps(info["ipc_handles"])).decode()
    return out


class ShardSource(WeightSource):
    """A vLLM ``WeightSource`` over ``(name, shard or tensor)`` pairs: ``metadata()`` reads the
    global shapes (no gather), and each iteration gathers one tensor at a time as vLLM's engine
    sends it (``full_tensor``, a collective), so rank 0 never holds the whole model. vLLM
    iterates the source once per server's ``send_weights``; the other ranks drain the same
    stream as many times (``WeightSender.push``)."""

    def __init__(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        self.pairs = pairs

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self.pairs]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.pairs:
            yield name, full_tensor(tensor)
