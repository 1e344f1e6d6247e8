"""The ``trident_shm`` vLLM plugin, and what both sides of the CPU weight sync share.

vLLM loads ``register()`` in every one of its processes through the ``vllm.general_plugins``
entry point (pyproject.toml); it registers ``TridentShmEngine`` (``trident.weights.shm_engine``,
which states the protocol) under the name ``trident_shm``, which a server selects with
``--weight-transfer-config '{"backend": "trident_shm"}'``. Beside it: the bucket checksum, the
safetensors dtype names, and the engine's readers of a bucket (mapped from a shared file, or
fetched from the trainer's host) and of the served checkpoint's shapes.

This module imports only the standard library at import time: vLLM imports it in each of its
processes, and the engine module, which needs vLLM and torch, is imported by name only where the
backend is selected.
"""

from __future__ import annotations

import contextlib
import functools
import math
import mmap
import os
import signal
from pathlib import Path
from typing import Any

BACKEND = "trident_shm"
CHECKSUM_ALGORITHM = "xxh3_128"
BASE_MISMATCH = "delta base mismatch"  # in the refusal of a delta for another base


def checksum(data: bytes | bytearray | memoryview | mmap.mmap) -> str:
    """``"xxh3_128:<hex>"`` of ``data`` (any buffer): the checksum of a bucket file's bytes."""
    import xxhash

    return f"{CHECKSUM_ALGORITHM}:{xxhash.xxh3_128_hexdigest(data)}"


DTYPES = {  # safetensors' dtype names -> torch's
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
    "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}  # fmt: skip


def map_file(path: str | Path) -> mmap.mmap:
    """A private mapping of the file at ``path`` (writable views, nothing copied); its pages
    survive the file's deletion for as long as the mapping lives."""
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)


def fetch(url: str, timeout_s: float = 120.0) -> bytearray:
    """The bytes at ``url`` (a bucket the trainer serves to servers on other hosts), read once
    into one buffer."""
    import urllib.request

    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        data = bytearray(int(response.headers["Content-Length"]))
        view, got = memoryview(data), 0
        while got < len(data):
            n = response.readinto(view[got:])
            if not n:
                raise ValueError(f"{url}: {got} of {len(data)} bytes, then the stream ended")
            got += n
    return data


def safetensors_views(mapped: mmap.mmap | bytearray) -> tuple[dict[str, str], dict[str, Any]]:
    """The metadata of a mapped safetensors file, and its tensors as views of the mapping:
    nothing is copied (reading the file and deserializing it, ``read_bytes`` +
    ``safetensors.torch.load``, copies it twice, at ~1.7 GB/s each on a 2-core machine). The
    views keep the mapping alive. Raises ``ValueError`` on bytes that are not safetensors."""
    import json

    import torch

    try:
        size = int.from_bytes(mapped[:8], "little")
        header = json.loads(mapped[8 : 8 + size])
        metadata = header.pop("__metadata__", None) or {}
        tensors: dict[str, Any] = {}
        for name, info in header.items():
            dtype = getattr(torch, DTYPES[info["dtype"]])
            start, end = info["data_offsets"]
            shape = info["shape"]
            count = math.prod(shape)
            if count * dtype.itemsize != end - start:
                raise ValueError(f"tensor {name!r}: {end - start} bytes for shape {shape}")
            tensors[name] = (
                torch.frombuffer(mapped, dtype=dtype, count=count, offset=8 + size + start)
                if count
                else torch.empty(0, dtype=dtype)
            ).reshape(shape)
    except (KeyError, TypeError, ValueError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"not a safetensors file this engine can read ({e})") from e
    return metadata, tensors


def register() -> None:
    """vLLM plugin hook, run in every vLLM process: register ``trident_shm`` (idempotent:
    plugins may load more than once); in a server trident started, make this process (the
    engine core, its workers) and any process forked from it die with its parent, so a killed
    API server leaves none behind, and pause without vLLM's settling sleep
    (``pause_without_settling``); with ``TRIDENT_VLLM_FORK=1`` (CPU servers), fork the engine
    core (``fork_engine_core``) and inspect model classes in this process
    (``inspect_models_in_process``)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if os.environ.get("TRIDENT_VLLM_SERVER") == "1" and os.environ.get(PARENT_PID) != str(
        os.getpid()
    ):  # once per process (plugins may load more than once)
        _die_with_parent()
        os.register_at_fork(after_in_child=_die_with_parent)  # a forked child runs no plugin
        pause_without_settling()
        if os.environ.get("TRIDENT_VLLM_FORK") == "1":
            fork_engine_core()
            inspect_models_in_process()

    with contextlib.suppress(ValueError):  # already registered in this process
        WeightTransferEngineFactory.register_engine(
            BACKEND, "trident.weights.shm_engine", "TridentShmEngine"
        )


PARENT_PID = "TRIDENT_PARENT_PID"  # the pid each of a server's processes expects as its parent
API_SERVER_PID = "TRIDENT_VLLM_API_PID"  # set by the API server for the processes below it
ORPHAN_GRACE_S = 20.0  # an orphaned API server's shutdown (SIGTERM), before it is killed


def _die_with_parent() -> None:
    """This vLLM process dies with the one that started it (``PARENT_PID``, set by the
    supervisor for the API server and by each process for its children, so a parent that died
    before the request is caught too): the API server by SIGTERM, whose shutdown stops its engine
    core, and by SIGKILL if that shutdown has not ended ``ORPHAN_GRACE_S`` later (an API server
    outlived its killed supervisor so, under memory pressure); every process below it by
    SIGKILL, since each one's own children die with it in turn (a SIGTERMed engine core was seen
    to outlive its killed API server)."""
    from trident.cluster.process import die_with_parent

    me = str(os.getpid())
    top = API_SERVER_PID not in os.environ
    parent = int(os.environ.get(PARENT_PID) or 0) or None
    if top:
        die_with_parent(signal.SIGTERM, parent=parent, kill_after_s=ORPHAN_GRACE_S)
        os.environ[API_SERVER_PID] = me
    else:
        die_with_parent(signal.SIGKILL, parent=parent)
    os.environ[PARENT_PID] = me


def fork_engine_core() -> None:
    """Start the API server's engine core by ``fork`` instead of ``spawn``: the child inherits
    the parent's imports instead of importing torch and vLLM again (tiny model, 2 cores: server
    start 22 -> 12 s). vLLM's CPU platform asks for ``spawn`` unconditionally; fork is safe at
    that point on CPU because the API server has run no model yet (no OpenMP pool, no device
    context). Only the engine-core launcher is changed; GPU servers keep vLLM's choice."""
    import multiprocessing

    import vllm.v1.engine.utils as engine_utils

    setattr(engine_utils, "get_mp_context", functools.partial(multiprocessing.get_context, "fork"))  # noqa: B010


def inspect_models_in_process() -> None:
    """Let vLLM read a model class's capabilities in this process instead of a new interpreter.
    vLLM inspects an architecture in a subprocess (to leave CUDA uninitialised in the API
    server) and caches the answer under ``~/.cache/vllm/modelinfos``, keyed by the hash of the
    model's module; the subprocess imports torch and vLLM again, so a machine's first server started ~6 s later than
    the next ones (tiny model, 2 cores: 12.9 s against 6.3-8.9 s). On CPU (``TRIDENT_VLLM_FORK``)
    there is no device to protect, and the engine core forked from this process inherits the
    model's module."""
    import vllm.model_executor.models.registry as registry

    setattr(registry, "_run_in_subprocess", lambda fn: fn())  # noqa: B010


# vLLM's AsyncLLM.pause_generation, statement by statement, as pause_without_settling knows it
_PAUSE_AWAITS = [
    "await self.renderer.clear_mm_cache_async()",
    "await self.engine_core.pause_scheduler_async(mode=mode, clear_cache=clear_cache)",
    "await asyncio.sleep(0.02)",
]


def pause_without_settling() -> bool:
    """Drop the fixed 20 ms ``asyncio.sleep`` that ends vLLM's ``AsyncLLM.pause_generation``
    (behind ``/pause``), which its comment calls "not required for correctness": it lets the
    last outputs of aborted requests out before the call returns. trident aborts its requests
    and waits until every one is back before it pauses (``WeightGate.update``), so nothing is
    left to settle, and the sleep was most of every sync's pause (CPU demo: 24 of a 70 ms
    sync). The method keeps its two calls. A vLLM whose method is not these statements is left
    as it is; returns whether it was patched."""
    import inspect

    from vllm.v1.engine.async_llm import AsyncLLM

    lines = inspect.getsource(AsyncLLM.pause_generation).splitlines()
    if [line.strip() for line in lines if line.strip().startswith("await ")] != _PAUSE_AWAITS:
        return False

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        if clear_cache:
            await self.renderer.clear_mm_cache_async()
        await self.engine_core.pause_scheduler_async(mode=mode, clear_cache=clear_cache)

    pause_generation.__doc__ = AsyncLLM.pause_generation.__doc__
    setattr(AsyncLLM, "pause_generation", pause_generation)  # noqa: B010
    return True


def checkpoint_shapes(model_dir: str, hf_config: Any) -> dict[str, tuple[int, ...]] | None:
    """HF tensor name -> shape of the checkpoint in ``model_dir`` (safetensors headers only).

    ``lm_head.weight`` is added for tied-embedding models: their checkpoints omit it, but an
    update must carry it (vLLM's reload unties the head; see ``sync.hf_named_tensors``).
    None when ``model_dir`` is not a local directory of safetensors files.
    """
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors")) if Path(model_dir).is_dir() else []
    if not files:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                shapes[name] = tuple(f.get_slice(name).get_shape())
    text_config = (
        hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    )
    if getattr(text_config, "tie_word_embeddings", False):
        shapes.setdefault("lm_head.weight", (text_config.vocab_size, text_config.hidden_size))
    return shapes
