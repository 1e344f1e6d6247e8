"""The ``trident_shm`` engine: vLLM's side of trident's CPU weight sync, in every worker.

``trident.weights.vllm_plugin.register`` registers ``TridentShmEngine`` under the name
``trident_shm`` by this module's path: vLLM imports the module, and so vLLM and torch, only in a
server that selects the backend (``--weight-transfer-config '{"backend": "trident_shm"}'``).

Protocol (HTTP routes of a server run with ``VLLM_SERVER_DEV_MODE=1``; the trainer side is
``trident.weights.shm.ShmTransport``):

1. ``POST /init_weight_transfer_engine {"init_info": {"keep_base": bool}}`` once per server.
2. Per update: ``POST /start_weight_update``, then for bucket ``i = 0, 1, ...``
   ``POST /update_weights {"update_info": {"path", "checksum", "index", "final", "version",
   "kind", "base_version", "base_checksum", "weights_checksum"}}``: ``path`` is a safetensors
   file the trainer wrote (in /dev/shm on one host; a server on another host gets ``url``
   instead, where the trainer serves the same file), ``checksum`` is ``"xxh3_128:<hex>"`` of the
   file's bytes, ``final`` marks the last bucket, which also carries ``weights_checksum``
   (``trident.weights.delta.WeightsChecksum`` of all the update's tensors). ``kind`` is ``full``
   (the file holds HF-named tensors) or ``delta`` (it holds, per tensor, the compressed XOR
   against the base, ``trident.weights.delta``; it applies only to the base ``base_version`` /
   ``base_checksum``). Then ``POST /finish_weight_update {"weight_version": "N"}``. A trainer that
   fails mid-update sends ``{"update_info": {"abort": true}}``: the engine discards what it staged
   and raises, which is how vLLM's worker closes an update session without touching the weights.

The engine maps each file (no copy), hashes exactly the bytes it then uses, and refuses (raises,
so the HTTP call fails) a bucket whose checksum differs, that arrives out of order, or that names a
tensor the served checkpoint does not have or gives it another shape, a delta whose base is not
the one it holds (``BASE_MISMATCH``), and an update whose reconstructed tensors do not hash to
``weights_checksum``. Refusal happens before
anything touches the model: buckets are staged (as views of the mapped files) and applied together
when the ``final``
bucket arrives, inside vLLM's layerwise reload (``initialize_layerwise_reload`` /
``finalize_layerwise_reload``, required on CPU where vLLM repacks weights after loading). So an
update either applies whole or leaves the served weights and version as they were. The apply runs
inside ``/update_weights`` rather than ``/finish_weight_update`` because vLLM's worker closes the
update session when ``update_weights`` raises but leaves it open when ``finish`` raises.

With ``keep_base`` (the trainer's ``sync.delta``) the engine keeps the last applied weights in
the trainer's layout, on CPU, as the base for the next delta: vLLM repacks its own parameters
(fused qkv, CPU-packed linears), so a delta cannot be applied to them. That is one more copy of
the model for as long as the server runs (a copy of a full update's tensors, or the tensors
rebuilt from deltas).

Staging copies nothing: the staged tensors are views of the mapped bucket files, so an update's
bytes sit in shared memory once, however many servers on the host read them. The trainer
rewrites the same files at its next sync, after every server has applied this one or given it
up: nothing here reads a file after its update (vLLM's loaders copy what they load, and the
delta base is a copy).

Simplifications: the name/shape check needs the checkpoint as a local directory of safetensors
files (a hub id skips it, and a bad shape then fails inside the load, which may leave the layers
loaded before it updated); the engine never deletes a file, the trainer owns them. Every worker of a tensor-parallel server reads the full tensors and vLLM's loaders shard them.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any, cast

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
from vllm.model_executor.model_loader.reload import (
    finalize_layerwise_reload,
    initialize_layerwise_reload,
)

from trident.weights import delta as delta_codec
from trident.weights.vllm_plugin import (
    BASE_MISMATCH,
    checkpoint_shapes,
    checksum,
    fetch,
    map_file,
    safetensors_views,
)

# A child of vLLM's logger: messages land in the server log, formatted like vLLM's own.
logger = logging.getLogger("vllm.trident_shm")


@dataclass
class ShmInitInfo(WeightTransferInitInfo):
    """No rendezvous: the trainer and the engine share a filesystem."""

    keep_base: bool = False  # keep the last applied weights as the base of deltas


@dataclass
class ShmUpdateInfo(WeightTransferUpdateInfo):
    path: str = ""
    url: str = ""  # instead of ``path``: fetch the bucket from the trainer's host
    checksum: str = ""
    index: int = 0
    final: bool = False
    abort: bool = False
    version: int = -1
    kind: str = "full"
    base_version: int = -1
    base_checksum: str = ""
    weights_checksum: str = ""

    def __post_init__(self) -> None:
        if not self.abort and not ((self.path or self.url) and self.checksum):
            raise ValueError("update_info needs 'path' or 'url', and 'checksum' (or 'abort': true)")
        if self.kind not in ("full", "delta"):
            raise ValueError(f"update_info kind must be 'full' or 'delta', got {self.kind!r}")


class TridentShmEngine(WeightTransferEngine[ShmInitInfo, ShmUpdateInfo]):
    """Loads checksummed safetensors buckets from a shared filesystem, all-or-nothing."""

    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self._staged: list[tuple[str, Any]] = []
        self._applied_tensors: list[tuple[str, Any]] = []
        self._buckets = 0
        self._applied = False
        self._shapes: dict[str, tuple[int, ...]] | None = None
        self._read_s = 0.0  # read + checksum + deserialize, over this update's buckets
        self._via = "shm"  # how the buckets came: a shared file, or fetched over HTTP
        self._weights = delta_codec.WeightsChecksum()  # of the tensors staged so far
        self._keep_base = False
        # the last applied weights, trainer layout, CPU, with their version and checksum
        self._base: dict[str, Any] | None = None
        self._base_key: tuple[int, str] | None = None

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        self._keep_base = init_info.keep_base
        if not self._keep_base:
            self._base, self._base_key = None, None
        self._shapes = checkpoint_shapes(self.model_config.model, self.model_config.hf_config)
        if self._shapes is None:
            logger.warning(
                "trident_shm: %s is not a local safetensors checkpoint; tensor names and "
                "shapes of updates will not be checked before loading",
                self.model_config.model,
            )

    def start_weight_update(self) -> None:
        self._staged, self._buckets, self._applied = [], 0, False
        self._read_s = 0.0
        self._weights = delta_codec.WeightsChecksum()

    def receive_weights(self, update_info: ShmUpdateInfo) -> None:
        try:
            self._receive(update_info)
        except BaseException:
            # vLLM's worker ends the update session when this raises; drop what was staged.
            self._staged, self._buckets = [], 0
            raise

    def _receive(self, update_info: ShmUpdateInfo) -> None:
        if update_info.abort:
            # Raising is what makes vLLM's worker close the update session.
            raise RuntimeError(
                "weight update aborted by the trainer; "
                + (
                    "the new weights were already applied, the version was not bumped"
                    if self._applied
                    else "weights unchanged"
                )
            )
        if self._applied:
            raise ValueError(
                f"bucket {update_info.index} arrived after the final bucket was applied"
            )
        if update_info.index != self._buckets:
            raise ValueError(
                f"bucket {update_info.index} arrived, expected bucket {self._buckets}: "
                "a bucket was lost or repeated; update refused, weights unchanged"
            )
        t0 = time.perf_counter()
        source = update_info.path or update_info.url
        self._via = "shm" if update_info.path else "http"
        mapped = map_file(source) if update_info.path else fetch(source)
        got = checksum(mapped)
        if got != update_info.checksum:
            raise ValueError(
                f"checksum mismatch for bucket {update_info.index} ({source}): "
                f"trainer sent {update_info.checksum}, engine read {got}; "
                "update refused, weights unchanged"
            )
        metadata, tensors = safetensors_views(mapped)  # hashed above, used without a copy
        if update_info.kind == "delta":
            self._check_base(update_info)
            tensors = self._reconstruct(metadata, tensors, update_info)
        self._check_names(tensors, update_info)
        if update_info.kind == "delta":  # a full bucket's bytes are its file's, checked above
            self._weights.update_bucket(list(tensors.items()))
        self._staged.extend(tensors.items())
        self._buckets += 1
        self._read_s += time.perf_counter() - t0
        if update_info.final:
            full = update_info.kind == "full"
            got = update_info.weights_checksum if full else self._weights.hexdigest()
            if got != update_info.weights_checksum:
                raise ValueError(
                    f"weights checksum mismatch after {self._buckets} bucket(s) "
                    f"({update_info.kind}): trainer sent {update_info.weights_checksum}, "
                    f"engine reconstructed {got}; update refused, weights unchanged"
                )
            self._apply()
            if self._keep_base:
                # A full update's tensors are views of the trainer's files, which the next
                # sync overwrites: the base is a copy. A delta's are this engine's own.
                staged = {n: t.clone() if full else t for n, t in self._applied_tensors}
                self._base = staged if full or self._base is None else self._base | staged
                self._base_key = (update_info.version, got)
            self._applied_tensors = []

    def _check_base(self, update_info: ShmUpdateInfo) -> None:
        want = (update_info.base_version, update_info.base_checksum)
        if self._base is None or self._base_key != want:
            held = (
                f"holds base version {self._base_key[0]} ({self._base_key[1]})"
                if self._base_key is not None
                else "holds no base (no full sync since it started with keep_base)"
            )
            raise ValueError(
                f"{BASE_MISMATCH}: bucket {update_info.index} is a delta against base "
                f"version {want[0]} ({want[1]}); this server {held}; "
                "update refused, weights unchanged"
            )

    def _reconstruct(
        self, metadata: dict[str, str], payloads: dict[str, Any], update_info: ShmUpdateInfo
    ) -> dict[str, Any]:
        meta = json.loads(metadata.get("trident_delta", "{}"))
        if meta.get("encoding") != delta_codec.ENCODING:
            raise ValueError(
                f"bucket {update_info.index}: delta encoding {meta.get('encoding')!r}, "
                f"expected {delta_codec.ENCODING!r}; update refused, weights unchanged"
            )
        assert self._base is not None  # _check_base ran
        out: dict[str, Any] = {}
        for name, payload in payloads.items():
            base = self._base.get(name)
            dtype, shape = meta["tensors"][name]
            if base is None or str(base.dtype) != f"torch.{dtype}" or list(base.shape) != shape:
                raise ValueError(
                    f"{BASE_MISMATCH}: bucket {update_info.index}: delta for {name!r} "
                    f"({dtype}, {shape}) has no matching tensor in this server's base; "
                    "update refused, weights unchanged"
                )
            out[name] = delta_codec.decode(payload.numpy().data, base)
        return out

    def _check_names(self, tensors: dict[str, Any], update_info: ShmUpdateInfo) -> None:
        if self._shapes is None:
            return
        for name, tensor in tensors.items():
            want = self._shapes.get(name)
            if want is None:
                raise ValueError(
                    f"bucket {update_info.index}: tensor {name!r} is not in the served "
                    "checkpoint; update refused, weights unchanged"
                )
            if tuple(tensor.shape) != want:
                raise ValueError(
                    f"bucket {update_info.index}: tensor {name!r} has shape "
                    f"{tuple(tensor.shape)}, the served checkpoint has {want}; "
                    "update refused, weights unchanged"
                )

    def _apply(self) -> None:
        staged, self._staged = self._staged, []
        self._applied_tensors = staged  # the next base, when keep_base
        t0 = time.perf_counter()
        initialize_layerwise_reload(self.model)
        try:
            with disable_mtp_completeness_check():
                # declared an nn.Module; every vLLM model class defines load_weights
                cast(Any, self.model).load_weights(staged)
        finally:
            # Also on failure: layers that did not receive all their weights get their
            # previous tensors back instead of staying on the meta device.
            finalize_layerwise_reload(self.model, self.model_config)
        self._applied = True
        logger.info(
            "trident_shm: applied %d tensors from %d buckets via %s (%.1f MB): "
            "read+check %.3f s, load %.3f s",
            len(staged),
            self._buckets,
            self._via,
            sum(t.numel() * t.element_size() for _, t in staged) / 1e6,
            self._read_s,
            time.perf_counter() - t0,
        )

    def finish_weight_update(self) -> None:
        if self._buckets and not self._applied:
            staged = self._buckets
            self._staged, self._buckets = [], 0
            # Raising keeps vLLM from bumping the weight version.
            raise RuntimeError(
                f"weight update finished after {staged} bucket(s) without the final one; "
                "staged tensors discarded, weights unchanged"
            )

    def shutdown(self) -> None:
        self._staged, self._buckets, self._applied = [], 0, False
