"""Bubblewrap processes from the host's side: the thread that starts them, and each one started.

``stage_spawner_thread`` sets up a spawner thread of a root host (its own mount namespace, the
sandbox uid); ``BwrapProcess`` wraps one started bwrap and observes it through pidfds (no asyncio
child watcher, no thread per process) until a complete ``stop``; ``CappedReader`` drains one of
its output pipes within a cap. ``trident.sandbox.bwrap`` builds the command lines and starts them.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import json
import os
import signal
import subprocess

# Linux constants (not all exposed by the os module on 3.11).
_CLONE_NEWNS = 0x00020000
_MS_BIND = 0x1000
_MS_REC = 0x4000
_MS_PRIVATE = 1 << 18
# Raw syscall numbers of the per-thread credential calls: (setgroups, setresgid, setresuid).
CRED_SYSCALLS = {"x86_64": (116, 119, 117), "aarch64": (159, 149, 147)}


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def stage_spawner_thread(
    python_prefix: str, stage: str, uid: int, cred_syscalls: tuple[int, int, int] | None
) -> None:
    """Called once on each new spawner thread of a root host, before it starts any bwrap (see
    ``trident.sandbox.bwrap``): unshare this thread's mount namespace, bind-mount
    ``python_prefix`` onto ``stage`` in it, then drop this thread's credentials to ``uid`` (when
    ``cred_syscalls`` is known; ``setpriv`` does it per run otherwise). Raises ``OSError`` or
    ``RuntimeError`` when a step fails."""
    libc = _libc()
    # CLONE_NEWNS implies CLONE_FS: this thread gets its own root/cwd and mount table.
    if libc.unshare(_CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS) on the spawner thread")
    if libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        raise OSError(ctypes.get_errno(), "mount --make-rprivate /")
    if libc.mount(python_prefix.encode(), stage.encode(), None, _MS_BIND | _MS_REC, None) != 0:
        raise OSError(ctypes.get_errno(), "bind-mount the Python prefix")
    if cred_syscalls is not None:
        ids = (ctypes.c_long(uid),) * 3  # syscall(2) is variadic: pass full words
        nr_setgroups, nr_setresgid, nr_setresuid = cred_syscalls
        for nr, args in (
            (nr_setgroups, (ctypes.c_long(0), ctypes.c_void_p(None))),
            (nr_setresgid, ids),
            (nr_setresuid, ids),
        ):
            if libc.syscall(ctypes.c_long(nr), *args) != 0:
                raise OSError(ctypes.get_errno(), "drop the spawner thread's credentials")
        # getres[ug]id/getgroups are plain syscalls: they report this thread's credentials.
        if os.getresuid() != (uid,) * 3 or os.getresgid() != (uid,) * 3 or os.getgroups():
            raise RuntimeError("the spawner thread did not drop to the sandbox uid")


class CappedReader:
    """Drains one pipe to EOF, keeping the first ``cap`` bytes (host memory stays bounded)."""

    def __init__(self, stream: asyncio.StreamReader, cap: int) -> None:
        self.chunks: list[bytes] = []
        self.kept = 0
        self.truncated = False
        self._stream = stream
        self._cap = cap

    async def drain(self) -> None:
        while chunk := await self._stream.read(65536):
            room = self._cap - self.kept
            if len(chunk) > room:
                self.truncated = True
                chunk = chunk[:room]
            if chunk:
                self.chunks.append(chunk)
                self.kept += len(chunk)

    def text(self) -> str:
        return b"".join(self.chunks).decode("utf-8", errors="replace")


async def feed_stdin(writer: asyncio.StreamWriter, data: bytes) -> None:
    """Write ``data`` to a sandbox's stdin and close it (a sandbox that stopped reading is fine)."""
    with contextlib.suppress(ConnectionError, BrokenPipeError):
        if data:
            writer.write(data)
            await writer.drain()
        writer.close()


def close_fds(fds: tuple[int, ...]) -> None:
    """Close every fd in ``fds``."""
    for fd in fds:
        os.close(fd)


def pidfd_open(pid: int) -> int | None:
    """A pidfd pinning ``pid``, or None when it has already exited."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return None


class BwrapProcess:
    """One started bwrap: its pipes, its ``--json-status-fd`` records, and a complete stop.

    bwrap writes ``{"child-pid": N}`` right after cloning the sandbox's first process (the init of
    its pid namespace) and ``{"exit-code": N}`` only if the command was exec'd. The init is pinned
    with a pidfd as soon as it is named, and ``stop`` SIGKILLs it (then bwrap): when a pid
    namespace's init dies the kernel kills everything in it. Killing bwrap alone is not enough
    while the sandbox is being built - bwrap arms ``--die-with-parent`` in the init only after the
    mounts, so a bwrap killed earlier would orphan a half-built sandbox. bwrap's exit is observed
    through a pidfd, and it is reaped here (no asyncio child watcher, no thread per process).
    """

    def __init__(self, proc: subprocess.Popen, status_r: int) -> None:
        self.proc = proc
        self.exit_code: int | None = None
        self.stdin: asyncio.StreamWriter
        self.stdout: asyncio.StreamReader
        self.stderr: asyncio.StreamReader
        self._transports: list[asyncio.BaseTransport] = []
        self._loop = asyncio.get_running_loop()
        self._status_r: int | None = status_r
        self._buf = b""
        self._init_pidfd: int | None = None
        self._named = asyncio.Event()  # the init's pid is known, or bwrap is gone
        self._exited: asyncio.Future[None] = self._loop.create_future()
        os.set_blocking(status_r, False)
        self._loop.add_reader(status_r, self._read_status)
        self._bwrap_pidfd = pidfd_open(proc.pid)
        if self._bwrap_pidfd is None:
            self._on_exit()
        else:
            self._loop.add_reader(self._bwrap_pidfd, self._on_exit)

    @classmethod
    async def attach(cls, proc: subprocess.Popen, status_r: int, limit: int) -> BwrapProcess:
        """Wrap a started bwrap and connect its pipes to this event loop."""
        self = cls(proc, status_r)
        loop = self._loop
        assert proc.stdin and proc.stdout and proc.stderr
        try:
            streams = []
            for pipe in (proc.stdout, proc.stderr):
                reader = asyncio.StreamReader(limit=limit)
                transport, _ = await loop.connect_read_pipe(
                    lambda r=reader: asyncio.StreamReaderProtocol(r), pipe
                )
                self._transports.append(transport)
                streams.append(reader)
            self.stdout, self.stderr = streams
            transport, protocol = await loop.connect_write_pipe(
                lambda: asyncio.StreamReaderProtocol(asyncio.StreamReader()), proc.stdin
            )
            self._transports.append(transport)
            self.stdin = asyncio.StreamWriter(transport, protocol, None, loop)
        except BaseException:
            proc.stdin.close()
            await asyncio.shield(self.stop(0.0, 1.0))
            self.close_pipes()
            raise
        return self

    @property
    def running(self) -> bool:
        return not self._exited.done()

    def _on_exit(self) -> None:
        if self._bwrap_pidfd is not None:
            self._loop.remove_reader(self._bwrap_pidfd)
        self._read_status()  # bwrap wrote its records before exiting
        self.proc.poll()  # reap it
        if not self._exited.done():
            self._exited.set_result(None)
        self._named.set()

    def _read_status(self) -> None:
        while self._status_r is not None:
            try:
                chunk = os.read(self._status_r, 65536)
            except BlockingIOError:
                return
            if not chunk:  # every writer is gone
                self._close_status()
                self._named.set()
                return
            *lines, self._buf = (self._buf + chunk).split(b"\n")
            for line in lines:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if "child-pid" in record and self._init_pidfd is None and self.running:
                    self._init_pidfd = pidfd_open(int(record["child-pid"]))
                    self._named.set()
                if "exit-code" in record:
                    self.exit_code = int(record["exit-code"])

    def _close_status(self) -> None:
        if self._status_r is not None:
            self._loop.remove_reader(self._status_r)
            os.close(self._status_r)
            self._status_r = None

    async def wait(self, timeout_s: float | None) -> bool:
        """Wait for bwrap to exit (the command ended, or the sandbox died); False on timeout."""
        try:
            await asyncio.wait_for(asyncio.shield(self._exited), timeout_s)
        except TimeoutError:
            return False
        return True

    async def stop(self, setup_timeout_s: float, grace_s: float) -> None:
        """Kill the sandbox and everything in it, reap bwrap, release every fd. Idempotent."""
        if self.running and not self._named.is_set():
            # Being built: wait until the init is named (or bwrap gives up) before killing.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._named.wait(), setup_timeout_s)
        if self._init_pidfd is not None:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self._init_pidfd, signal.SIGKILL)
            await self.wait(grace_s)  # bwrap reaps its init and exits: no orphaned zombie
        if self.running:
            self.proc.kill()  # Popen checks that it has not been reaped (no pid reuse)
            await self.wait(grace_s)
        self._close_status()
        for fd in (self._init_pidfd, self._bwrap_pidfd):
            if fd is not None:
                os.close(fd)
        self._init_pidfd = self._bwrap_pidfd = None
        if hasattr(self, "stdin"):
            self.stdin.close()

    def close_pipes(self) -> None:
        """Close our ends of stdin/stdout/stderr (after ``stop`` and after reading them)."""
        for transport in self._transports:
            transport.close()
