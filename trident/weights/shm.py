"""The shm transport: the weights as checksummed safetensors bucket files in shared memory, read
by trident's vLLM engine (``trident.weights.shm_engine``), fetched over HTTP by a server on
another host.

One send, while ``WeightSync`` holds the servers paused: ``/start_weight_update``; then the
``(name, tensor)`` stream is cut into buckets of about ``bucket_bytes``. The tensors may be FSDP2
shards (``DTensor``): bucket boundaries come from their global shapes, and each bucket is
all-gathered (``full_tensor`` per tensor, a collective: every rank iterates the same stream, see
``sync.drain``) just before it is written, so no rank ever holds the whole model. A producer
thread gathers and writes bucket k+1 while the servers read bucket k (the process holds about two
gathered buckets). Each bucket is one safetensors file in ``shm_dir``, hashed (xxh3-128) as it is
written, and ``/update_weights`` names the file, the checksum, the bucket index and whether it is
the last one, to every server at once (one file in shared memory, read by all). Bucket i of every
sync goes to the same file, rewritten in place (``buckets.write_bucket``: a new file's pages cost
more than the copy), so the files hold one model in shared memory from the first sync to
``close`` (a failed push deletes them; a sender killed before ``close`` leaves them to the next
``init`` on the host). In delta mode, or with ``keep_served``, the final bucket also carries
``weights_checksum``, the xxh3-128 of every tensor's name, dtype, shape and bytes
(``delta.WeightsChecksum``): what a server holds is then known for the next delta or rejoin. The
engine refuses a bucket whose checksum, index, tensor names or shapes are wrong, or whose
reconstructed weights hash differently, and applies the update only when the last bucket
arrives, so a refused update leaves a server on its previous weights and version. Then
``/finish_weight_update {"weight_version": "N"}`` bumps the served version.

A server on another host than the sender (``remote``: another Ray node, or an attached server's
address that is not this host's) gets the bucket's URL instead of its path: the sender serves its
bucket files over HTTP (``BucketServer``) and the server fetches the same checksummed bytes during
the call, so the checks and the whole-or-nothing apply are the same. A server that joins the run
from another host (``resend``) is served from the address of this host that routes to it.

Any failure between start and finish sends ``{"abort": true}`` to every server (closing its update
session; a server that already applied the last bucket keeps the new weights under the old
version) before raising, so a caller may retry the same version.

Delta sync (``delta=True``): a bucket then holds, per tensor, the XOR of the new bits with the
bits the servers hold, zstd-compressed as the changed elements' gaps and values when few changed,
as byte planes otherwise (``trident.weights.delta``), tagged with the base version and base
checksum it applies to. The sender keeps what each server holds (version and weights checksum)
and, to encode the next delta, a CPU copy of the last pushed weights (one model on rank 0). Each
server keeps the same base in the trainer's layout (the engine repacks its own tensors, so it
cannot XOR against them): one model of extra memory. A server that
holds another base refuses the delta (``BASE_MISMATCH``); ``on_base_mismatch="full"`` then
resends the same version in full (while the servers are still paused), ``"fail"`` raises. Every
``full_every``-th sync is full, the first one always, and one after any failure (the sender no
longer knows what a server holds).

The same copy of the last pushed weights (``keep_served``) is what ``resend`` sends, in full, to
a restarted server.

Simplifications: rank 0 writes and sends everything (other ranks only take part in the gathers);
the delta base is a full copy on rank 0 rather than each rank's shard.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import threading
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

import torch

from trident.cluster.net import address_towards
from trident.rollout.engine import SERVED_MODEL
from trident.weights import delta as delta_codec
from trident.weights.buckets import (
    DEFAULT_BUCKET_BYTES,
    BucketFile,
    full_cpu,
    iter_buckets,
    mark_last,
    write_bucket,
    write_delta_bucket,
)
from trident.weights.control import WeightRoutes, WeightSyncError, each, timed
from trident.weights.vllm_plugin import BASE_MISMATCH


class ShmTransport:
    """Sends the weights as bucket files in ``shm_dir`` (the ``trident_shm`` engine reads them)."""

    served_model = SERVED_MODEL

    def __init__(
        self,
        shm_dir: str | Path = "/dev/shm",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        *,
        timeout_s: float = 120.0,
        delta: bool = False,
        full_every: int = 10,
        on_base_mismatch: Literal["fail", "full"] = "fail",
        keep_served: bool = False,
        remote: Iterable[str] = (),
        serve_host: str = "127.0.0.1",
    ) -> None:
        """``timeout_s`` bounds every HTTP call; ``delta``, ``full_every`` and
        ``on_base_mismatch``: see the module docstring; ``keep_served``: keep a copy of the last
        pushed weights for ``resend``; ``remote``: the servers on other hosts, which fetch each
        bucket over HTTP from this process; ``serve_host``: this host's address (a joiner at
        another is on another host)."""
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        if full_every < 1:
            raise ValueError(f"full_every must be >= 1, got {full_every}")
        self.shm_dir = Path(shm_dir)
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self._file_prefix = f"trident-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.delta, self.full_every, self.on_base_mismatch = delta, full_every, on_base_mismatch
        # what each server holds: (version, weights checksum: "" unless delta or keep_served);
        # None = unknown (full sync next)
        self.held: dict[str, tuple[int, str] | None] = {}
        self.keep_served = keep_served
        # a CPU copy of the weights of base_key, the last push (delta mode, keep_served)
        self._base: dict[str, torch.Tensor] | None = None
        self._base_key: tuple[int, str] | None = None
        self._deltas_since_full = 0
        # each server on another host, and the address of this one it fetches the buckets from
        self.remote: dict[str, str] = {}
        self.serve_host = serve_host
        self._bucket_servers: dict[str, BucketServer] = {}  # one per address served from
        self._remote_urls = [u.rstrip("/") for u in remote]
        # The bucket files live from the first push to close(), or to this process's exit.
        self._remove_files = weakref.finalize(self, _remove_files, self.shm_dir, self._file_prefix)

    def passes(self, servers: int) -> int:
        """Once: every server reads the same bucket files."""
        return 1

    # -- setup ---------------------------------------------------------------------------------

    def init(self, urls: list[str]) -> None:
        """Called once by ``WeightSync.init``, after the servers are up: delete the files of dead
        senders, serve the bucket files to ``remote`` servers, ``/init_weight_transfer_engine``
        on each server."""
        self.shm_dir.mkdir(parents=True, exist_ok=True)
        _remove_orphans(self.shm_dir)
        for url in self._remote_urls:
            self._serve(url)
        asyncio.run(self._init_engines(urls))

    def _serve(self, url: str) -> None:
        """Serve the bucket files over HTTP to ``url``, a server on another host, from the
        address of this host on the route to it (``serve_host`` is loopback on one node)."""
        host = address_towards(urlparse(url).hostname or "")
        self.remote[url] = host
        if host not in self._bucket_servers:
            self._bucket_servers[host] = BucketServer(self.shm_dir, self._file_prefix, host)

    async def _init_engines(self, urls: list[str]) -> None:
        async with WeightRoutes(self.timeout_s) as routes:
            init = {"init_info": {"keep_base": self.delta}}
            await each(
                urls,
                "init_weight_transfer_engine",
                lambda url: routes.post(url, "/init_weight_transfer_engine", init),
            )
        self.held.update(dict.fromkeys(urls))

    # -- send ----------------------------------------------------------------------------------

    def send(
        self, stream: Iterator[tuple[str, torch.Tensor]], version: int, targets: list[str]
    ) -> dict[str, float]:
        """Called by ``WeightSync.push`` while ``targets`` are paused: ``version`` in full, or as
        a delta (``next_is_delta``), resent in full when a server refuses the delta's base and
        ``on_base_mismatch="full"``."""
        is_delta = self.next_is_delta(targets)
        keep = self.delta or self.keep_served
        try:
            m, end = asyncio.run(self._send(stream, version, targets, is_delta, keep))
            kept = end.new_state
        except _DeltaRefused as refused:
            self.held.update(dict.fromkeys(targets))
            if self.on_base_mismatch != "full" or refused.new_state is None:
                raise WeightSyncError(
                    f"{refused.error}\n(sync.on_base_mismatch=full resends in full instead)"
                ) from refused.error
            # The refused attempt gathered (and kept) every tensor already: resend those, in full.
            kept = refused.new_state
            m, end = asyncio.run(self._send(iter(kept.items()), version, targets, False, False))
            m["fallback_full"] = 1.0
        except BaseException:
            self.held.update(dict.fromkeys(targets))
            raise
        key = (version, end.weights_checksum)
        self.held.update(dict.fromkeys(targets, key))
        self._deltas_since_full = (
            self._deltas_since_full + 1 if is_delta and "fallback_full" not in m else 0
        )
        if kept is not None:
            self._base, self._base_key = kept, key
        return m

    def next_is_delta(self, targets: list[str]) -> bool:
        """Whether the next push to ``targets`` is a delta: delta mode, fewer than
        ``full_every - 1`` deltas since the last full sync, and every target known to hold the
        sender's base."""
        return (
            self.delta
            and self._base_key is not None
            and self._deltas_since_full + 1 < self.full_every
            and all(self.held.get(url) == self._base_key for url in targets)
        )

    async def _send(
        self,
        stream: Iterator[tuple[str, torch.Tensor]],
        version: int,
        targets: list[str],
        is_delta: bool,
        keep: bool,
    ) -> tuple[dict[str, float], _StreamEnd]:
        """One update of ``stream``: start, buckets, finish; ``keep``: update the kept copy of the
        served weights."""
        phases = ("start_s", "gather_s", "write_s", "keep_s", "update_s", "finish_s")
        m: dict[str, float] = dict.fromkeys(phases, 0.0)
        m.update(bytes=0.0, weights_bytes=0.0, num_buckets=0.0, num_tensors=0.0)
        m["delta"] = float(is_delta)
        async with WeightRoutes(self.timeout_s) as routes:
            try:
                with timed(m, "start_s"):
                    await each(
                        targets,
                        "start_weight_update",
                        lambda url: routes.post(url, "/start_weight_update"),
                    )
                end = await self._send_buckets(routes, stream, version, targets, is_delta, keep, m)
                with timed(m, "finish_s"):
                    await each(
                        targets,
                        "finish_weight_update",
                        lambda url: routes.post(
                            url, "/finish_weight_update", {"weight_version": str(version)}
                        ),
                    )
            except BaseException:
                # Close every server's update session (see the module docstring): when one server
                # fails to start, the others have started (an abort reaching a server with no
                # session fails harmlessly).
                abort = {"update_info": {"abort": True}}
                await asyncio.gather(
                    *(routes.post(url, "/update_weights", abort) for url in targets),
                    return_exceptions=True,
                )
                raise
        return m, end

    async def _send_buckets(
        self,
        routes: WeightRoutes,
        stream: Iterator[tuple[str, torch.Tensor]],
        version: int,
        targets: list[str],
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
                    with timed(m, "update_s"):
                        await each(
                            targets,
                            f"update_weights (bucket {item.info['index']}, "
                            f"{item.file.nbytes} bytes)",
                            lambda url, info=item.info: routes.post(
                                url, "/update_weights", {"update_info": self._for(url, info)}
                            ),
                        )
                    m["bytes"] += item.file.nbytes
                    m["http_servers"] = float(len(self.remote.keys() & set(targets)))
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
        served = self._bucket_servers[self.remote[url]]  # init() or resend() started it
        return {**info, "path": "", "url": served.url_of(info["path"])}

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
                mark_last(iter_buckets(stream, self.bucket_bytes))
            ):
                buffers.acquire()
                with timed(m, "gather_s"):
                    gathered = [(name, full_cpu(tensor)) for name, tensor in bucket]
                if error is not None or failed.is_set():
                    buffers.release()
                else:
                    try:
                        with timed(m, "write_s"):
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
                    with timed(m, "keep_s"):
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

    # -- a restarted server, the end -----------------------------------------------------------

    def resend(self, url: str) -> tuple[int, Callable[[], dict[str, float]]]:
        """Called by ``WeightSync.rejoin`` for a restarted server (``url``, serving its start-up
        weights), or one joining the run, before it is paused: initialise its transfer engine
        (again), and return the last pushed version with the send of the kept copy of that
        version, in full. A joiner on another host than this one's ``serve_host`` is served the
        buckets over HTTP from the address of this host that routes to it. Needs
        ``keep_served`` (or ``delta``)."""
        if self._base is None or self._base_key is None:
            raise WeightSyncError(
                f"{url}: a restarted server can be brought back only by the shm backend with a "
                f"kept copy of the served weights (backend 'shm', copy kept: "
                f"{self._base is not None}, holding a whole version: {self._base_key is not None}; "
                "a push that failed leaves it holding none until the next one succeeds)"
            )
        base, key = self._base, self._base_key
        if url not in self.remote and not same_host(url, None, "", self.serve_host):
            self._serve(url)  # a joiner on another host
        asyncio.run(self._init_engines([url]))

        def send() -> dict[str, float]:
            m, end = asyncio.run(self._send(iter(base.items()), key[0], [url], False, keep=False))
            if (key[0], end.weights_checksum) != self._base_key:
                raise WeightSyncError(f"{url}: the kept copy of version {key[0]} changed")
            self.held[url] = self._base_key
            return m

        return key[0], send

    def close(self) -> None:
        """Called once, at the end of the run: stop serving buckets to other hosts, delete the
        bucket files."""
        self._remove_files()
        for served in self._bucket_servers.values():
            served.close()
        self._bucket_servers.clear()


class _DeltaRefused(Exception):
    """A delta was refused for its base; carries the new weights, all gathered, for a resend."""

    def __init__(self, error: BaseException, new_state: dict[str, torch.Tensor] | None) -> None:
        super().__init__(str(error))
        self.error, self.new_state = error, new_state


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


class BucketServer:
    """Serves this sender's bucket files (``GET /<file name>``, names with ``prefix`` only) to
    servers on other hosts, from a thread: the cross-host transport of the shm backend. A server
    fetches the same checksummed bytes a local one reads from the file, during its
    ``/update_weights`` call, so a file is deleted only after every server has it. The names
    carry a random part; the address is this host's on the route to the servers it serves."""

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
