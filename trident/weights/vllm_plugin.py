"""The ``trident_shm`` vLLM plugin, and what both sides of the CPU weight sync share.

vLLM loads ``register()`` in every one of its processes through the ``vllm.general_plugins``
entry point (pyproject.toml); it registers ``TridentShmEngine`` (``trident.weights.shm_engine``,
which states the protocol) under the name ``trident_shm``, which a server selects with
``--weight-transfer-config '{"backend": "trident_shm"}'``. Beside it: the bucket checksum, the
safetensors dtype names, and the engine's readers of a bucket (mapped from a shared file, or
fetched from the trainer's host) and of the served checkpoint's shapes. The hook also applies
trident's patches to its servers' processes (``trident.rollout.vllm_patches``).

This module imports only the standard library at import time: vLLM imports it in each of its
processes, and the engine module, which needs vLLM and torch, is imported by name only where the
backend is selected.
"""

from __future__ import annotations

import contextlib
import math
import mmap
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
    plugins may load more than once), and in a server trident started, its process patches
    (``trident.rollout.vllm_patches.apply``)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from trident.rollout import vllm_patches

    vllm_patches.apply()
    with contextlib.suppress(ValueError):  # already registered in this process
        WeightTransferEngineFactory.register_engine(
            BACKEND, "trident.weights.shm_engine", "TridentShmEngine"
        )


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
