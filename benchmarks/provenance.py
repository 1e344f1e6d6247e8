"""Where and when a benchmark's figures were measured: commit, date, host, load.

Every results file records this, so that a figure quoted in ``docs/`` names the code and machine
it came from."""

from __future__ import annotations

import datetime
import hashlib
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str:
    out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=False)
    return out.stdout.strip()


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (the platform's name elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> list[float]:
    """``uptime``'s 1, 5 and 15 minute load averages, rounded."""
    return [round(x, 2) for x in os.getloadavg()]


def provenance(*files: Path) -> dict[str, Any]:
    """Commit (``+dirty`` when tracked files have changes; ``diff_sha1`` then names the change),
    UTC date, host, cores, load average, and the sha1 of each of ``files`` (the configs read)."""
    commit = _git("rev-parse", "--short", "HEAD")
    diff = _git("diff", "HEAD")
    return {
        "commit": commit + ("+dirty" if diff else ""),
        "diff_sha1": hashlib.sha1(diff.encode()).hexdigest() if diff else None,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "host": {"cpu": cpu_model(), "cores": os.cpu_count(), "kernel": platform.release()},
        "load_average": load_average(),
        "sha1": {
            str(f.resolve().relative_to(REPO)): hashlib.sha1(f.read_bytes()).hexdigest()
            for f in files
        },
    }
