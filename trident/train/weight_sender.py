"""``WeightSender``: one trainer rank's side of the verified weight push to the rollout servers.

Built once per rank when the servers are up. Every rank holds the same transport
(``weights.backend.make_transport``: the one place that tells the backends apart), so every rank
knows how many times a push iterates the weight stream; rank 0 alone drives the servers through
``WeightSync``. A push is collective: every rank iterates the same sharded state dict, each
bucket is all-gathered just before rank 0 sends it, the other ranks take part in the same
gathers (``drain``), and all meet at a barrier, also when the push or its verification failed.

The sender holds the probe sequence and the logprobs the trainer computed for it at the last
push (``served_probe``): what every server, and later a restarted one (``rejoin``), must
reproduce. It knows nothing of the loop that calls it: ``trident train``'s ranks and a training
service push the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from trident.config.schema import SyncConfig
from trident.train import lora

if TYPE_CHECKING:
    from trident.weights.sync import Transport, WeightSync

# trident.weights.sync (httpx, the servers' client) is imported when a push is set up, so a rank
# that never pushes (``trident sft``, a benchmark) never loads it


class WeightSender:
    """Pushes ``model``'s weights (an FSDP2-sharded policy, LoRA or not) to the servers as
    ``backend`` (resolved: ``weights.backend.weight_backend``) and verifies them."""

    def __init__(
        self,
        rank: int,
        model: torch.nn.Module,
        tokenizer: Any,
        sync: SyncConfig,
        run_dir: str | Path,
        backend: str,
        *,
        engine_dtype: str = "bfloat16",
        seed: int = 0,
        rejoins: bool = False,
    ) -> None:
        """``run_dir``: shared with every server (the adapter backend writes there);
        ``engine_dtype``: the servers' (each tensor is cast to it before its gather);
        ``seed``: the probe's; ``rejoins``: a restarted server may be brought back to the last
        pushed version (its copy is kept, its probe logprobs computed at every push)."""
        self.rank, self.model, self.sync_cfg, self.backend = rank, model, sync, backend
        self.run_dir, self.rejoins = Path(run_dir), rejoins
        self.engine_dtype = getattr(torch, engine_dtype)
        self.adapters = backend == "adapter"  # the LoRA adapters alone, not the whole model
        # a tied head is sent explicitly as the embedding (hf_named_tensors); adapters have none
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        self.tied = tied and not self.adapters
        from trident.weights.sync import make_probe

        self.probe = make_probe(tokenizer, sync.probe_tokens, seed=seed)
        self.served_probe: list[float] | None = None  # the probe's logprobs, last pushed version
        self.server_urls: list[str] = []  # every server, as connect() was told (all ranks)
        self.transport: Transport | None = None
        self.sync: WeightSync | None = None  # rank 0's

    def connect(self, urls: list[str], nodes: Mapping[str, str] | None = None) -> None:
        """Called once, after the rollout servers are up. ``nodes``: the Ray node of each
        server trident started; a server on another host than rank 0 fetches the shm backend's
        buckets over HTTP (``ShmTransport(remote=...)``)."""
        import ray

        from trident.cluster.net import node_ip
        from trident.weights.backend import make_transport
        from trident.weights.shm import same_host
        from trident.weights.sync import WeightSync

        sc = self.sync_cfg
        self.server_urls = list(urls)
        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
        ip = node_ip()
        remote = [u for u in urls if not same_host(u, (nodes or {}).get(u), node, ip)]
        self.transport = make_transport(
            self.backend,
            sc,
            keep_served=self.rejoins,  # what a restarted server is brought back to
            remote=remote,
            host=ip,  # this host (shm); the engines join rank 0's NCCL group from it
            timeout_s=sc.timeout_s,
            # the adapters go into the run directory, which every server shares
            adapter_dir=self.run_dir / "lora_adapter",
            adapter_config=lora.adapter_config(self.model) if self.adapters else None,
        )
        if self.rank == 0:
            self.sync = WeightSync(urls, self.transport, timeout_s=sc.timeout_s)
            self.sync.init()

    def _weights(self) -> Any:
        """What a push streams: a LoRA policy's adapters alone, or its merged weights under the
        base model's names (collective: ``MergedWeights`` gathers every A), or the model."""
        if self.adapters:
            return lora.adapter_tensors(self.model)
        if lora.is_lora(self.model):
            return lora.MergedWeights(self.model)
        return self.model

    def _stream(self) -> Any:
        from trident.weights.sync import hf_named_tensors

        # cast to the engine's dtype shard by shard, before each gather (float32 master weights)
        return hf_named_tensors(self._weights(), self.tied, dtype=self.engine_dtype)

    def push(self, version: int, urls: list[str] | None = None) -> dict[str, float]:
        """Push the current weights as ``version`` to ``urls`` (default: every server) and
        verify them (collective on all ranks); rank 0's bytes, seconds and probe gap."""
        from trident.weights.sync import drain, probe_logprobs

        sc = self.sync_cfg
        # the probe is also what a restarted server is checked against
        expected = probe_logprobs(self.model, self.probe) if sc.verify or self.rejoins else None
        metrics: dict[str, float] = {}
        if self.rank != 0:
            assert self.transport is not None  # connect() made it
            targets = len(urls if urls is not None else self.server_urls)
            drain(self._stream())
            for _ in range(self.transport.passes(targets) - 1):
                drain(self._stream())
            dist.barrier()
            return metrics
        assert self.sync is not None  # connect() made it on rank 0
        try:
            metrics = self.sync.push(self._stream(), version, urls)
            self.served_probe = expected  # what a rejoin to this version is checked against
            if expected is not None and sc.verify:
                metrics |= self.sync.verify(self.probe, expected, version, sc.tolerance)
        finally:
            # the other ranks wait here, also when the push or its verification failed: a
            # retry (``WeightGate.update``) must find every rank at its first collective
            dist.barrier()
        return metrics

    def rejoin(self, url: str) -> dict[str, float]:
        """Rank 0 only: bring the restarted server ``url`` to the last pushed version (from
        the kept copy, whatever the trainer has learned since) and verify it with that
        version's probe logprobs (``WeightSync.rejoin``)."""
        assert self.rank == 0 and self.sync is not None
        assert self.served_probe is not None  # computed at every push when rejoins are on
        return self.sync.rejoin(url, self.probe, self.served_probe, self.sync_cfg.tolerance)

    def close(self) -> None:
        """Delete what this rank keeps outside its process: the weight sync's bucket files."""
        if self.sync is not None:
            self.sync.close()
