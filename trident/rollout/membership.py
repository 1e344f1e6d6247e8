"""Servers joining and leaving a running job, through files in its run directory.

A server that joins (``trident rollout serve --join RUN_DIR``) writes ``fleet/<id>.join`` with its
url; the run's driver (``trident.pipeline.members.Membership``) finds it within a
second, brings the server to the served weight version (pushed and verified like every sync) and
only then routes to it, and answers ``fleet/<id>.joined`` (or ``.refused``, with the reason). A
server that leaves (SIGTERM to the joiner, or ``trident rollout leave URL RUN_DIR`` for any
server of the run) writes ``fleet/<id>.leave``; the driver stops sending it new requests, lets
the ones in flight finish, and answers ``fleet/<id>.left``; then the server may stop.

A directory, not a socket: the run directory is where a run is found already (``trident
report``, ``--resume``), a multi-node run shares it (``ray_cluster.check_shared``), and a driver
that restarts (``--resume``) finds the requests it has not answered. Each file is written whole
(to a temporary name, then renamed), so a reader never sees half of one.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ANSWERS = {"join": ("joined", "refused"), "leave": ("left",)}
CLOSED = "closed"  # written when the run ends


def fleet_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "fleet"


def _write(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


def ask(run_dir: str | Path, kind: str, url: str) -> Path:
    """Write a ``kind`` (``join`` or ``leave``) request for ``url``; returns its file."""
    directory = fleet_dir(run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{uuid.uuid4().hex[:12]}.{kind}"
    _write(path, {"url": url.rstrip("/"), "asked": time.time()})
    return path


def wait_answer(request: Path, timeout_s: float, poll_s: float = 0.2) -> tuple[str, dict]:
    """The driver's answer to ``request``: (its kind, e.g. ``joined``, and its payload); once the
    run has ended, ``refused`` for a join and ``left`` for a leave. Raises ``TimeoutError`` if
    none comes within ``timeout_s`` (no run is reading the directory)."""
    kind = request.suffix[1:]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for answer in ANSWERS[kind]:
            path = request.with_suffix(f".{answer}")
            if path.exists():
                return answer, json.loads(path.read_text())
        if (request.parent / CLOSED).exists():
            return ANSWERS[kind][-1], {"reason": "the run has ended", "seconds": 0.0}
        time.sleep(poll_s)
    raise TimeoutError(f"no answer to {request} within {timeout_s:.0f} s: is the run going?")


class JoinRefused(RuntimeError):
    """The run refused a joiner (``rollout.max_servers``, a failed sync) or has ended."""


def join(run_dir: str | Path, url: str, timeout_s: float) -> str:
    """Ask the run in ``run_dir`` to take the server at ``url`` and wait for it: the line saying
    so. Raises ``JoinRefused`` with the run's reason."""
    kind, answer = wait_answer(ask(run_dir, "join", url), timeout_s)
    if kind == "refused":
        raise JoinRefused(f"{run_dir} refused {url}: {answer['reason']}")
    version, seconds = answer["version"], answer["seconds"]
    return f"{url} joined {run_dir} at weight version {version} in {seconds:.1f} s"


def open_fleet(run_dir: str | Path) -> None:
    """The driver, as it starts reading requests (a resumed run: again)."""
    fleet_dir(run_dir).mkdir(parents=True, exist_ok=True)
    (fleet_dir(run_dir) / CLOSED).unlink(missing_ok=True)


def close_fleet(run_dir: str | Path) -> None:
    """The driver, as it ends: whoever waits for an answer stops waiting."""
    if fleet_dir(run_dir).is_dir():
        _write(fleet_dir(run_dir) / CLOSED, {"closed": time.time()})


def answer(request: Path, kind: str, **payload: Any) -> None:
    """The driver's answer to ``request`` (``joined``, ``refused`` or ``left``)."""
    _write(request.with_suffix(f".{kind}"), payload)


def pending(run_dir: str | Path) -> Iterator[tuple[str, str, Path]]:
    """The requests not answered yet, oldest first: (``join`` or ``leave``, url, file)."""
    directory = fleet_dir(run_dir)
    if not directory.is_dir():
        return
    requests = [p for p in directory.iterdir() if p.suffix in (".join", ".leave")]
    for path in sorted(requests, key=lambda p: p.stat().st_mtime):
        kind = path.suffix[1:]
        if any(path.with_suffix(f".{a}").exists() for a in ANSWERS[kind]):
            continue
        try:
            url = json.loads(path.read_text())["url"]
        except (OSError, ValueError, KeyError):
            continue  # written by something else: not ours to answer
        yield kind, url, path
