"""Processes: their share of this host's cores, and not outliving the one that started them
(cheap to import: vLLM's processes import it through trident's plugin)."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Imports (or other start-up work) without the garbage collector's passes; what they built
    is then frozen (later passes skip it) and the collector is back on. Importing torch,
    transformers and vLLM builds millions of objects, and the full passes during it walk all of
    them again and again: vLLM's API server imports in 6.1 s instead of 8.0 s (2 cores). The
    price: garbage made in cycles meanwhile stays in memory (a few MB) until the process exits,
    where the heap is unfrozen so that the interpreter's last collection finds it (else
    nanobind's modules report every object of theirs still alive as a leak on stderr)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        atexit.unregister(gc.unfreeze)  # once per process
        atexit.register(gc.unfreeze)
        if enabled:
            gc.enable()


def die_with_parent(
    sig: int = signal.SIGTERM, parent: int | None = None, kill_after_s: float | None = None
) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent dies (``PR_SET_PDEATHSIG``;
    Linux only, a no-op elsewhere). SIGTERM by default, so the process can stop its own children
    on the way out.

    ``parent``: the pid that started this process, when the caller knows it. The kernel sends
    nothing for a parent that died before the request (a window at every start: the process
    is then an orphan already), so if ``parent`` is no longer this process's parent, ``sig``
    comes at once.

    ``kill_after_s`` (with ``parent``): a process whose shutdown on ``sig`` can hang (a vLLM API
    server caught mid-start) is killed that long after its parent died, by a daemon thread
    that watches the parent (not called before ``exec``: threads do not survive it)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
        if kill_after_s is not None and parent is not None:
            threading.Thread(
                target=_kill_after_orphaned, args=(parent, kill_after_s), daemon=True
            ).start()
        if parent is not None and os.getppid() != parent:
            os.kill(os.getpid(), sig)


def _kill_after_orphaned(parent: int, grace_s: float) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    time.sleep(grace_s)
    os.kill(os.getpid(), signal.SIGKILL)


def cores_each(sharing: int) -> int:
    """This host's cores (those this process may run on) split among ``sharing`` processes
    computing at once; at least one."""
    return max(1, len(os.sched_getaffinity(0)) // max(1, sharing))
