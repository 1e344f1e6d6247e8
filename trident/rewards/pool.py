"""Worker processes for checks that may hang: ``await CHECKERS.run(fn, *args, timeout_s=...)``.

A symbolic checker (math-verify's sympy, a reasoning-gym ``score_answer``) can run for minutes on a
pathological answer, in C code that no signal interrupts. Its library timeouts use
``signal.alarm``, which works only on the main thread, and rewards run off it (on the event
loop, in worker threads). So the bound is a process: each call runs in one of up to ``size``
long-lived worker processes (fresh interpreters, ``python -c``, not forks of the driver, which
holds threads, Ray and CUDA state; and unlike multiprocessing's spawn they do not re-run the
caller's ``__main__``),
and a call that overruns its timeout, or is cancelled (``asyncio.wait_for`` around the reward),
kills its worker; the next call starts a fresh one. A worker that dies mid-call, or an
exception raised by ``fn``, surfaces as ``CheckerError``. Either way the caller
(``trident.rewards.call_reward``) scores the sample ``infra_error``, never 0.

``fn`` and its arguments must be picklable (a module-level function). Waiting for the answer
uses the running loop's ``add_reader`` on the worker's pipe, so any number of event loops and
threads can share one pool; nothing blocks a loop except a short, bounded pipe write.

Deliberate simplifications: the pool grows to ``size`` on demand and never shrinks; a caller
waiting for a free worker polls every 10 ms.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

STARTUP_S = 60.0  # a fresh worker's first call: interpreter start and the checker's imports


class CheckerError(RuntimeError):
    """A check could not run to completion: it timed out, raised, or its process died."""


def serve(fd: int) -> None:
    """The worker's loop on socket ``fd``: ``(fn, args)`` in, ``("ok", value)`` or
    ``("error", text)`` out, until the parent closes its end."""
    conn = Connection(fd)
    while True:
        try:
            fn, args = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        try:
            reply = ("ok", fn(*args))
        except BaseException as e:  # reported, not raised: the worker stays usable
            reply = ("error", f"{type(e).__name__}: {e}")
        conn.send(reply)


class _Worker:
    def __init__(self) -> None:
        parent, child = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        code = "import sys; from trident.rewards.pool import serve; serve(int(sys.argv[1]))"
        self.process = subprocess.Popen(
            [sys.executable, "-c", code, str(child.fileno())],
            pass_fds=(child.fileno(),),
            env=env,
            stdin=subprocess.DEVNULL,
        )
        child.close()
        self.conn = Connection(parent.detach())
        self.warm = False  # has answered a call (its interpreter and imports are up)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(timeout=5)
        self.conn.close()


async def _readable(conn: Connection) -> None:
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    fd = conn.fileno()
    loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_reader(fd)


class CheckerPool:
    """Up to ``size`` worker processes (default: the usable cores, at most 8)."""

    def __init__(self, size: int | None = None) -> None:
        self.size = size or min(len(os.sched_getaffinity(0)), 8)
        self._idle: list[_Worker] = []
        self._busy = 0
        self._lock = threading.Lock()

    def _acquire(self) -> _Worker | None:
        with self._lock:
            if self._idle:
                self._busy += 1
                return self._idle.pop()
            if self._busy < self.size:
                self._busy += 1
                return _Worker()
        return None

    def _release(self, worker: _Worker, healthy: bool) -> None:
        with self._lock:
            self._busy -= 1
            if healthy:
                self._idle.append(worker)
        if not healthy:
            worker.kill()

    async def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> Any:
        """``fn(*args)`` in a worker process; ``CheckerError`` if it does not return a value
        within ``timeout_s`` (None: no bound of its own, the caller's cancellation still kills).
        A fresh worker's first call gets ``STARTUP_S`` more: it starts an interpreter and
        imports the checker (seconds, on a loaded machine), which is not the check's work."""
        while (worker := self._acquire()) is None:
            await asyncio.sleep(0.01)
        healthy = False
        bound = timeout_s if timeout_s is None or worker.warm else timeout_s + STARTUP_S
        try:
            # A large argument fills the pipe until a just-spawned worker starts reading: send
            # from a thread so the loop is never blocked on it.
            await asyncio.to_thread(worker.conn.send, (fn, args))
            await asyncio.wait_for(_readable(worker.conn), bound)
            status, value = worker.conn.recv()
            healthy = worker.warm = True
        except TimeoutError:
            raise CheckerError(
                f"{getattr(fn, '__name__', fn)} did not finish in {bound} s (killed)"
            ) from None
        except (EOFError, OSError) as e:
            raise CheckerError(
                f"the checker process running {getattr(fn, '__name__', fn)} died "
                f"(exit code {worker.process.poll()})"
            ) from e
        finally:
            self._release(worker, healthy)
        if status == "error":
            raise CheckerError(f"{getattr(fn, '__name__', fn)} raised {value}")
        return value

    def close(self) -> None:
        """Kill the idle workers (busy ones are killed by their callers' cancellation)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.kill()


# The process-wide pool every checking reward shares (``math``, ``reasoning_gym``): one set of
# cores, one set of processes. A worker ends when the driver does (its socket closes).
CHECKERS = CheckerPool()
