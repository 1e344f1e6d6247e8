"""Bubblewrap backend: how one sandbox is built, started, limited, killed and classified.

Owns the bwrap command line, the resource limits, the wall-clock kill, the output caps, the
status heuristics, and the host side of the in-sandbox agent that serves stateful sessions
(the agent itself is ``_agent_main.py``; the started process is ``bwrap_process.BwrapProcess``).

Isolation (one fresh set of namespaces per sandbox)::

    bwrap --unshare-all --unshare-user --uid 65534 --gid 65534 --die-with-parent --new-session
          --ro-bind /usr (+ /bin /lib* /sbin as on the host) --ro-bind <python prefix>
          --tmpfs <python prefix>/lib/pythonX.Y/site-packages       (stdlib only, fast start)
          --ro-bind a generated /etc (passwd, group; copies of alternatives, ld.so.cache,
          localtime)
          --proc /proc --dev /dev --tmpfs /tmp /sandbox /dev/shm (size-capped)
          --remount-ro / --remount-ro /dev --clearenv --setenv PATH/HOME/LANG/TMPDIR
          -- prlimit --as --cpu --nproc --fsize --nofile --core=0 -- CMD

- No network (new, empty net namespace), no host processes (new pid namespace), no host files
  beyond the read-only binds above: not the repository, not /root, not /etc/shadow.
- ``/sandbox`` (the cwd, HOME) and ``/tmp`` are private tmpfs mounts with a size cap: every run
  starts from an empty work directory and nothing survives it (``files`` are copied in through
  memfds by bwrap's ``--file``). That is the per-run temp dir, kept in memory so that a killed
  sandbox can never leave files behind and a disk-filling program is capped.
- bwrap itself is started with an empty environment, so ``/proc/1/environ`` inside shows nothing
  of the host's either.

Running as root (as here): the kernel ignores ``RLIMIT_NPROC`` for the real root user, and a
``--uid 65534`` inside a bwrap-made user namespace still *is* root outside. So, when root, bwrap
is exec'd already as uid/gid 65534 (it then uses unprivileged user namespaces), which makes
the sandboxed processes really uid 65534 and the process limit real. Because the user namespace is
created first and ``prlimit`` runs inside it, the process count is per sandbox, not shared by all
concurrent sandboxes. The start is a vfork + exec of bwrap itself on a small pool of spawner
threads: its cost does not grow with the host process (a ``preexec_fn`` would fork the whole
host - tens of ms once torch is loaded) and the event loop never waits on it. Each spawner
thread, when it starts, sets itself up once for all the bwraps it will start (its children
inherit the thread's namespaces and credentials, not the process's): it unshares its own mount
namespace (``unshare(CLONE_NEWNS)`` affects only the calling thread), bind-mounts the Python
install - which may sit under a directory 65534 cannot enter (``/root/.pyenv``) - onto a
world-readable staging directory there (visible to that thread's children only, and gone with the
thread), then drops the thread's own credentials to uid/gid 65534 with no supplementary groups
(raw ``setgroups``/``setresgid``/``setresuid`` syscalls, which, unlike the libc wrappers, change
the calling thread only; irreversible: the thread keeps no capability). The host process's
other threads stay root and keep the host's mount table. The spawner thread execs bwrap
itself: no launcher binary (``nsenter``, ``setpriv``) sits in between, since each would add an
exec and a dynamic link to every run (``benchmarks/sandbox.py``). On an architecture without a
known syscall table the thread still unshares and stages, but the uid switch falls back to
exec'ing ``setpriv --reuid/--regid 65534 --clear-groups``.

Killing (wall-clock timeout, session close): bwrap reports the pid of the sandbox's init on its
``--json-status-fd``; we pin it with a pidfd and SIGKILL it, and the kernel then kills everything
left in the pid namespace (daemons, fork bombs, double-forked children). bwrap's
``--die-with-parent`` arms PDEATHSIG=SIGKILL in bwrap itself and in the processes inside (it fires
when the *thread* that started bwrap exits: the spawner threads live until
``BwrapSandbox.close()``), so a host process killed with SIGKILL takes its sandboxes with it. One
gap remains: a host process that dies while one of its sandboxes is being started (the ms before
bwrap arms PDEATHSIG, right after it clones the sandbox's init) can orphan it; the orphan still
has all its rlimits.

Status heuristics (``trident.sandbox.base.classify``, shared by every backend):
- ``error``: bwrap missing/failed before the command started (its ``--json-status-fd`` never
  reported an exit code), or the command does not exist in the sandbox. Nothing the program does
  can produce ``error``: it is decided from facts the program cannot forge.
- ``timeout``: our wall-clock deadline fired (the whole sandbox is killed, see above), or the
  program died of SIGXCPU (CPU-time limit = ``ceil(timeout_s)``).
- ``oom``: non-zero exit and stderr's tail shows an allocation failure (``MemoryError``,
  ``Cannot allocate memory``, ``std::bad_alloc``, ``out of memory``). The limit is RLIMIT_AS
  (address space), so allocations fail rather than the OOM killer firing; a program that dies
  some other way when out of memory (a C segfault) reads as ``killed``.
- ``killed``: died of another signal (exit code 128+N as propagated by bwrap). A program that
  exits 128+N by itself is indistinguishable, and is classified ``killed`` too.
- ``ok``: anything else, whatever the exit code.

Deliberate simplifications: rlimits, not cgroups (RLIMIT_AS is per process, so a sandbox can use
at most ``max_processes x memory_mb`` of address space; RLIMIT_CPU is per process); no seccomp
filter; the sandbox sees the host's /usr read-only (its compilers and shells are available);
site-packages of the Python install are hidden (stdlib only). Runs are not pre-warmed: a run
must start from a fresh filesystem and a fresh process, which is what a cold bwrap + prlimit
start is; a warm shim would add a resident interpreter per slot to save only the namespace set-up
(see ``benchmarks/sandbox.py``). Sessions, whose agent is a Python process, are pre-warmed by
``trident.sandbox.pool``. Needs util-linux's ``prlimit`` (and ``setpriv`` only on the fallback
above) and Linux >= 5.3 (pidfds) with unprivileged user namespaces enabled
(Ubuntu >= 23.10 restricts them through AppArmor: allow bwrap or set
``kernel.apparmor_restrict_unprivileged_userns=0``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

from trident.sandbox.base import (
    SandboxResult,
    SessionKind,
    as_bytes,
    classify,
    run_coroutine_sync,
    validate_run_args,
)
from trident.sandbox.bwrap_process import (
    CRED_SYSCALLS,
    BwrapProcess,
    CappedReader,
    close_fds,
    feed_stdin,
    stage_spawner_thread,
)

WORK_DIR = "/sandbox"

# The session agent's program (a file of this package), run as ``python -I -S -c AGENT_SOURCE``.
AGENT_SOURCE = resources.files("trident.sandbox").joinpath("_agent_main.py").read_text()

# Host /etc entries copied into the sandbox's /etc (beside a generated passwd and group).
_HOST_ETC = ("alternatives", "ld.so.cache", "localtime")


@dataclass(frozen=True)
class BwrapConfig:
    """What every sandbox of one ``BwrapSandbox`` gets; per-call limits are arguments of ``run``."""

    python_prefix: str | None = None
    """The Python install bound read-only into the sandbox; None = ``realpath(sys.base_prefix)``."""
    hide_site_packages: bool = True
    """Cover the install's site-packages with an empty tmpfs: stdlib only, faster start."""
    extra_ro_binds: tuple[str, ...] = ()
    """More host paths to bind read-only at the same path (must not hold secrets)."""
    tmpfs_mb: int = 256
    """Size cap of each of /sandbox, /tmp and /dev/shm (memory-backed), and the max file size."""
    max_processes: int = 64
    """RLIMIT_NPROC inside the sandbox (its own user namespace, so counted per sandbox)."""
    max_open_files: int = 256
    """RLIMIT_NOFILE."""
    max_output_bytes: int = 1 << 20
    """Cap on each of stdout and stderr; the rest is read and discarded, ``truncated`` is set."""
    sandbox_uid: int = 65534
    """uid/gid of the sandboxed processes (nobody); also the host uid they run as when root."""
    setup_timeout_s: float = 20.0
    """How long bwrap may take to build a sandbox (and a session agent to start) before that
    counts as an infra error."""
    kill_grace_s: float = 2.0
    """After the kill, how long to wait for the output pipes to close before giving up on them."""


class BwrapSandbox:
    """Starts bubblewrap sandboxes: one-shot ``run``s and session agents (``start_agent``).

    Thread-safe and loop-agnostic: every call spawns its own processes. Not itself a full
    ``Sandbox`` (no sessions, no concurrency limit): ``SandboxPool`` wraps it into one.
    """

    def __init__(self, config: BwrapConfig | None = None) -> None:
        self.config = config or BwrapConfig()
        self.bwrap_path = shutil.which("bwrap")
        self.prlimit_path = shutil.which("prlimit")
        self.python_prefix = os.path.realpath(self.config.python_prefix or sys.base_prefix)
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        bin_dir = os.path.join(self.python_prefix, "bin")
        self.python = os.path.join(bin_dir, f"python{version}")
        if not os.path.exists(self.python):
            self.python = os.path.join(bin_dir, "python3")
        self.path_dirs = (bin_dir, "/usr/local/bin", "/usr/bin", "/bin")
        self.setpriv_path = shutil.which("setpriv")
        self._as_root = os.geteuid() == 0
        self._cred_syscalls = CRED_SYSCALLS.get(platform.machine())
        self._lock = threading.RLock()
        self._spawn_threads: concurrent.futures.ThreadPoolExecutor | None = None
        self._spawner_error: BaseException | None = None
        self._runtime_dir: str | None = None
        self._base_args: list[str] | None = None
        self._cleanup: weakref.finalize | None = None
        self._unavailable: tuple[str | None] | None = None

    # -- setup -------------------------------------------------------------------------------

    def unavailable(self) -> str | None:
        """Why this host cannot run sandboxes (None when it can). Checked once (it is on every
        run's path, and the tools do not come and go)."""
        if self._unavailable is None:
            self._unavailable = (self._check_tools(),)
        return self._unavailable[0]

    def _check_tools(self) -> str | None:
        if self.bwrap_path is None:
            return "bwrap not found: install the Debian package 'bubblewrap' (scripts/setup does)"
        if self.prlimit_path is None:
            return "prlimit not found: install util-linux"
        if self._as_root and self._cred_syscalls is None and self.setpriv_path is None:
            return "setpriv not found: install util-linux"
        if not os.path.exists(self.python):
            return f"no Python interpreter at {self.python}"
        return None

    def _prepare(self) -> list[str]:
        with self._lock:
            if self._base_args is None:
                self._runtime_dir = self._make_runtime_dir()
                # Removed by close(), or when this object is collected, or at interpreter exit.
                self._cleanup = weakref.finalize(
                    self, shutil.rmtree, self._runtime_dir, ignore_errors=True
                )
                self._base_args = self._bwrap_args(self._runtime_dir)
            return self._base_args

    def _make_runtime_dir(self) -> str:
        # World-readable: bwrap runs as uid 65534 and binds from here.
        root = tempfile.mkdtemp(prefix="trident-sandbox-")
        os.chmod(root, 0o755)
        os.mkdir(os.path.join(root, "python"), 0o755)
        os.mkdir(os.path.join(root, "etc"), 0o755)
        uid = self.config.sandbox_uid
        files = {
            "passwd": f"root:x:0:0:root:/root:/bin/sh\nsandbox:x:{uid}:{uid}:sandbox:{WORK_DIR}:/bin/sh\n",
            "group": f"root:x:0:\nsandbox:x:{uid}:\n",
        }
        for name, text in files.items():
            with open(os.path.join(root, "etc", name), "w") as f:
                f.write(text)
            os.chmod(os.path.join(root, "etc", name), 0o644)
        # The few host /etc entries programs need, copied (symlinks as symlinks) so that the
        # sandbox's /etc is one read-only bind of this directory: every bind costs bwrap a mount,
        # a remount and a parse of the mount table, and five of them were ~10% of a run's CPU.
        for name in _HOST_ETC:
            src, dst = os.path.join("/etc", name), os.path.join(root, "etc", name)
            with contextlib.suppress(OSError):
                if os.path.islink(src):
                    os.symlink(os.readlink(src), dst)
                elif os.path.isdir(src):
                    shutil.copytree(src, dst, symlinks=True)
                elif os.path.isfile(src):
                    shutil.copy2(src, dst)
        for path in self.config.extra_ro_binds:  # mount points for binds under /etc
            if path.startswith("/etc/"):
                dst = os.path.join(root, "etc", os.path.relpath(path, "/etc"))
                if os.path.isdir(path):
                    os.makedirs(dst, 0o755, exist_ok=True)
                else:
                    os.makedirs(os.path.dirname(dst), 0o755, exist_ok=True)
                    open(dst, "a").close()
        return root

    def _bwrap_args(self, runtime_dir: str) -> list[str]:
        cfg = self.config
        uid = str(cfg.sandbox_uid)
        tmpfs_bytes = str(cfg.tmpfs_mb << 20)
        args = ["--unshare-all", "--unshare-user", "--uid", uid, "--gid", uid]
        args += ["--die-with-parent", "--new-session", "--hostname", "sandbox"]
        args += ["--ro-bind", "/usr", "/usr"]
        for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
            if os.path.islink(top):
                args += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                args += ["--ro-bind", top, top]
        python_src = os.path.join(runtime_dir, "python") if self._as_root else self.python_prefix
        args += ["--ro-bind", python_src, self.python_prefix]
        if cfg.hide_site_packages:
            base = {"base": self.python_prefix, "platbase": self.python_prefix}
            sites = {sysconfig.get_path(key, vars=base) for key in ("purelib", "platlib")}
            for site in sorted(sites):
                if os.path.isdir(site) and site.startswith(self.python_prefix + os.sep):
                    args += ["--tmpfs", site]
        args += ["--ro-bind", os.path.join(runtime_dir, "etc"), "/etc"]
        for path in cfg.extra_ro_binds:
            args += ["--ro-bind", path, path]
        args += ["--proc", "/proc", "--dev", "/dev"]
        for mount in ("/tmp", WORK_DIR, "/dev/shm"):
            args += ["--size", tmpfs_bytes, "--perms", "1777", "--tmpfs", mount]
        return args

    def _tail_args(self, env: Mapping[str, str] | None) -> list[str]:
        """Arguments after the mounts: read-only root, cwd and a minimal environment."""
        args = ["--remount-ro", "/", "--remount-ro", "/dev", "--chdir", WORK_DIR, "--clearenv"]
        base_env = {
            "PATH": ":".join(self.path_dirs),
            "HOME": WORK_DIR,
            "TMPDIR": "/tmp",
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        for key, value in {**base_env, **(env or {})}.items():
            args += ["--setenv", key, value]
        return args

    def _launcher(self) -> list[str]:
        """What execs bwrap from the spawner thread's vfork: nothing (bwrap itself), except as root
        on an architecture without a known credential-syscall table, where ``setpriv`` drops to
        the sandbox uid (the thread could not)."""
        if not self._as_root or self._cred_syscalls is not None:
            return []
        uid = str(self.config.sandbox_uid)
        setpriv = [self.setpriv_path or "setpriv", "--pdeathsig=KILL"]
        return [*setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]

    def _init_spawner_thread(self) -> None:
        """Runs once on each new spawner thread, before it starts any bwrap (see the module
        docstring): as root, a private mount namespace for this thread with the Python prefix
        staged in it, then this thread's credentials dropped to the sandbox uid. A failure is
        kept for the error message of the runs that can then not start."""
        if not self._as_root:
            return
        try:
            if self._runtime_dir is None:
                raise RuntimeError("the sandbox backend is closed")
            stage = os.path.join(self._runtime_dir, "python")
            uid, syscalls = self.config.sandbox_uid, self._cred_syscalls
            stage_spawner_thread(self.python_prefix, stage, uid, syscalls)
        except BaseException as exc:
            self._spawner_error = exc
            raise

    def _resolve(self, argv0: str, files: Mapping[str, Any]) -> str | None:
        """Whether ``argv0`` exists in the sandbox (its tree is host paths, so check on the host)."""
        if "/" not in argv0:
            for d in self.path_dirs:
                if os.access(os.path.join(d, argv0), os.X_OK):
                    return None
            return f"command not found in the sandbox: {argv0!r}"
        if not os.path.isabs(argv0) or argv0.startswith(WORK_DIR + "/"):
            rel = os.path.relpath(os.path.join(WORK_DIR, argv0), WORK_DIR)
            return None if rel in files else f"command not found in the sandbox: {argv0!r}"
        return None if os.path.exists(argv0) else f"command not found in the sandbox: {argv0!r}"

    async def _spawn(
        self, argv: list[str], pass_fds: tuple[int, ...], status_r: int, limit: int = 1 << 16
    ) -> BwrapProcess:
        """Start bwrap (``argv``). The ``pass_fds`` are closed here once the child holds them; on
        success the returned ``BwrapProcess`` owns ``status_r``, on failure the caller still does.

        The spawn is a vfork + exec (no ``preexec_fn``: a fork of a host process that has torch
        loaded costs tens of ms) and runs on the backend's spawner threads (set up by
        ``_init_spawner_thread``), so the event loop never waits for it. bwrap's PDEATHSIG
        follows the spawner thread, which lives until ``close()``.
        """
        loop = asyncio.get_running_loop()

        def start() -> subprocess.Popen:
            return subprocess.Popen(
                [*self._launcher(), *argv],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=pass_fds,
                env={},  # bwrap's own environ is readable in /proc/1/environ inside: keep it empty
                start_new_session=True,
            )

        started = loop.run_in_executor(self._spawner(), start)
        try:
            proc = await asyncio.shield(started)
        except concurrent.futures.BrokenExecutor as exc:
            raise OSError(
                f"sandbox spawner thread failed to set up: {self._spawner_error!r}"
            ) from exc
        except asyncio.CancelledError:  # it may still start: wait for it and stop it
            await self._stop_started(started, status_r)
            raise
        finally:
            # Our copies would keep the status pipe open after bwrap exits; close them once the
            # child holds its own (not before: the fork may still be running on its thread).
            if started.done():
                close_fds(pass_fds)
            else:
                started.add_done_callback(lambda _: close_fds(pass_fds))
        return await BwrapProcess.attach(proc, status_r, limit)

    async def _stop_started(self, started: asyncio.Future[subprocess.Popen], status_r: int) -> None:
        """Stop a bwrap whose start completes after its caller was cancelled (so that a closing
        pool, say, leaves nothing behind)."""
        try:
            proc = await started
        except Exception:
            os.close(status_r)
            return
        sandbox = await BwrapProcess.attach(proc, status_r, 1 << 16)
        await sandbox.stop(self.config.setup_timeout_s, self.config.kill_grace_s)
        sandbox.close_pipes()

    def _spawner(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._spawn_threads is None:
                self._spawn_threads = concurrent.futures.ThreadPoolExecutor(
                    max_workers=max(2, min(8, os.cpu_count() or 1)),
                    thread_name_prefix="trident-sandbox-spawn",
                    initializer=self._init_spawner_thread,
                )
            return self._spawn_threads

    # -- one-shot runs -----------------------------------------------------------------------

    def run(
        self,
        cmd: list[str],
        *,
        stdin: str | bytes = b"",
        files: Mapping[str, str | bytes] | None = None,
        timeout_s: float = 10.0,
        memory_mb: int = 1024,
        env: Mapping[str, str] | None = None,
    ) -> SandboxResult:
        """Synchronous ``run_async`` (for the CLI and scripts)."""
        return run_coroutine_sync(
            self.run_async(
                cmd, stdin=stdin, files=files, timeout_s=timeout_s, memory_mb=memory_mb, env=env
            )
        )

    async def run_async(
        self,
        cmd: list[str],
        *,
        stdin: str | bytes = b"",
        files: Mapping[str, str | bytes] | None = None,
        timeout_s: float = 10.0,
        memory_mb: int = 1024,
        env: Mapping[str, str] | None = None,
    ) -> SandboxResult:
        """Run ``cmd`` once in a fresh sandbox; see ``trident.sandbox.Sandbox.run``."""
        blobs = validate_run_args(cmd, files, timeout_s, memory_mb)
        problem = self.unavailable() or self._resolve(cmd[0], blobs)
        if problem:
            return SandboxResult.infra_error(problem)
        base = self._prepare()
        cfg = self.config
        cpu_s = max(1, math.ceil(timeout_s))
        limits = [
            f"--as={memory_mb << 20}",
            f"--cpu={cpu_s}:{cpu_s + 1}",
            f"--nproc={cfg.max_processes}",
            f"--fsize={cfg.tmpfs_mb << 20}",
            f"--nofile={cfg.max_open_files}",
            "--core=0",
        ]
        child_fds: list[int] = []
        status_r = -1
        try:
            status_r, status_w = os.pipe()
            child_fds.append(status_w)
            file_args: list[str] = []
            for rel in sorted(blobs):
                parent = os.path.dirname(rel)
                if parent:
                    file_args += ["--dir", f"{WORK_DIR}/{parent}"]
                fd = os.memfd_create("sandbox-file")
                child_fds.append(fd)
                view = memoryview(blobs[rel])
                while view:
                    view = view[os.write(fd, view) :]
                os.lseek(fd, 0, os.SEEK_SET)
                file_args += ["--perms", "0755", "--file", str(fd), f"{WORK_DIR}/{rel}"]
            argv = [self.bwrap_path, *base, "--json-status-fd", str(status_w), *file_args]
            argv += [*self._tail_args(env), "--", self.prlimit_path, *limits, "--", *cmd]
            start = time.monotonic()
            fds, child_fds = tuple(child_fds), []  # _spawn closes them
            sandbox = await self._spawn(argv, fds, status_r)
        except Exception as exc:  # OSError, or SubprocessError for a failed preexec
            for fd in [*child_fds, status_r]:
                if fd >= 0:
                    os.close(fd)
            return SandboxResult.infra_error(f"sandbox failed to start: {exc}")
        return await self._execute(sandbox, as_bytes(stdin), timeout_s, start)

    async def _execute(
        self, sandbox: BwrapProcess, stdin: bytes, timeout_s: float, start: float
    ) -> SandboxResult:
        """Feed, drain, wait (wall-clock limit), stop and classify one run."""
        cap = self.config.max_output_bytes
        out, err = CappedReader(sandbox.stdout, cap), CappedReader(sandbox.stderr, cap)
        readers = [asyncio.ensure_future(out.drain()), asyncio.ensure_future(err.drain())]
        feeder = asyncio.ensure_future(feed_stdin(sandbox.stdin, stdin))
        finished = False
        try:
            finished = await sandbox.wait(timeout_s)
        finally:
            duration = time.monotonic() - start
            feeder.cancel()
            await asyncio.shield(
                sandbox.stop(self.config.setup_timeout_s, self.config.kill_grace_s)
            )
            _done, pending = await asyncio.wait(readers, timeout=self.config.kill_grace_s)
            for task in pending:
                task.cancel()
            sandbox.close_pipes()
        stdout, stderr = out.text(), err.text()
        truncated = out.truncated or err.truncated
        if not finished:
            return SandboxResult("timeout", None, stdout, stderr, duration, truncated)
        if sandbox.exit_code is None:
            message = stderr.strip() or "bwrap exited before the command started"
            return SandboxResult.infra_error(f"sandbox setup failed: {message}", duration)
        exit_code = sandbox.exit_code
        return SandboxResult(
            classify(exit_code, stderr), exit_code, stdout, stderr, duration, truncated
        )

    # -- session agents ----------------------------------------------------------------------

    async def start_agent(self) -> AgentProcess:
        """Start a session sandbox running the agent (Python REPL + bash); wait until it is ready.

        Raises ``RuntimeError`` when the sandbox cannot start (infra).
        """
        problem = self.unavailable()
        if problem:
            raise RuntimeError(problem)
        base = self._prepare()
        cap = self.config.max_output_bytes
        status_r, status_w = os.pipe()
        argv = [self.bwrap_path, *base, "--json-status-fd", str(status_w)]
        argv += [*self._tail_args(None), "--", self.python, "-I", "-S", "-c", AGENT_SOURCE]
        try:
            # A reply line holds two capped streams, JSON-escaped (up to 6 bytes per input byte).
            sandbox = await self._spawn(argv, (status_w,), status_r, limit=12 * cap + (1 << 16))
        except Exception as exc:
            os.close(status_r)
            raise RuntimeError(f"session sandbox failed to start: {exc}") from exc
        agent = AgentProcess(sandbox, self.config)
        try:
            await agent.wait_ready(self.config.setup_timeout_s)
        except BaseException:  # includes cancellation: never leave a half-started sandbox
            await asyncio.shield(agent.kill())
            raise
        return agent

    def close(self) -> None:
        """Stop the spawner threads (which kills any sandbox still running, via PDEATHSIG) and
        remove the runtime directory (staging mount point, generated /etc files)."""
        with self._lock:
            threads, self._spawn_threads = self._spawn_threads, None
            if self._cleanup is not None:
                self._cleanup()
            self._runtime_dir = None
            self._base_args = None
        if threads is not None:
            threads.shutdown(wait=False)


class AgentProcess:
    """Host side of one session sandbox: JSON lines over the agent's stdin/stdout.

    Protocol (one object per line): the agent says ``{"ready": true}``; the host sends
    ``{"op": "init", ...limits}`` once, then ``{"op": "exec", "kind", "code", "max_output"}``;
    each gets one reply ``{"exit_code", "stdout", "stderr", "truncated"}``. Calls are sequential
    (the caller serialises them). The agent's own stderr is kept (capped) for diagnostics.
    """

    def __init__(self, sandbox: BwrapProcess, config: BwrapConfig) -> None:
        self.sandbox = sandbox
        self.config = config
        self._diag = CappedReader(sandbox.stderr, 1 << 16)
        self._diag_task = asyncio.ensure_future(self._diag.drain())

    @property
    def alive(self) -> bool:
        return self.sandbox.running

    @property
    def pid(self) -> int:
        return self.sandbox.proc.pid

    async def wait_ready(self, timeout_s: float) -> None:
        try:
            line = await asyncio.wait_for(self.sandbox.stdout.readline(), timeout_s)
        except TimeoutError:
            line = b""
        if not line.startswith(b'{"ready"'):
            await self.kill()
            raise RuntimeError(f"session sandbox failed to start: {self._diag.text().strip()}")

    async def init(self, memory_mb: int) -> None:
        """Apply the session's limits inside the sandbox (before any untrusted code runs)."""
        cfg = self.config
        request = {
            "op": "init",
            "as_bytes": memory_mb << 20,
            "nproc": cfg.max_processes,
            "nofile": cfg.max_open_files,
            "fsize": cfg.tmpfs_mb << 20,
        }
        try:
            reply = await self._call(request, cfg.setup_timeout_s)
        except TimeoutError:
            reply = None
        if reply is None or not reply.get("ok"):
            await self.kill()
            raise RuntimeError(f"session sandbox failed to apply limits: {self._diag.text()}")

    async def exec(self, code: str, kind: SessionKind, timeout_s: float) -> SandboxResult:
        """Run one call; a timeout or a dead agent kills the sandbox (the caller closes the session)."""
        start = time.monotonic()
        request = {
            "op": "exec",
            "kind": kind,
            "code": code,
            "max_output": self.config.max_output_bytes,
        }
        try:
            reply = await self._call(request, timeout_s)
        except TimeoutError:
            await self.kill()
            return SandboxResult("timeout", None, "", "", time.monotonic() - start)
        duration = time.monotonic() - start
        if reply is None:  # the agent died: the code killed it (os._exit, a signal, ...)
            await self.kill()
            return SandboxResult("killed", self.sandbox.exit_code, "", "", duration)
        exit_code = int(reply["exit_code"])
        stdout, stderr = reply["stdout"], reply["stderr"]
        return SandboxResult(
            classify(exit_code, stderr), exit_code, stdout, stderr, duration, reply["truncated"]
        )

    async def _call(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any] | None:
        if not self.alive:
            return None
        try:
            self.sandbox.stdin.write(json.dumps(request).encode() + b"\n")
            await self.sandbox.stdin.drain()
        except (ConnectionError, BrokenPipeError):
            return None
        try:
            line = await asyncio.wait_for(self.sandbox.stdout.readline(), timeout_s)
        except ValueError:  # reply longer than the stream limit: cannot happen with capped output
            return None
        if not line:
            return None
        return json.loads(line)

    async def kill(self) -> None:
        """Kill the sandbox (and everything in it). Idempotent."""
        cfg = self.config
        await self.sandbox.stop(cfg.setup_timeout_s, cfg.kill_grace_s)
        await asyncio.wait([self._diag_task], timeout=cfg.kill_grace_s)
        self._diag_task.cancel()
        self.sandbox.close_pipes()
