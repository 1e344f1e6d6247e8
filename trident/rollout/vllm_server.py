"""Launch and supervise one vLLM OpenAI-compatible server process.

The server runs as ``python -m trident.rollout.vllm_api_server`` (vLLM's OpenAI API server) with
``VLLM_SERVER_DEV_MODE=1`` (pause/resume/abort and weight-transfer endpoints) in its own process
group, so that stopping it takes its engine-core children too. The child also gets
``PR_SET_PDEATHSIG`` (SIGTERM) on Linux: if the supervising process is killed outright (SIGKILL,
a Ray actor torn down), the server shuts down with its children instead of lingering.

A server that does not become healthy raises ``ServerStartError`` with the tail of its log.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

from trident.cluster.net import PortInUseError, check_port_free, free_port
from trident.cluster.process import cores_each, die_with_parent, jemalloc_env
from trident.rollout.engine import SERVED_MODEL
from trident.rollout.vllm_patches import FORK, PARENT_PID, SERVER

API_SERVER = "trident.rollout.vllm_api_server"  # the module each server runs (`python -m`)


class ServerStartError(RuntimeError):
    """The vLLM server exited or did not become healthy; the message holds its log tail."""


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


# the ranks vLLM accepts for --max-lora-rank (vllm/config/lora.py)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_server_args(r: int) -> tuple[list[str], dict[str, str]]:
    """The vLLM arguments and environment that let a server load adapters of rank ``r`` while
    it runs (``model.lora.sync=adapter``: ``trident.weights.adapter``)."""
    rank = next((k for k in VLLM_LORA_RANKS if k >= r), None)
    if rank is None:
        raise ValueError(f"model.lora.r={r}: vLLM serves adapters up to rank 512")
    args = ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", "1"]
    return args, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


# Below this hidden size one torch thread generates faster than two: the matrices are too small
# for a second thread to pay (2 cores, the demo's rollout of 256 samples: hidden 128, 0.30 s on one
# thread vs 0.41 s on two; the small preset's 128 x 32 tokens: hidden 512, 3.9 s vs 2.55 s).
ONE_THREAD_BELOW_HIDDEN = 512


def engine_threads(model_path: str, sharing: int) -> int:
    """Torch threads for a CPU server's engine (``rollout.cpu_threads=0``): one for a model
    narrower than ``ONE_THREAD_BELOW_HIDDEN``, else this host's cores split among the
    ``sharing`` processes that generate at once. Left alone, a server started by a Ray actor would
    inherit the actor's ``OMP_NUM_THREADS=1``."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
        hidden = int(config.get("hidden_size", ONE_THREAD_BELOW_HIDDEN))
    except (OSError, ValueError, TypeError):
        hidden = ONE_THREAD_BELOW_HIDDEN
    if hidden < ONE_THREAD_BELOW_HIDDEN:
        return 1
    return cores_each(sharing)


def cpu_options(
    model_path: str, max_model_len: int, cpu_threads: int, cpu_sharing: int
) -> tuple[list[str], dict[str, str]]:
    """The arguments and environment of a server on CPU."""
    # The eager path starts ~60 s sooner than the compiled one; for small models on CPU the
    # scheduler, not the kernels, bounds throughput. The model runs in the engine-core process
    # ("uni"), not in a third worker process: each vLLM process imports torch and vLLM again, so
    # this halves the start (tiny model, 2 cores: 43.6 -> 22.6 s) and saves a process hop per step
    # (16 x 64 tokens, 3 requests: 1.89 -> 1.29 s).
    args = ["--enforce-eager", "--distributed-executor-backend", "uni"]
    # A seeded request (run.deterministic) samples from its own CPU torch.Generator, which vLLM
    # rewinds (Generator.set_offset, CUDA-only) when a step samples some requests while it splits
    # another's prompt: "CPU Generator does not use offset" kills the engine core once a step's
    # prompts exceed its token budget (2048). So prompts are not split on CPU; a step's budget
    # then holds the longest prompt.
    budget = max(2048, max_model_len)
    args += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(budget)]
    env = {
        # vLLM's CPU platform takes "uni" only when told its engine is not multiprocess
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        FORK: "1",  # fork the engine core (vllm_patches.py)
        # The model already runs eagerly (--enforce-eager); what vLLM still torch.compiles is a
        # few helpers, among them the logprob ranks every request computes, which inductor
        # builds into C++ on the server's first request: 1.5-2.3 s of each server's first
        # answer on 2 cores (rollout tokens/s unchanged without it, measured).
        "TORCH_COMPILE_DISABLE": "1",
        "OMP_NUM_THREADS": str(cpu_threads or engine_threads(model_path, cpu_sharing)),
        **jemalloc_env(model_path),  # rollout on the compute recipe: 1.3 -> 1.2 s a step (2 cores)
    }
    return args, env


class VLLMServer:
    """One vLLM server process: ``start()`` -> url, ``healthy()``, ``stop()``."""

    def __init__(
        self,
        model_path: str,
        log_path: str | Path,
        *,
        port: int = 0,
        host: str = "127.0.0.1",
        dtype: str = "float32",
        max_model_len: int = 512,
        kv_cache_gib: float = 1.0,
        gpu_memory_utilization: float = 0.5,
        weight_transfer_backend: str | None = "trident_shm",
        extra_args: Sequence[str] = (),
        extra_env: Mapping[str, str] | None = None,
        seed: int = 0,
        cpu_threads: int = 0,
        cpu_sharing: int = 1,
    ) -> None:
        self.model_path, self.host = model_path, host
        self.port = port or free_port()
        self.log_path = Path(log_path)
        args = [
            sys.executable,
            "-m",
            API_SERVER,
            "--model",
            model_path,
            "--host",
            host,
            "--port",
            str(self.port),
            "--dtype",
            dtype,
            "--max-model-len",
            str(max_model_len),
            "--seed",
            str(seed),
            "--served-model-name",
            SERVED_MODEL,
            # stats stay on: /metrics' token counters tell a frozen engine core from a busy one
            # logprobs of the distribution sampled from (temperature applied): the trainer's μ
            "--logprobs-mode",
            "processed_logprobs",
        ]
        if weight_transfer_backend:
            args += ["--weight-transfer-config", f'{{"backend": "{weight_transfer_backend}"}}']
        cpu_args, cpu_env = [], {}
        if _on_cpu():
            cpu_args, cpu_env = cpu_options(model_path, max_model_len, cpu_threads, cpu_sharing)
        else:
            args += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
        args += cpu_args
        self.args = args + list(extra_args)
        self.env = {
            **os.environ,
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_CPU_KVCACHE_SPACE": str(max(1, round(kv_cache_gib))),
            "VLLM_CONFIGURE_LOGGING": "1",
            "TOKENIZERS_PARALLELISM": "false",
            SERVER: "1",  # trident's plugin: every vLLM process dies with its parent
            PARENT_PID: str(os.getpid()),  # ... this one, for the API server
            # vLLM's process titles (setproctitle) keep /proc/PID/environ intact, so a forked
            # engine core still shows the environment it runs with (tools find a run's
            # processes by it, the tests by their tag)
            "SPT_NOENV": "1",
        }
        self.env.update(cpu_env)
        if weight_transfer_backend == "ipc":  # vLLM's ipc backend ships pickled CUDA IPC handles
            self.env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        self.env.update(extra_env or {})
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 300) -> str:
        """Start the process and block until ``/health`` answers; raise with the log tail if not."""
        check_port_free(self.port, self.host)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            self.args,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
            # SIGTERM, not SIGKILL: the API server's own shutdown then stops its engine core;
            # the engine core and its workers die with their parents too (trident's vLLM
            # plugin, below), so even a SIGKILLed API server leaves none of them behind
            preexec_fn=functools.partial(die_with_parent, parent=os.getpid()),
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        # one client for the polls: each new one builds an SSL context (~45 ms of CPU, taken
        # from the server's start on a small host)
        with httpx.Client(timeout=2.0) as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise ServerStartError(
                        f"vLLM server for {self.model_path} exited with code "
                        f"{self.proc.returncode} (log: {self.log_path}):\n"
                        f"{log_tail(self.log_path)}"
                    )
                if self.healthy(http):
                    return self.url
                time.sleep(0.1)
        self.stop()
        raise ServerStartError(
            f"vLLM server for {self.model_path} not healthy after {timeout_s:.0f} s "
            f"(log: {self.log_path}):\n{log_tail(self.log_path)}"
        )

    def healthy(self, http: httpx.Client) -> bool:
        """The process runs and ``/health`` answers 200 through ``http``."""
        if self.proc is None or self.proc.poll() is not None:
            return False
        try:
            return http.get(f"{self.url}/health").status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the whole process group, SIGKILL whatever is left after ``grace_s``."""
        if self.proc is None:
            return
        pgid = self.proc.pid
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
            # The leader is gone; make sure no engine-core child outlives it.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            break
        self.proc = None
        # An engine core forked after the API server bound its port holds that socket until it
        # has exited, which a SIGKILL does not wait for: a restart on the port at once found it
        # in use (the API server killed, its engine core still dying). Wait for it to close.
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            try:
                return check_port_free(self.port, self.host)
            except PortInUseError:
                time.sleep(0.05)


def _on_cpu() -> bool:
    """Whether the server runs on CPU: no GPU visible to this process. Decided from the device
    files and ``CUDA_VISIBLE_DEVICES`` where they settle it, since importing torch to ask costs
    a Ray actor ~1.2 s before it can launch the server (on a CPU host, its start's critical
    path); torch is asked only where a GPU may be visible."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):  # every GPU hidden
        return True
    dev = Path("/dev")
    if not any(dev.glob("nvidia[0-9]*")) and not (dev / "kfd").exists():  # NVIDIA, ROCm
        return True
    try:
        import torch

        return not torch.cuda.is_available()
    except ImportError:
        return True
