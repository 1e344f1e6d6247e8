"""The training service's durable memory: the journal of what clients asked, and the store of
what they were answered (issue #51's exactly-once rules).

**Journal** (``<state_dir>/journal.log``, append only). One record per training request, written
and fsynced before its POST is acknowledged, so an acknowledged request survives any crash:
its request id ``f"{model_id}#{seq_id}"`` (deterministic, so it means the same after a restart;
a model's first request, ``create_model`` or create-via-``load_weights``, is seq 0 of
``model_id = f"{session_id}:train:{model_seq_id}"``, the SDK's own derivation), kind, model,
seq, the sha256 of the raw body, and the body itself. Sessions, their end, sampling sessions,
and requests failed without running (a seq gap that never filled, ``scheduler``) are records
too. Dedup: the same request id with the same digest is the same request (the SDK retries with
fresh idempotency headers, so ``(model_id, seq_id)`` is the only key); with another digest it
is a ``RequestConflict``.

One process owns a state directory: the journal is locked while open (a second service on it,
say a restart racing the old process's exit, fails at once instead of applying twice).

Framing: ``magic | header length | body length | crc32(header + body) | header (JSON) | body``.
A crash mid-append leaves a short or corrupt last record; opening the journal finds the first
record that does not check out and cuts the file there (it was never acknowledged).

**Results** (``<state_dir>/results/``): one file per request id, written whole (temp file, fsync,
rename) when the request has run. Rule 4: a result is stored before the snapshot that includes
its effects commits, since replay starts after that snapshot and would never write it again (the
client would poll "not yet" forever). The first result stored for an id is kept: a replay after
a crash does not replace what a client may already have read.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trident.train.atomic import write_file

MAGIC = b"TKJ1"
_FRAME = struct.Struct("<4sIII")  # magic, header length, body length, crc32

CREATE_KINDS = ("create_model", "load_weights")  # a model's seq-0 request may be either


class RequestConflict(Exception):
    """A request id seen before, with another payload (HTTP 400: never a retryable 409)."""


def request_id(model_id: str, seq_id: int) -> str:
    return f"{model_id}#{seq_id}"


def model_id_of(session_id: str, model_seq_id: int) -> str:
    """The SDK's own naming of a created model (``service_client.py``)."""
    return f"{session_id}:train:{model_seq_id}"


@dataclass(frozen=True)
class Result:
    """What ``retrieve_future`` answers. ``kind`` "json": ``payload`` a dict;
    "forward_backward": ``(outputs, metrics)``; "error": ``{"error", "category"}``."""

    kind: str
    payload: Any


def error(message: str, category: str = "user") -> Result:
    return Result("error", {"error": message, "category": category})


@dataclass(frozen=True)
class OpRecord:
    """A journaled training request; its body stays on disk until replay reads it."""

    request_id: str
    kind: str
    model_id: str
    seq_id: int
    digest: str
    offset: int  # of the body in the journal file
    length: int


class Journal:
    """The append-only journal (module docstring) and the indexes read from it on open."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.ops: dict[str, OpRecord] = {}
        self.skipped: set[str] = set()  # ops failed without running (scheduler's gap timeout)
        self.sessions: dict[str, bool] = {}  # session id -> finished
        self._samplers: dict[str, tuple[int, int]] = {}  # sampling session -> its body's place
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
        self._scan()
        self._file = open(path, "ab")  # noqa: SIM115 (held open for the service's life)
        try:  # a POSIX lock: the kernel drops it with the process, however it dies
            fcntl.lockf(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._file.close()
            raise RuntimeError(
                f"{path} is in use by another process: one service per state directory"
            ) from None
        self._reader = open(path, "rb")  # noqa: SIM115

    def record_op(self, kind: str, model_id: str, seq_id: int, body: bytes) -> tuple[str, bool]:
        """Journal a training request unless it is a repeat: (its request id, whether new).
        Raises ``RequestConflict`` for a known id with another body."""
        rid = request_id(model_id, seq_id)
        digest = hashlib.sha256(body).hexdigest()
        known = self.ops.get(rid)
        if known is not None:
            if known.digest != digest:
                raise RequestConflict(
                    f"request {rid} ({known.kind}) was already sent with another payload"
                )
            return rid, False
        header = {"t": "op", "id": rid, "kind": kind, "model": model_id, "seq": seq_id}
        offset = self._append(header | {"digest": digest}, body)
        self.ops[rid] = OpRecord(rid, kind, model_id, seq_id, digest, offset, len(body))
        return rid, True

    def record_skip(self, rid: str) -> None:
        self._append({"t": "skip", "id": rid}, b"")
        self.skipped.add(rid)

    def record_session(self, session_id: str, body: bytes) -> None:
        self._append({"t": "session", "id": session_id}, body)
        self.sessions[session_id] = False

    def record_session_end(self, session_id: str) -> None:
        self._append({"t": "session_end", "id": session_id}, b"")
        self.sessions[session_id] = True

    def record_sampler(self, sampler_id: str, body: bytes) -> None:
        """A sampling session, so its id means the same after a restart."""
        offset = self._append({"t": "sampler", "id": sampler_id}, body)
        self._samplers[sampler_id] = (offset, len(body))

    def samplers(self) -> dict[str, bytes]:
        """Every journaled sampling session's body, by id."""
        return {s: os.pread(self._reader.fileno(), n, at) for s, (at, n) in self._samplers.items()}

    def body(self, rid: str) -> bytes:
        op = self.ops[rid]
        return os.pread(self._reader.fileno(), op.length, op.offset)

    def close(self) -> None:
        self._file.close()
        self._reader.close()

    def _append(self, header: dict[str, Any], body: bytes) -> int:
        """Write one record and fsync it; returns the offset of its body."""
        head = json.dumps(header).encode()
        crc = _crc(head, body)
        start = self._file.tell()
        self._file.write(_FRAME.pack(MAGIC, len(head), len(body), crc) + head + body)
        self._file.flush()
        os.fsync(self._file.fileno())
        return start + _FRAME.size + len(head)

    def _scan(self) -> None:
        """Read every complete record into the indexes; cut a torn tail off the file."""
        data = self.path.read_bytes()
        pos = 0
        while pos < len(data):
            record = _parse(data, pos)
            if record is None:
                break
            header, body_at, end = record
            self._index(header, body_at, end - body_at)
            pos = end
        if pos < len(data):
            print(
                f"tinker journal {self.path}: dropped a torn last record "
                f"({len(data) - pos} bytes at offset {pos}, never acknowledged)",
                file=sys.stderr,
                flush=True,
            )
            with open(self.path, "r+b") as f:
                f.truncate(pos)
                os.fsync(f.fileno())

    def _index(self, header: dict[str, Any], body_at: int, length: int) -> None:
        kind = header["t"]
        if kind == "op":
            rid = header["id"]
            self.ops[rid] = OpRecord(
                rid, header["kind"], header["model"], header["seq"], header["digest"],
                body_at, length,
            )  # fmt: skip
        elif kind == "skip":
            self.skipped.add(header["id"])
        elif kind == "session":
            self.sessions[header["id"]] = False
        elif kind == "session_end":
            self.sessions[header["id"]] = True
        elif kind == "sampler":
            self._samplers[header["id"]] = (body_at, length)


def _crc(head: bytes, body: bytes) -> int:
    import zlib

    return zlib.crc32(body, zlib.crc32(head))


def _parse(data: bytes, pos: int) -> tuple[dict[str, Any], int, int] | None:
    """The record at ``pos`` as (header, body offset, end), or None if torn or corrupt."""
    if pos + _FRAME.size > len(data):
        return None
    magic, head_len, body_len, crc = _FRAME.unpack_from(data, pos)
    head_at = pos + _FRAME.size
    end = head_at + head_len + body_len
    if magic != MAGIC or end > len(data):
        return None
    head, body = data[head_at : head_at + head_len], data[head_at + head_len : end]
    if _crc(head, body) != crc:
        return None
    return json.loads(head), head_at + head_len, end


class ResultStore:
    """Results by request id, one durable file each (module docstring)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def put(self, rid: str, result: Result) -> bool:
        """Store ``result`` under ``rid`` unless one is stored already; whether it was."""
        path = self._path(rid)
        if path.exists():
            return False
        buf = io.BytesIO()
        torch.save({"kind": result.kind, "payload": result.payload}, buf)
        write_file(path, buf.getvalue())
        return True

    def has(self, rid: str) -> bool:
        return self._path(rid).exists()

    def get(self, rid: str) -> Result | None:
        path = self._path(rid)
        if not path.exists():
            return None
        stored = torch.load(path, weights_only=True)
        return Result(stored["kind"], stored["payload"])

    def _path(self, rid: str) -> Path:
        # ids hold client-chosen session ids: hashed, never used as a path
        return self.root / f"{hashlib.sha256(rid.encode()).hexdigest()[:40]}.pt"
