"""The LoRA adapters alone as the weight sync (``model.lora.sync=adapter``): vLLM serves them.

A LoRA policy's base weights never change, so the servers keep the base model they started with
(``--enable-lora``) and each sync sends only the adapters: ``AdapterTransport.send`` writes them
as a peft adapter directory (``adapter_model.safetensors`` + ``adapter_config.json``), then on
every target server ``POST /v1/load_lora_adapter`` (``load_inplace``: the adapter keeps its name,
``ADAPTER_MODEL``, which the rollout's requests ask for) and ``POST /update_weight_version``, so
``WeightSync.verify`` checks the version and the probe logprobs (computed through the adapter)
exactly as after a full sync. Measured on the qwen2.5-0.5b shape at r=16: 35 MB in 0.10 s
against 2.5 GB in 5.8 s merged, the engine's probe logprobs within 2e-6 of the trainer's
(``benchmarks/lora_sync.py``).

The directory must be readable by every server (the run directory, which a multi-node run
shares: ``ray_cluster.check_shared``); a restarted server gets the last version from it again
(``resend``), so no kept copy in memory is needed. vLLM needs the server started with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` and a ``--max-lora-rank`` of at least ``r``
(``vllm_server.lora_server_args``).

Simplifications: one adapter per server (``--max-loras 1``); the previous version's directory is
removed once every target loaded the new one.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from trident.rollout.engine import ADAPTER_MODEL
from trident.weights.control import WeightRoutes, WeightSyncError, each
from trident.weights.tensors import full_tensor


class AdapterTransport:
    """``Transport`` of adapter tensors (peft's saved names) into servers serving the base
    model; ``adapter_config``: peft's ``adapter_config.json`` of the policy."""

    served_model = ADAPTER_MODEL  # the name the adapter is loaded under, which requests ask for

    def __init__(
        self, directory: str | Path, adapter_config: dict[str, Any], timeout_s: float = 120.0
    ) -> None:
        self.directory = Path(directory)
        self.config = adapter_config
        self.timeout_s = timeout_s
        self.version: int | None = None  # the last version written (what resend loads)
        self.urls: list[str] = []

    def passes(self, servers: int) -> int:
        """Once: every server loads the same adapter directory."""
        return 1

    def init(self, urls: list[str]) -> None:
        self.urls = list(urls)
        self.directory.mkdir(parents=True, exist_ok=True)

    def send(
        self, stream: Iterator[tuple[str, torch.Tensor]], version: int, targets: list[str]
    ) -> dict[str, float]:
        from safetensors.torch import save_file

        t0 = time.perf_counter()
        tensors = {name: full_tensor(t).detach().cpu().contiguous() for name, t in stream}
        if not tensors:
            raise WeightSyncError("adapter sync: the policy has no LoRA tensors to send")
        out = self.directory / f"v{version}"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        save_file(tensors, str(out / "adapter_model.safetensors"))
        (out / "adapter_config.json").write_text(json.dumps(self.config, indent=1))
        write_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        asyncio.run(self._load(out, version, targets))
        previous, self.version = self.version, version
        if previous is not None and previous != version:
            shutil.rmtree(self.directory / f"v{previous}", ignore_errors=True)
        return {
            "bytes": float(sum(t.numel() * t.element_size() for t in tensors.values())),
            "num_tensors": float(len(tensors)),
            "write_s": write_s,
            "load_s": time.perf_counter() - t0,
        }

    async def _load(self, path: Path, version: int, targets: list[str]) -> None:
        async with WeightRoutes(self.timeout_s) as routes:

            async def load(url: str) -> None:
                payload = {"lora_name": ADAPTER_MODEL, "lora_path": str(path.resolve())}
                try:
                    await routes.post(
                        url, "/v1/load_lora_adapter", payload | {"load_inplace": True}
                    )
                except WeightSyncError as e:
                    raise WeightSyncError(
                        f"{e} (a server needs --enable-lora for model.lora.sync=adapter: "
                        "`trident rollout serve` with the run's model.lora starts one so; or set "
                        "model.lora.sync=merged)"
                    ) from None
                await routes.post(url, "/update_weight_version", {"new_version": str(version)})

            await each(targets, "load adapter", load)

    def resend(self, url: str) -> tuple[int, Callable[[], dict[str, float]]]:
        version = self.version
        if version is None:
            raise WeightSyncError(f"{url}: no adapter was sent yet to bring it back to")

        def send() -> dict[str, float]:
            t0 = time.perf_counter()
            asyncio.run(self._load(self.directory / f"v{version}", version, [url]))
            return {"load_s": time.perf_counter() - t0}

        return version, send

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
