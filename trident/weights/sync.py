"""Trainer side of online weight sync into running vLLM servers, verified on every server.

One sync is ``WeightSync.push(named_tensors, version)`` followed by ``WeightSync.verify(...)``:

1. ``/pause`` every server (in-flight requests are aborted; new ones queue).
2. ``/start_weight_update``; then the ``(name, tensor)`` stream is cut into buckets of about
   ``bucket_bytes``. The tensors may be FSDP2 shards (``DTensor``): bucket boundaries come from
   their global shapes, and each bucket is all-gathered (``full_tensor`` per tensor, a collective:
   every rank iterates the same stream, see ``drain``) just before it is written, so no rank ever
   holds the whole model. A producer thread gathers and writes bucket k+1 while the servers read
   bucket k (the process holds about two gathered buckets). Each bucket is one safetensors file
   in ``shm_dir``, hashed (xxh3-128) as it is written, and ``/update_weights`` names the file,
   the checksum, the bucket index and whether it is the last one, to every server at once (one
   file in shared memory, read by all). Bucket i of every sync goes to the same file, rewritten
   in place (``write_bucket``: a new file's pages cost more than the copy), so the files hold
   one model in shared memory from the first sync to ``close`` (a failed push deletes them; a
   sender killed before ``close`` leaves them to the next ``init`` on the host). In delta mode,
   or with ``keep_served``, the final bucket also carries ``weights_checksum``, the xxh3-128 of
   every tensor's name, dtype, shape and bytes (``delta.WeightsChecksum``): what a server holds
   is then known for the next delta or rejoin. The engine (``trident.weights.vllm_plugin``)
   refuses a bucket whose checksum, index, tensor names or shapes are wrong, or whose
   reconstructed weights hash differently, and applies the update only when the last bucket
   arrives, so a refused update leaves a server on its previous weights and version.
   A server on another host than the sender (``remote``: another Ray node, or an attached
   server's address that is not this host's) gets the bucket's URL instead of its path: the
   sender serves its bucket files over HTTP (``BucketServer``) and the server fetches the same
   checksummed bytes during the call, so the checks and the whole-or-nothing apply are the same.
3. ``/finish_weight_update {"weight_version": "N"}`` bumps the served version.
4. ``/resume``.
5. ``verify``: on every server, ``GET /weight_info`` must report N and the engine's logprobs of a
   fixed probe sequence must equal the trainer's (``probe_logprobs``) within a tolerance on
   max |Δlogp|. A sync that did not apply (not sent, lost, corrupted, half-applied, the LM head
   of a tied-embedding model left behind) fails here with ``WeightSyncError`` instead of being
   silently trained through. "Weights updated" from vLLM proves nothing on its own.

Verification runs after ``/resume`` because vLLM does not schedule requests while paused, so the
probe could not run before it. In the sync pipeline nothing generates between resume and verify;
in the async pipelines tokens generated in that window carry version N, and a failed verify stops
the run, so they are never trained on.

Any failure between start and finish sends ``{"abort": true}`` to every server (closing its update
session; a server that already applied the last bucket keeps the new weights under the old
version) and resumes them before raising, so a caller may retry the same version.

On GPUs, ``backend="nccl"`` / ``"ipc"`` drive vLLM's own trainer-side engines
(``WeightTransferTrainerFactory``) through the same HTTP routes, one NCCL group per server; the
same pause/resume and ``verify`` apply.

Delta sync (``delta=True``): a bucket then holds, per tensor, the XOR of the new bits with the
bits the servers hold, zstd-compressed as the changed elements' gaps and values when few changed,
as byte planes otherwise (``trident.weights.delta``), tagged with the base version and base
checksum it applies to. The sender keeps what each server holds (version and weights checksum)
and, to encode the next delta, a CPU copy of the last pushed weights (one model on rank 0). Each
server keeps the same base in the trainer's layout (the engine repacks its own tensors, so it
cannot XOR against them): one model of extra memory. A server that
holds another base refuses the delta (``BASE_MISMATCH``); ``on_base_mismatch="full"`` then
resends the same version in full, ``"fail"`` raises. Every ``full_every``-th sync is full, the
first one always, and one after any failure (the sender no longer knows what a server holds).
The probe verification is the same for deltas and full syncs.

Simplifications: rank 0 writes and sends everything (other ranks only take part in the gathers);
the delta base is a full copy on rank 0 rather than each rank's shard; the GPU backends gather
each tensor once per server (vLLM's engines send to one server at a time). The public methods are synchronous (each runs its own event loop);
async callers use ``asyncio.to_thread``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import math
import os
import pickle
import random
import shutil
import threading
import time
import uuid
import weakref
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

import httpx
import torch

from trident.rollout.engine import VLLMClient, http_client
from trident.weights import delta as delta_codec
from trident.weights.tensors import full_tensor
from trident.weights.vllm_plugin import BASE_MISMATCH, CHECKSUM_ALGORITHM, DTYPES

Backend = Literal["shm", "nccl", "ipc"]
NamedTensors = Iterable[tuple[str, torch.Tensor]]

DEFAULT_BUCKET_BYTES = 256 << 20
_SAFETENSORS_DTYPES = {getattr(torch, name): code for code, name in DTYPES.items()}


class WeightSyncError(RuntimeError):
    """A weight sync failed or did not apply; the message names the server and the step."""


class _DeltaRefused(Exception):
    """A delta was refused for its base; carries the new weights, all gathered, for a resend."""

    def __init__(self, error: BaseException, new_state: dict[str, torch.Tensor] | None) -> None:
        super().__init__(str(error))
        self.error, self.new_state = error, new_state


# ---------------------------------------------------------------------------------------------
# The (name, tensor) stream


def hf_named_tensors(
    model_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor],
    tie_word_embeddings: bool,
    *,
    embed_name: str = "model.embed_tokens.weight",
    head_name: str = "lm_head.weight",
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(HF name, tensor)`` for every weight, with ``head_name`` always present when tied.

    vLLM's reload unties a tied LM head: an update that carries only the embedding leaves the
    head on the old weights (measured: the engine then silently mixes old and new). So for a
    model with ``tie_word_embeddings`` the head is sent explicitly, as the embedding tensor.
    """
    if isinstance(model_or_state_dict, torch.nn.Module):
        state: Mapping[str, torch.Tensor] = model_or_state_dict.state_dict()
    else:
        state = model_or_state_dict
    embedding = None
    has_head = False
    for name, tensor in state.items():
        has_head = has_head or name == head_name
        if name == embed_name:
            embedding = tensor
        yield name, tensor.detach()
    if tie_word_embeddings and not has_head:
        if embedding is None:
            raise ValueError(
                f"tied embeddings: neither {head_name!r} nor {embed_name!r} is in the state "
                "dict; pass embed_name= for this architecture"
            )
        yield head_name, embedding.detach()


def iter_buckets(
    named_tensors: NamedTensors, bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group consecutive tensors into buckets of at most ``bucket_bytes`` (one bigger tensor gets
    a bucket of its own). Order is preserved; no bucket is empty."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


@dataclass(frozen=True)
class BucketFile:
    path: str
    checksum: str
    nbytes: int


def write_bucket(bucket: list[tuple[str, torch.Tensor]], path: str | Path) -> BucketFile:
    """Write ``bucket`` as a safetensors file at ``path``, in place, and checksum the bytes
    written.

    An existing file (the same bucket of the previous sync) is overwritten rather than replaced,
    so its shared-memory pages are reused: allocating a new file's pages on tmpfs costs several
    times the copy itself (64 MB: 36 ms into a new file, 10 ms into an existing one, measured
    here). Each tensor's bytes go from its memory to the file in one ``pwrite``, and the
    checksum is taken from the same memory as it is written: the file is never read back.
    """
    tensors: list[tuple[str, torch.Tensor]] = []
    header: dict[str, dict[str, Any]] = {}
    offset = 0
    for name, tensor in bucket:
        if name in header:
            raise ValueError(f"tensor {name!r} appears twice in one bucket")
        t = _full_cpu(tensor)
        nbytes = t.numel() * t.element_size()
        dtype = _SAFETENSORS_DTYPES[t.dtype]
        header[name] = {
            "dtype": dtype,
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        tensors.append((name, t))
        offset += nbytes
    return _write_safetensors(path, header, tensors, offset)


def _write_safetensors(
    path: str | Path,
    header: dict[str, Any],
    tensors: list[tuple[str, torch.Tensor]],
    data_bytes: int,
) -> BucketFile:
    """The safetensors layout: an 8-byte little-endian header length, the JSON header padded
    with spaces to a multiple of 8 bytes, then the tensors' bytes in the header's order."""
    import xxhash

    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    chunks = [memoryview(len(text).to_bytes(8, "little") + text)]
    chunks += [t.reshape(-1).view(torch.uint8).numpy().data for _, t in tensors if t.numel()]
    total = len(chunks[0]) + data_bytes
    digest = xxhash.xxh3_128()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if os.fstat(fd).st_size != total:
            os.ftruncate(fd, total)
        position = 0
        for chunk in chunks:
            digest.update(chunk)
            view = chunk
            while view:  # one pwrite moves at most ~2 GiB
                written = os.pwrite(fd, view, position)
                view, position = view[written:], position + written
    finally:
        os.close(fd)
    return BucketFile(str(path), f"{CHECKSUM_ALGORITHM}:{digest.hexdigest()}", total)


def write_delta_bucket(
    bucket: list[tuple[str, torch.Tensor]], base: Mapping[str, torch.Tensor], path: str | Path
) -> BucketFile:
    """Write the delta of every (full, CPU) tensor of ``bucket`` against ``base`` as a
    safetensors file of compressed byte strings, in place like ``write_bucket``; dtypes and
    shapes go in its metadata."""
    payloads: list[tuple[str, torch.Tensor]] = []
    meta: dict[str, list] = {}
    header: dict[str, Any] = {}
    offset = 0
    for name, tensor in bucket:
        held = base.get(name)
        if held is None or held.dtype != tensor.dtype or held.shape != tensor.shape:
            raise WeightSyncError(
                f"{BASE_MISMATCH}: tensor {name!r} ({tensor.dtype}, {tuple(tensor.shape)}) is not "
                "in the sender's base; a full sync is needed"
            )
        payload = delta_codec.encode(tensor, held)
        payloads.append((name, torch.frombuffer(bytearray(payload), dtype=torch.uint8)))
        meta[name] = [str(tensor.dtype).removeprefix("torch."), list(tensor.shape)]
        header[name] = {
            "dtype": "U8",
            "shape": [len(payload)],
            "data_offsets": [offset, offset + len(payload)],
        }
        offset += len(payload)
    header["__metadata__"] = {
        "trident_delta": json.dumps({"encoding": delta_codec.ENCODING, "tensors": meta})
    }
    return _write_safetensors(path, header, payloads, offset)


def drain(named_tensors: NamedTensors) -> None:
    """Take part in the gathers of a push without sending: what every FSDP rank but the sender
    does with the same stream (``full_tensor`` is a collective, called in the same order)."""
    for _, tensor in named_tensors:
        full_tensor(tensor)


def _full_cpu(tensor: torch.Tensor) -> torch.Tensor:
    return full_tensor(tensor).to("cpu").contiguous()


def _mark_last(
    buckets: Iterator[list[tuple[str, torch.Tensor]]],
) -> Iterator[tuple[list[tuple[str, torch.Tensor]], bool]]:
    """``(bucket, is_last)``: one bucket of lookahead (of shards: nothing is gathered yet)."""
    bucket = next(buckets, None)
    while bucket is not None:
        following = next(buckets, None)
        yield bucket, following is None
        bucket = following


@dataclass
class _Sent:
    """What the producer thread hands to the sender: one written bucket."""

    info: dict[str, Any]
    file: BucketFile
    num_tensors: int
    weights_bytes: int


@dataclass
class _StreamEnd:
    """The producer is done: every tensor of the stream was gathered (also after an error)."""

    error: BaseException | None
    weights_checksum: str
    # The kept copy of what was sent (``keep``). Not in the repr: asyncio.run formats its main
    # task, result included, as it restores the SIGINT handler (Python 3.11), and printing a
    # model's tensors took 0.65 s of a 150M model's sync.
    new_state: dict[str, torch.Tensor] | None = field(repr=False)


# ---------------------------------------------------------------------------------------------
# The probe


def make_probe(tokenizer_or_vocab_size: Any, length: int, seed: int = 0) -> list[int]:
    """A fixed pseudo-random token sequence for ``verify``; a tokenizer's special tokens are
    left out (a bare vocabulary size excludes nothing)."""
    if length < 2:
        raise ValueError("a probe needs at least 2 tokens (the first has no logprob)")
    if isinstance(tokenizer_or_vocab_size, int):
        vocab_size, special = tokenizer_or_vocab_size, set()
    else:
        tok = tokenizer_or_vocab_size
        vocab_size = len(tok)
        special = set(tok.all_special_ids) | set(getattr(tok, "added_tokens_decoder", {}))
    allowed = [i for i in range(vocab_size) if i not in special]
    rng = random.Random(seed)
    return [rng.choice(allowed) for _ in range(length)]


@torch.no_grad()
def probe_logprobs(model: torch.nn.Module, probe_ids: list[int]) -> list[float]:
    """The trainer's logprob of each probe token after the first (HF forward, eval mode)."""
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        ids = torch.tensor([probe_ids], device=device)
        logits = model(input_ids=ids).logits[0, :-1].float()
        logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    finally:
        model.train(was_training)
    return logp.cpu().tolist()


# ---------------------------------------------------------------------------------------------
# The protocol


class WeightSync:
    """Pushes weights to every vLLM server in ``urls`` and verifies that they applied."""

    def __init__(
        self,
        urls: list[str],
        backend: Backend = "shm",
        shm_dir: str | Path = "/dev/shm",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        *,
        timeout_s: float = 120.0,
        nccl_master_address: str = "127.0.0.1",
        engine_world_size: int = 1,
        delta: bool = False,
        full_every: int = 10,
        on_base_mismatch: Literal["fail", "full"] = "fail",
        keep_served: bool = False,
        remote: Iterable[str] = (),
        serve_host: str = "127.0.0.1",
    ) -> None:
        """``timeout_s`` bounds every HTTP call; ``nccl_master_address`` and
        ``engine_world_size`` (a server's TP x PP x DP ranks) are used by ``backend="nccl"``;
        ``delta``, ``full_every`` and ``on_base_mismatch``: see the module docstring (shm);
        ``keep_served``: keep a copy of the last pushed weights for ``rejoin`` (shm);
        ``remote``: the servers on other hosts, which fetch each bucket over HTTP from this
        process at ``serve_host`` (shm)."""
        if not urls:
            raise ValueError("WeightSync needs at least one server url")
        if backend not in ("shm", "nccl", "ipc"):
            raise ValueError(f"unknown weight sync backend {backend!r}: shm | nccl | ipc")
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        if full_every < 1:
            raise ValueError(f"full_every must be >= 1, got {full_every}")
        if delta and backend != "shm":
            raise ValueError(f"delta sync needs backend='shm', got {backend!r}")
        self.urls = [u.rstrip("/") for u in urls]
        self.targets = self.urls  # the servers the last push went to (the others were down)
        self.backend = backend
        self.shm_dir = Path(shm_dir)
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.nccl_master_address = nccl_master_address
        self.engine_world_size = engine_world_size
        self.version: int | None = None  # last version finished on every server
        self._file_prefix = f"trident-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._gpu: dict[str, tuple[_HTTPControlPlane, Any]] = {}
        self.delta, self.full_every, self.on_base_mismatch = delta, full_every, on_base_mismatch
        # what each server holds: (version, weights checksum: "" unless delta or keep_served);
        # None = unknown (full sync next)
        self.held: dict[str, tuple[int, str] | None] = dict.fromkeys(self.urls)
        self.keep_served = keep_served
        # a CPU copy of the weights of base_key, the last push (delta mode, keep_served)
        self._base: dict[str, torch.Tensor] | None = None
        self._base_key: tuple[int, str] | None = None
        self._deltas_since_full = 0
        self.remote = {u.rstrip("/") for u in remote}
        self.serve_host = serve_host
        self._buckets_server: BucketServer | None = None
        # The bucket files live from the first push to close(), or to this process's exit.
        self._remove_files = weakref.finalize(self, _remove_files, self.shm_dir, self._file_prefix)

    # -- setup ---------------------------------------------------------------------------------

    def init(self) -> None:
        """Called once, after the servers are up: ``/init_weight_transfer_engine`` on each."""
        if self.backend == "shm":
            self.shm_dir.mkdir(parents=True, exist_ok=True)
            _remove_orphans(self.shm_dir)
            if self.remote and self._buckets_server is None:
                self._buckets_server = BucketServer(
                    self.shm_dir, self._file_prefix, self.serve_host
                )
            asyncio.run(self._init_shm())
        else:
            self._init_gpu()

    async def _init_shm(self) -> None:
        async with http_client(self.timeout_s) as http:
            init = {"init_info": {"keep_base": self.delta}}
            await self._each(
                "init_weight_transfer_engine",
                lambda url: _post(http, url, "/init_weight_transfer_engine", init),
            )
        self.held.update(dict.fromkeys(self.targets))

    # -- push ----------------------------------------------------------------------------------

    def push(
        self, named_tensors: NamedTensors, version: int, urls: list[str] | None = None
    ) -> dict[str, float]:
        """Pause, transfer, bump to ``version``, resume, on ``urls`` (default: every server;
        fewer while one is down, none at all while every one is). Returns bytes and seconds per
        phase. The stream is consumed either way (the other ranks' gathers).

        Raises ``WeightSyncError`` (servers resumed on their previous version) when any server
        refuses or fails a step. Follow with ``verify``.
        """
        if self.version is not None and version <= self.version:
            raise ValueError(
                f"version {version} is not newer than the last pushed ({self.version})"
            )
        self.targets = self.urls if urls is None else [u.rstrip("/") for u in urls]
        stream = iter(named_tensors)
        try:
            if self.backend == "shm":
                metrics = self._push_shm_full_or_delta(stream, version)
            else:
                metrics = self._push_gpu(stream, version)
        finally:
            drain(stream)  # a push that failed early still owes the other ranks its gathers
        self.version = version
        return metrics

    def next_is_delta(self) -> bool:
        """Whether the next push is a delta: delta mode, fewer than ``full_every - 1`` deltas
        since the last full sync, and every server known to hold the sender's base."""
        return (
            self.delta
            and self._base_key is not None
            and self._deltas_since_full + 1 < self.full_every
            and all(self.held[url] == self._base_key for url in self.targets)
        )

    def _push_shm_full_or_delta(
        self, stream: Iterator[tuple[str, torch.Tensor]], version: int
    ) -> dict[str, float]:
        is_delta = self.next_is_delta()
        keep = self.delta or self.keep_served
        try:
            m, end = asyncio.run(self._push_shm(stream, version, is_delta, keep))
            kept = end.new_state
        except _DeltaRefused as refused:
            self.held.update(dict.fromkeys(self.targets))
            if self.on_base_mismatch != "full" or refused.new_state is None:
                raise WeightSyncError(
                    f"{refused.error}\n(sync.on_base_mismatch=full resends in full instead)"
                ) from refused.error
            # The refused attempt gathered (and kept) every tensor already: resend those, in full.
            kept = refused.new_state
            m, end = asyncio.run(self._push_shm(iter(kept.items()), version, False, keep=False))
            m["fallback_full"] = 1.0
        except BaseException:
            self.held.update(dict.fromkeys(self.targets))
            raise
        key = (version, end.weights_checksum)
        self.held.update(dict.fromkeys(self.targets, key))
        self._deltas_since_full = (
            self._deltas_since_full + 1 if is_delta and "fallback_full" not in m else 0
        )
        if kept is not None:
            self._base, self._base_key = kept, key
        return m

    async def _push_shm(
        self,
        stream: Iterator[tuple[str, torch.Tensor]],
        version: int,
        is_delta: bool,
        keep: bool,
    ) -> tuple[dict[str, float], _StreamEnd]:
        """One push of ``stream``; ``keep``: update the kept copy of the served weights."""
        phases = (
            "pause_s", "start_s", "gather_s", "write_s", "keep_s", "update_s", "finish_s", "resume_s"
        )  # fmt: skip
        m: dict[str, float] = dict.fromkeys(phases, 0.0)
        m.update(bytes=0.0, weights_bytes=0.0, num_buckets=0.0, num_tensors=0.0)
        m["delta"] = float(is_delta)
        t_start = time.perf_counter()
        engines = {url: VLLMClient(url, timeout_s=self.timeout_s) for url in self.targets}
        async with http_client(self.timeout_s) as http:
            started = False
            try:
                with _timed(m, "pause_s"):
                    await self._each("pause", lambda url: engines[url].pause())
                # Set before: when one server fails to start, the others have started and
                # must be closed (an abort reaching a server with no session fails harmlessly).
                started = True
                with _timed(m, "start_s"):
                    await self._each(
                        "start_weight_update",
                        lambda url: _post(http, url, "/start_weight_update"),
                    )
                end = await self._send_buckets(http, stream, version, is_delta, keep, m)
                with _timed(m, "finish_s"):
                    await self._each(
                        "finish_weight_update",
                        lambda url: _post(
                            http, url, "/finish_weight_update", {"weight_version": str(version)}
                        ),
                    )
            except BaseException:
                if started:  # close every server's update session (see the module docstring)
                    abort = {"update_info": {"abort": True}}
                    await asyncio.gather(
                        *(_post(http, url, "/update_weights", abort) for url in self.targets),
                        return_exceptions=True,
                    )
                await asyncio.gather(
                    *(engine.resume() for engine in engines.values()), return_exceptions=True
                )
                raise
            else:
                with _timed(m, "resume_s"):
                    await self._each("resume", lambda url: engines[url].resume())
            finally:
                for engine in engines.values():
                    await engine.aclose()
        m["total_s"] = time.perf_counter() - t_start
        return m, end

    async def _send_buckets(
        self,
        http: httpx.AsyncClient,
        stream: Iterator[tuple[str, torch.Tensor]],
        version: int,
        is_delta: bool,
        keep: bool,
        m: dict[str, float],
    ) -> _StreamEnd:
        """Send buckets as the producer thread writes them; returns once it has gathered the
        whole stream, even after a failure (the other ranks' gathers must complete)."""
        loop = asyncio.get_running_loop()
        ready: asyncio.Queue[_Sent | _StreamEnd] = asyncio.Queue()
        buffers = threading.Semaphore(2)  # bucket k is read while bucket k+1 is written
        failed = threading.Event()
        producer = threading.Thread(
            target=self._produce,
            args=(stream, version, is_delta, keep, m, buffers, failed),
            kwargs={"hand_over": lambda item: loop.call_soon_threadsafe(ready.put_nowait, item)},
            name="trident-weight-sync-producer",
            daemon=True,
        )
        producer.start()
        error: BaseException | None = None
        while not isinstance(item := await ready.get(), _StreamEnd):
            try:
                if error is None:
                    with _timed(m, "update_s"):
                        await self._each(
                            f"update_weights (bucket {item.info['index']}, "
                            f"{item.file.nbytes} bytes)",
                            lambda url, info=item.info: _post(
                                http, url, "/update_weights", {"update_info": self._for(url, info)}
                            ),
                        )
                    m["bytes"] += item.file.nbytes
                    m["http_servers"] = float(len(self.remote.intersection(self.targets)))
                    m["weights_bytes"] += item.weights_bytes
                    m["num_buckets"] += 1
                    m["num_tensors"] += item.num_tensors
            except BaseException as e:  # keep taking buckets: the producer must finish
                error = e
                failed.set()
            finally:
                buffers.release()
        await asyncio.to_thread(producer.join)
        error = error or item.error
        if error is not None:
            _remove_files(self.shm_dir, self._file_prefix)  # the next push writes them anew
            if is_delta and BASE_MISMATCH in str(error):
                raise _DeltaRefused(error, item.new_state)
            raise error
        return item

    def _for(self, url: str, info: dict[str, Any]) -> dict[str, Any]:
        """The bucket's ``update_info`` for server ``url``: the file's path for a server on
        this host, the URL it fetches the same bytes from for one on another host."""
        if url not in self.remote:
            return info
        assert self._buckets_server is not None  # init() started it
        return {**info, "path": "", "url": self._buckets_server.url_of(info["path"])}

    def _produce(
        self,
        stream: Iterator[tuple[str, torch.Tensor]],
        version: int,
        is_delta: bool,
        keep: bool,
        m: dict[str, float],
        buffers: threading.Semaphore,
        failed: threading.Event,
        *,
        hand_over: Callable[[_Sent | _StreamEnd], object],
    ) -> None:
        """Producer thread: gather each bucket (a collective), checksum, encode, write, hand
        over, then (``keep``) copy it into the kept copy of the served weights. After an error
        it keeps gathering (and keeping) but writes nothing."""
        # The weights' checksum keys what a server holds, for deltas and rejoins; a full sync is
        # otherwise checked by its files' checksums alone.
        weights = delta_codec.WeightsChecksum() if self.delta or self.keep_served else None
        base = self._base if is_delta else None
        base_version, base_checksum = self._base_key if is_delta and self._base_key else (-1, "")
        kept: dict[str, torch.Tensor] | None = None
        if keep:  # overwritten in place from here on: it holds no version until this succeeds
            kept = self._base if self._base is not None else {}
            self._base_key = None
        error: BaseException | None = None
        seen: set[str] = set()
        index = -1
        try:
            for index, (bucket, final) in enumerate(
                _mark_last(iter_buckets(stream, self.bucket_bytes))
            ):
                buffers.acquire()
                with _timed(m, "gather_s"):
                    gathered = [(name, _full_cpu(tensor)) for name, tensor in bucket]
                if error is not None or failed.is_set():
                    buffers.release()
                else:
                    try:
                        with _timed(m, "write_s"):
                            file = self._write(gathered, index, version, seen, weights, base)
                    except OSError as e:
                        error = WeightSyncError(
                            f"push of version {version}: writing bucket {index} to "
                            f"{self.shm_dir} failed: {e}. The bucket files hold one copy of the "
                            "model for the run: is there room? (a container's /dev/shm is "
                            "often 64 MB: `docker run --shm-size=...`)"
                        )
                        buffers.release()
                    except BaseException as e:
                        error = e
                        buffers.release()
                    else:
                        info: dict[str, Any] = {
                            "path": file.path,
                            "checksum": file.checksum,
                            "index": index,
                            "final": final,
                            "version": version,
                            "kind": "delta" if is_delta else "full",
                            "base_version": base_version,
                            "base_checksum": base_checksum,
                        }
                        if final and weights is not None:
                            info["weights_checksum"] = weights.hexdigest()
                        nbytes = sum(t.numel() * t.element_size() for _, t in gathered)
                        hand_over(_Sent(info, file, len(gathered), nbytes))
                if kept is not None:  # after this bucket's delta was encoded against it
                    with _timed(m, "keep_s"):
                        _keep(kept, gathered)
                del gathered
            if index < 0:
                error = WeightSyncError(f"push of version {version}: no tensors to send")
        except BaseException as e:  # the stream itself failed: nothing more can be gathered
            error = error or e
        hand_over(_StreamEnd(error, weights.hexdigest() if weights else "", kept))

    def _write(
        self,
        gathered: list[tuple[str, torch.Tensor]],
        index: int,
        version: int,
        seen: set[str],
        weights: delta_codec.WeightsChecksum | None,
        base: Mapping[str, torch.Tensor] | None,
    ) -> BucketFile:
        """Bucket ``index`` of this push, written to its file: in full, or as a delta against
        ``base``."""
        for name, _ in gathered:
            if name in seen:
                raise WeightSyncError(f"push of version {version}: tensor {name!r} sent twice")
            seen.add(name)
        if weights is not None:
            weights.update_bucket(gathered)
        path = self.shm_dir / f"{self._file_prefix}-b{index}.safetensors"
        if base is not None:
            return write_delta_bucket(gathered, base, path)
        return write_bucket(gathered, path)

    def rejoin(
        self, url: str, probe_ids: list[int], expected_logprobs: list[float], tolerance: float
    ) -> dict[str, float]:
        """Bring a restarted server (``url``, serving its start-up weights) to the last pushed
        version: initialise its transfer engine again, send the kept copy of that version in
        full, and verify it against the probe logprobs the trainer computed for that version.
        Needs ``keep_served`` (or ``delta``) and the shm backend."""
        if self.backend != "shm" or self._base is None or self._base_key is None:
            raise WeightSyncError(
                f"{url}: a restarted server can be brought back only by the shm backend with a "
                f"kept copy of the served weights (backend {self.backend!r}, copy kept: "
                f"{self._base is not None}, holding a whole version: {self._base_key is not None}; "
                "a push that failed leaves it holding none until the next one succeeds)"
            )
        version, targets = self._base_key[0], self.targets
        self.targets = [url.rstrip("/")]
        try:
            asyncio.run(self._init_shm())
            m, end = asyncio.run(
                self._push_shm(iter(self._base.items()), version, False, keep=False)
            )
            if (version, end.weights_checksum) != self._base_key:
                raise WeightSyncError(f"{url}: the kept copy of version {version} changed")
            self.held[self.targets[0]] = self._base_key
            m |= self.verify(probe_ids, expected_logprobs, version, tolerance)
        finally:
            self.targets = targets
        return m

    # -- verify --------------------------------------------------------------------------------

    def verify(
        self,
        probe_ids: list[int],
        expected_logprobs: list[float],
        version: int,
        tolerance: float,
    ) -> dict[str, float]:
        """Called after ``push``: every server it went to must report ``version`` and reproduce
        the trainer's probe logprobs within ``tolerance`` (max |Δlogp|); raises
        ``WeightSyncError`` naming each server that does not. Returns max/mean |Δlogp| over the
        servers (zeros when the push went to none)."""
        if len(expected_logprobs) != len(probe_ids) - 1:
            raise ValueError(
                f"expected_logprobs has {len(expected_logprobs)} values; a probe of "
                f"{len(probe_ids)} tokens has {len(probe_ids) - 1}"
            )
        return asyncio.run(self._verify(probe_ids, expected_logprobs, version, tolerance))

    async def _verify(
        self, probe_ids: list[int], expected: list[float], version: int, tolerance: float
    ) -> dict[str, float]:
        t0 = time.perf_counter()
        engines = {url: VLLMClient(url, timeout_s=self.timeout_s) for url in self.targets}
        async with http_client(self.timeout_s) as http:

            async def check(url: str) -> tuple[float, float]:
                served = (await _get(http, url, "/weight_info")).get("weight_version")
                if served != str(version):
                    raise WeightSyncError(
                        f"{url}: version check failed: /weight_info reports {served!r}, "
                        f"expected {str(version)!r} (the update did not reach this server)"
                    )
                got = await engines[url].prompt_logprobs(probe_ids)
                return _compare_probe(url, version, expected, got, tolerance)

            try:
                results = await self._each("verify", check)
            finally:
                for engine in engines.values():
                    await engine.aclose()
        maxima = [r[0] for r in results.values()] or [0.0]
        means = [r[1] for r in results.values()] or [0.0]
        return {
            "max_abs_dlogp": max(maxima),
            "mean_abs_dlogp": sum(means) / len(means),
            "verify_s": time.perf_counter() - t0,
        }

    # -- GPU backends (vLLM's own trainer engines) ---------------------------------------------

    def _init_gpu(self) -> None:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from trident.cluster.net import free_port

        for url in self.urls:
            client = _HTTPControlPlane(url, self.timeout_s)
            if self.backend == "nccl":
                from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

                init_info: Any = NCCLTrainerInitInfo(
                    master_address=self.nccl_master_address,
                    master_port=free_port(),
                    world_size=1 + self.engine_world_size,
                    rank=0,
                )
            else:
                from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

                init_info = IPCTrainerInitInfo(rank=0)
            try:
                engine = WeightTransferTrainerFactory.trainer_init(
                    init_info, client=client, source=_tensor_source([])
                )
            except WeightSyncError:
                raise
            except Exception as e:
                raise WeightSyncError(f"{url}: {self.backend} trainer_init failed: {e}") from e
            self._gpu[url] = (client, engine)

    def _push_gpu(self, named_tensors: NamedTensors, version: int) -> dict[str, float]:
        if not self._gpu:
            raise WeightSyncError(f"backend {self.backend!r}: call init() before push()")
        m: dict[str, float] = dict.fromkeys(("pause_s", "update_s", "resume_s"), 0.0)
        t_start = time.perf_counter()
        pairs = list(named_tensors)  # shards: nothing gathered yet (global shapes known)
        m["bytes"] = float(sum(t.numel() * t.element_size() for _, t in pairs))
        m["num_tensors"] = float(len(pairs))
        source = _tensor_source(pairs)  # gathers each tensor as vLLM's engine sends it
        with _timed(m, "pause_s"):
            asyncio.run(self._fan_engine("pause"))
        try:
            with _timed(m, "update_s"):
                for url in self.targets:  # the servers that are up: every rank gathers for each
                    client, engine = self._gpu[url]
                    client.weight_version = str(version)
                    engine.source = source
                    try:
                        engine.send_weights()
                    except WeightSyncError:
                        raise
                    except Exception as e:
                        raise WeightSyncError(
                            f"{url}: {self.backend} send_weights failed: {e}"
                        ) from e
        finally:
            with _timed(m, "resume_s"):
                asyncio.run(self._fan_engine("resume"))
        m["total_s"] = time.perf_counter() - t_start
        return m

    async def _fan_engine(self, method: Literal["pause", "resume"]) -> None:
        engines = {url: VLLMClient(url, timeout_s=self.timeout_s) for url in self.targets}
        try:
            await self._each(method, lambda url: getattr(engines[url], method)())
        finally:
            for engine in engines.values():
                await engine.aclose()

    def close(self) -> None:
        """Release GPU transfer groups, stop serving buckets to other hosts, delete the bucket
        files."""
        self._remove_files()
        for _, engine in self._gpu.values():
            engine.shutdown()
        self._gpu.clear()
        if self._buckets_server is not None:
            self._buckets_server.close()
            self._buckets_server = None

    # -- fan-out -------------------------------------------------------------------------------

    async def _each(self, step: str, call: Callable[[str], Awaitable[Any]]) -> dict[str, Any]:
        """Run ``call(url)`` on every target at once; raise one error naming every failure."""
        results = await asyncio.gather(*(call(url) for url in self.targets), return_exceptions=True)
        errors = []
        for url, result in zip(self.targets, results, strict=True):
            if isinstance(result, WeightSyncError):
                errors.append(str(result))
            elif isinstance(result, BaseException):
                errors.append(f"{url}: {step} failed: {type(result).__name__}: {result}")
        if errors:
            raise WeightSyncError("\n".join(errors))
        return dict(zip(self.targets, results, strict=True))


class BucketServer:
    """Serves this sender's bucket files (``GET /<file name>``, names with ``prefix`` only) to
    servers on other hosts, from a thread: the cross-host transport of the shm backend. A server
    fetches the same checksummed bytes a local one reads from the file, during its
    ``/update_weights`` call, so a file is deleted only after every server has it. The names
    carry a random part; the address is the trainer node's, for the cluster's own network."""

    def __init__(self, directory: Path, prefix: str, host: str) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                name = self.path.lstrip("/")
                path = directory / name
                if "/" in name or not name.startswith(prefix) or not path.is_file():
                    self.send_error(404)
                    return
                with path.open("rb") as f:
                    self.send_response(200)
                    self.send_header("Content-Length", str(os.fstat(f.fileno()).st_size))
                    self.end_headers()
                    shutil.copyfileobj(f, self.wfile, 1 << 20)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                """Quiet: http.server writes a line per request to stderr by default."""

        self._httpd = ThreadingHTTPServer((host, 0), Handler)
        self.base = f"http://{host}:{self._httpd.server_address[1]}"
        threading.Thread(
            target=self._httpd.serve_forever, name="trident-buckets", daemon=True
        ).start()

    def url_of(self, path: str) -> str:
        return f"{self.base}/{Path(path).name}"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def _keep(kept: dict[str, torch.Tensor], gathered: list[tuple[str, torch.Tensor]]) -> None:
    """Copy each tensor into the kept copy: into the tensor kept under its name when it has the
    same shape and dtype (new pages for a model's worth of copies at every sync cost more than
    the copying: 150M model, push with the copy 1.47 s cloning vs 0.45 s without it), else as
    a new clone (a plain model's tensors are its live parameters)."""
    for name, tensor in gathered:
        held = kept.get(name)
        if held is not None and held.shape == tensor.shape and held.dtype == tensor.dtype:
            held.copy_(tensor)
        else:
            kept[name] = tensor.clone()


def _remove_files(directory: Path, prefix: str) -> None:
    for path in directory.glob(f"{prefix}-b*.safetensors"):
        path.unlink(missing_ok=True)


def _remove_orphans(directory: Path) -> None:
    """Delete the bucket files of senders whose process is gone (killed before ``close``)."""
    for path in directory.glob("trident-weights-*-*-b*.safetensors"):
        pid = path.name.split("-")[2]
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):  # another user's, or already gone
                path.unlink()
        except (ValueError, PermissionError):  # alive, or not ours to judge
            continue


def same_host(url: str, server_node: str | None, node: str, ip: str) -> bool:
    """Whether the server at ``url`` shares this process's host: the same Ray node when the
    server's node is known (``server_node``), else a loopback address or this node's ``ip``."""
    if server_node is not None:
        return server_node == node
    return urlparse(url).hostname in ("127.0.0.1", "localhost", "::1", ip)


def _compare_probe(
    url: str, version: int, expected: list[float], got: list[float], tolerance: float
) -> tuple[float, float]:
    if len(got) != len(expected):
        raise WeightSyncError(
            f"{url}: probe check failed: engine returned {len(got)} logprobs, "
            f"expected {len(expected)}"
        )
    diffs = [abs(g - e) for g, e in zip(got, expected, strict=True)]
    worst = max(range(len(diffs)), key=lambda i: diffs[i] if math.isfinite(diffs[i]) else math.inf)
    # A NaN compares false with everything: test finiteness explicitly, never `diff > tol` alone.
    if not math.isfinite(diffs[worst]) or diffs[worst] > tolerance:
        raise WeightSyncError(
            f"{url}: probe check failed at version {version}: max |Δlogp| = {diffs[worst]:.3g} "
            f"> tolerance {tolerance:g} at probe position {worst + 1}: expected "
            f"{expected[worst]:.5f} (trainer), got {got[worst]:.5f} (engine); "
            f"mean |Δlogp| = {sum(diffs) / len(diffs):.3g}"
        )
    return diffs[worst], sum(diffs) / len(diffs)


async def _post(
    http: httpx.AsyncClient, url: str, path: str, payload: dict | None = None
) -> dict[str, Any]:
    try:
        r = await http.post(f"{url}{path}", json=payload or {})
    except httpx.HTTPError as e:
        raise WeightSyncError(f"{url}: {path} failed: {type(e).__name__}: {e}") from e
    if r.status_code != 200:
        raise WeightSyncError(f"{url}: {path} failed: HTTP {r.status_code}: {r.text[:1000]}")
    return r.json() if r.content else {}


async def _get(http: httpx.AsyncClient, url: str, path: str) -> dict[str, Any]:
    try:
        r = await http.get(f"{url}{path}")
    except httpx.HTTPError as e:
        raise WeightSyncError(f"{url}: {path} failed: {type(e).__name__}: {e}") from e
    if r.status_code != 200:
        raise WeightSyncError(f"{url}: {path} failed: HTTP {r.status_code}: {r.text[:1000]}")
    return r.json()


class _timed:
    """Adds the seconds spent in the ``with`` block to ``metrics[key]``."""

    def __init__(self, metrics: dict[str, float], key: str) -> None:
        self.metrics, self.key = metrics, key

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.metrics[self.key] += time.perf_counter() - self.t0


class _HTTPControlPlane:
    """vLLM's ``VLLMWeightSyncClient`` protocol over httpx for one server, used by vLLM's
    trainer-side engines (they call it from worker threads, hence synchronous)."""

    def __init__(self, url: str, timeout_s: float) -> None:
        self.url, self.timeout_s = url, timeout_s
        self.weight_version: str | None = None  # set by WeightSync.push before each send

    def _post(self, path: str, payload: dict) -> None:
        try:
            r = httpx.post(f"{self.url}{path}", json=payload, timeout=self.timeout_s)
        except httpx.HTTPError as e:
            raise WeightSyncError(f"{self.url}: {path} failed: {type(e).__name__}: {e}") from e
        if r.status_code != 200:
            raise WeightSyncError(
                f"{self.url}: {path} failed: HTTP {r.status_code}: {r.text[:1000]}"
            )

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


def _tensor_source(pairs: list[tuple[str, torch.Tensor]]) -> Any:
    """A vLLM ``WeightSource`` over ``(name, shard or tensor)`` pairs: ``metadata()`` reads the
    global shapes (no gather), and each iteration gathers one tensor at a time as vLLM's engine
    sends it (``full_tensor``, a collective), so rank 0 never holds the whole model. vLLM
    iterates the source once per server's ``send_weights``; the other ranks drain the same
    stream as many times (``PolicyWorker.sync_weights``)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class ShardSource(WeightSource):
        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in pairs]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in pairs:
                yield name, full_tensor(tensor)

    return ShardSource()
