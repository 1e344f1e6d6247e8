"""Directories and files that appear whole or not at all: trident's checkpoints (``pipeline/
checkpoint.py``) and the training service's snapshots, weights and results (``tinker/``).

A directory is filled under ``.tmp-<name>`` beside its final place, its ``manifest.json`` is
written last, and one rename makes it visible: a directory without a manifest (a writer killed
mid-way) is never read as complete. Renaming onto a name that does not exist yet (a snapshot
``seq_<k>``) is one atomic step; replacing an existing directory removes it first, so a reader
between the two steps sees none (callers that replace keep older complete ones beside it).

``durable=True`` also survives a power loss, not only a killed process: every file is fsynced
before the manifest, and the parent directory after the rename. A SIGKILL needs none of it (the
page cache outlives the process), so trident's own checkpoints leave it off.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"


def is_complete(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def read_manifest(path: Path) -> dict[str, Any]:
    return json.loads((path / MANIFEST).read_text())


async def write_dir(
    final: Path,
    fill: Callable[[Path], Awaitable[None]],
    manifest: dict[str, Any],
    durable: bool = False,
) -> Path:
    """Create directory ``final`` atomically (module docstring): ``fill(tmp)`` writes its
    contents, then ``manifest`` is written and the directory renamed into place."""
    tmp = final.parent / f".tmp-{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    await fill(tmp)
    if durable:  # gigabytes of a big model: off the event loop
        await asyncio.to_thread(_fsync_files, tmp)
    write_file(tmp / MANIFEST, (json.dumps(manifest) + "\n").encode(), durable=durable)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    if durable:
        _fsync(final.parent)
    return final


def write_file(path: Path, data: bytes, durable: bool = True) -> None:
    """Write ``path`` whole or not at all: a temporary file beside it, renamed over it."""
    tmp = path.with_name(f".tmp-{path.name}")
    with open(tmp, "wb") as f:
        f.write(data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        _fsync(path.parent)


def _fsync_files(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            _fsync(path)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
