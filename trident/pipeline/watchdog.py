"""The hang watchdog: a run that makes no step progress for ``run.hang_timeout_s`` is stopped
with an explanation instead of waiting forever.

Progress is a step logged (or the start, or the evals around the steps finishing). When none
comes for the timeout, the watchdog writes every process's Python stacks to
``runs/<name>/hang-<time>/`` (the driver's threads and asyncio tasks with ``faulthandler``;
the trainer ranks and vLLM servers with ``py-spy dump``, which reads a process stuck in a
collective or a kernel as well as any other; a stopped process, whose stacks py-spy cannot read,
is named as stopped at the top of its dump) and fails the run with one line naming the stage
that stopped: the longest-open span of the run's trace (``train`` on the trainer, ``generate``
on a server, ``reward``, ...), how long it has been open, and any process found stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import io
import shutil
import subprocess
import sys
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

from trident.pipeline.checkpoint import new_dir
from trident.telemetry.trace import Trace

T = TypeVar("T")


class HangError(RuntimeError):
    """No step progress for ``run.hang_timeout_s``; the message names the stage and the dump."""


class Watchdog:
    def __init__(
        self, timeout_s: float, run_dir: Path, trace: Trace, pids: dict[str, int] | None = None
    ) -> None:
        self.timeout_s, self.run_dir, self.trace = timeout_s, run_dir, trace
        self.pids = pids or {}
        self.last = time.monotonic()

    def beat(self) -> None:
        """Called on progress (a step logged, the start, an eval done)."""
        self.last = time.monotonic()

    async def guard(self, work: Awaitable[T]) -> T:
        """Run ``work``; if no progress comes for the timeout, dump the stacks, cancel it and
        raise ``HangError``. A timeout of 0 turns the watchdog off."""
        task = asyncio.ensure_future(work)
        if self.timeout_s <= 0:
            return await task
        watch = asyncio.create_task(self._watch())
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            watch.cancel()
        if watch.done() and not watch.cancelled() and watch.exception() is not None:
            raise watch.exception()  # type: ignore[misc]
        return task.result()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(min(5.0, self.timeout_s / 4))
            idle = time.monotonic() - self.last
            if idle > self.timeout_s:
                where = self.dump()
                stage = self.trace.oldest_running()
                what = (
                    f"stage '{stage[0]}' on {stage[1]} open for {stage[2]:.0f} s"
                    if stage
                    else "no stage running"
                )
                raise HangError(
                    f"no step progress for {idle:.0f} s (run.hang_timeout_s={self.timeout_s:g}): "
                    f"{what}{self.stopped()}; every process's stacks are in {where}"
                )

    def stopped(self) -> str:
        """ "; stopped: ..." naming each watched process (or descendant) in state T, or ""."""
        named = [
            f"{name}'s process {pid} ({comm})"
            for name, root in self.pids.items()
            for pid, comm in stopped_processes(root)
        ]
        return f"; stopped (SIGSTOP, state T): {', '.join(named)}" if named else ""

    def dump(self) -> Path:
        """Every process's stacks into ``hang-<time>/``; returns the directory."""
        # a dump never replaces another's (two in one second, an earlier attempt's)
        out = new_dir(self.run_dir / f"hang-{time.strftime('%Y%m%d-%H%M%S')}")
        with (out / "driver.txt").open("w") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
            f.write("\n# asyncio tasks\n")
            for task in asyncio.all_tasks():
                text = io.StringIO()
                task.print_stack(file=text)
                f.write(f"\n{task!r}\n{text.getvalue()}")
        py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        for name, pid in self.pids.items():
            head = f"# {name} (pid {pid})\n"
            # py-spy reads no stack of a stopped process ("Failed to get stack traces"): say so
            stopped = stopped_processes(pid)
            for child, comm in stopped:
                head += f"# process {child} ({comm}) is stopped (state T in /proc/{child}/stat)\n"
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                r = subprocess.run(
                    [py_spy, "dump", "--subprocesses", "--pid", str(pid)],
                    capture_output=True,
                    text=True,
                    timeout=30,
                )
                error = r.stderr
                if stopped and r.returncode:  # py-spy fails at the stopped process
                    error = "# no stack of a stopped process: py-spy cannot read one\n"
                head += r.stdout + error
            (out / f"{name}.txt").write_text(head)
        return out


def stopped_processes(root: int) -> list[tuple[int, str]]:
    """(pid, command name) of ``root`` and each of its descendants in state T (stopped, e.g. by
    SIGSTOP, or t: stopped by a tracer), from ``/proc/PID/stat``."""
    procs: dict[int, tuple[int, str, str]] = {}  # pid -> (parent, state, comm)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            text = stat.read_text()
            comm = text[text.index("(") + 1 : text.rindex(")")]
            state, ppid = text[text.rindex(")") + 2 :].split()[:2]
            procs[int(stat.parent.name)] = (int(ppid), state, comm)
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, _, _) in procs.items():
            if ppid == parent and pid not in tree:
                tree.add(pid)
                frontier.append(pid)
    return sorted((pid, procs[pid][2]) for pid in tree if pid in procs and procs[pid][1] in "Tt")
