"""Processes: their share of this host's cores, their allocator, and not outliving the one that
started them (cheap to import: vLLM's processes import it through trident's plugin)."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import importlib.util
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

# Freed pages stay with the process for its next allocation instead of going back to the system
JEMALLOC_CONF = "dirty_decay_ms:-1,muzzy_decay_ms:-1"
JEMALLOC_BELOW_BYTES = 400_000_000  # the weights of 100 M parameters in float32


def jemalloc_env(model_path: str) -> dict[str, str]:
    """The environment that gives a process started with it jemalloc (the build Ray ships), set
    to keep the pages it frees: for a trainer rank or a vLLM server on a CPU, of a model whose
    weight files are under ``JEMALLOC_BELOW_BYTES``. glibc's malloc maps every block over 32 MiB
    afresh and unmaps it when freed, so each step's activations and logits fault in their pages
    again: ~74,000 page faults a second in a rank's training, none after the first steps with
    this. At the compute recipe's shape (2 cores, bfloat16, median of 5 steps, 4 runs
    interleaved) the step took 3.5-4.0 s against 4.1-4.9 s (train stage 2.2-2.5 s against
    2.7-3.2 s). The price is memory: a process stays at its peak (jemalloc's finite decay times
    gave the faults back). A larger model's step is compute-bound and its memory is what binds on
    a CPU host: Qwen2.5-0.5B's full fine-tuning, at 91% of a 24 GiB host with glibc, ran out of
    memory with this. Empty for those, where Ray ships no jemalloc (macOS), or where the user
    preloads a library already."""
    spec = importlib.util.find_spec("ray")
    if spec is None or not spec.submodule_search_locations or "LD_PRELOAD" in os.environ:
        return {}
    lib = os.path.join(spec.submodule_search_locations[0], "core", "libjemalloc.so")
    weights = [
        os.path.join(model_path, f)
        for f in (os.listdir(model_path) if os.path.isdir(model_path) else [])
        if f.endswith((".safetensors", ".bin"))
    ]
    size = sum(os.path.getsize(f) for f in weights)
    if not os.path.isfile(lib) or not weights or size >= JEMALLOC_BELOW_BYTES:
        return {}
    return {"LD_PRELOAD": lib, "MALLOC_CONF": os.environ.get("MALLOC_CONF", JEMALLOC_CONF)}


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
