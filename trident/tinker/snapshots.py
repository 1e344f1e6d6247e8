"""A model's snapshots: ``<model dir>/snapshots/seq_<k>/`` is the trainer's ``save_state``
(weights, Adam moments, RNG) after every request up to seq ``k`` ran, with a manifest
``{"model_id", "last_seq", "optim_steps", "origin"}`` written last. The origin (base model,
base path, LoRA shape) rebuilds the trainer the state is loaded into, so a restored model needs
nothing its first request named (saved weights it started from may be deleted once a snapshot
exists).

A snapshot is taken only right after an ``optim_step``, when no gradient is accumulated, so the
trainer's saved state is all there is. Each snapshot has a new name, so the rename that makes it
visible is one atomic step with no window in which none exists (``train/atomic.py``); restore
picks the newest complete one, and the two newest are kept (the older one is the fallback if the
newest turns out unreadable). Written durably: a power loss between the result store and the
manifest would otherwise commit a snapshot whose files are not on disk.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

from trident.train.atomic import is_complete, read_manifest, write_dir

KEEP = 2
_NAME = re.compile(r"seq_(\d+)")


class Snapshots:
    """The snapshots of one model, in ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def newest(self) -> tuple[Path, dict[str, Any]] | None:
        """The newest complete snapshot and its manifest, or None."""
        found = self._complete()
        return (found[-1], read_manifest(found[-1])) if found else None

    async def commit(
        self, trainer: Any, model_id: str, last_seq: int, optim_steps: int, origin: dict
    ) -> Path:
        """Write ``seq_<last_seq>`` from ``trainer`` (a ``Trainer``), then prune."""

        async def fill(tmp: Path) -> None:
            await trainer.save_state(str(tmp / "trainer"))

        manifest = {
            "model_id": model_id,
            "last_seq": last_seq,
            "optim_steps": optim_steps,
            "origin": origin,
        }
        self.root.mkdir(parents=True, exist_ok=True)
        path = await write_dir(self.root / f"seq_{last_seq}", fill, manifest, durable=True)
        for old in self._complete()[:-KEEP]:
            shutil.rmtree(old, ignore_errors=True)
        return path

    def _complete(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        found = [(int(m[1]), p) for p in self.root.iterdir() if (m := _NAME.fullmatch(p.name))]
        return [p for _, p in sorted(found) if is_complete(p)]
