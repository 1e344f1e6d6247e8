"""Online weight sync into a real vLLM server: applied syncs verify, every failed one is caught.

One server at a time, shared by the module (``OneServer``): the untied tiny checkpoint for most
tests, then a tied-embedding variant for the last ones. Fakes appear only for failure injection:
a corrupted bucket file, an HTTP server that fails ``/update_weights``.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from trident.config.schema import SyncConfig
from trident.models.factory import init_model
from trident.models.load import load_causal_lm, load_tokenizer
from trident.rollout.engine import Completion, SamplingParams, VLLMClient
from trident.rollout.vllm_patches import inspect_models_in_process, pause_without_settling
from trident.rollout.vllm_server import VLLMServer
from trident.weights import buckets, shm
from trident.weights.backend import make_transport
from trident.weights.buckets import iter_buckets
from trident.weights.shm import ShmTransport
from trident.weights.sync import (
    WeightSync,
    WeightSyncError,
    hf_named_tensors,
    make_probe,
    probe_logprobs,
)
from trident.weights.vllm_plugin import checksum

# float32 on both sides; measured here: ~1e-6 before and after a sync.
TOLERANCE = 1e-4
BUCKET_BYTES = 1 << 20  # the tiny model (3.5 MB) then travels in 4 buckets


# ---------------------------------------------------------------------------------------------
# Unit tests (no server)


def test_iter_buckets_keeps_order_and_bounds_size() -> None:
    tensors = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 100, 1])]
    buckets = list(iter_buckets(tensors, bucket_bytes=25 * 4))
    assert [[n for n, _ in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3"], ["t4"], ["t5"]]
    assert all(b for b in buckets)


def test_hf_named_tensors_sends_the_tied_head() -> None:
    embed = torch.randn(8, 4)
    state = {"model.embed_tokens.weight": embed, "model.norm.weight": torch.ones(4)}
    tied = dict(hf_named_tensors(state, tie_word_embeddings=True))
    assert torch.equal(tied["lm_head.weight"], embed)
    assert "lm_head.weight" not in dict(hf_named_tensors(state, tie_word_embeddings=False))
    with_head = {**state, "lm_head.weight": embed}
    assert [n for n, _ in hf_named_tensors(with_head, True)].count("lm_head.weight") == 1


def test_write_bucket_checksums_the_bytes_written(tmp_path: Path) -> None:
    embed = torch.randn(8, 4)
    file = buckets.write_bucket([("a", embed), ("b", embed)], tmp_path / "b.safetensors")
    data = Path(file.path).read_bytes()
    assert file.checksum == checksum(data) and file.nbytes == len(data)


def test_write_bucket_rewrites_a_file_in_place_as_safetensors(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    path = tmp_path / "b.safetensors"
    first = {"w": torch.randn(5, 3), "h": torch.randn(7).bfloat16(), "s": torch.tensor(2)}
    buckets.write_bucket(list(first.items()), path)
    inode = path.stat().st_ino
    second = {"w": torch.randn(5, 3), "h": torch.randn(7).bfloat16(), "s": torch.tensor(3)}
    file = buckets.write_bucket(list(second.items()), path)
    assert path.stat().st_ino == inode  # the same file (its pages reused), not a new one
    loaded = load_file(path)  # the safetensors library reads it back exactly
    assert loaded.keys() == second.keys()
    assert all(torch.equal(loaded[k], v) and loaded[k].dtype == v.dtype for k, v in second.items())
    smaller = buckets.write_bucket([("w", torch.randn(2))], path)
    assert path.stat().st_size == smaller.nbytes < file.nbytes  # no stale tail
    assert load_file(path)["w"].shape == (2,)


def test_bucket_files_of_a_dead_sender_are_removed(tmp_path: Path) -> None:
    import subprocess
    import sys

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    orphan = tmp_path / f"trident-weights-{dead.stdout.strip()}-abcd1234-b0.safetensors"
    alive = tmp_path / f"trident-weights-{os.getpid()}-abcd1234-b0.safetensors"
    other = tmp_path / "unrelated.safetensors"
    for path in (orphan, alive, other):
        path.write_bytes(b"x")
    shm._remove_orphans(tmp_path)  # what WeightSync.init does first
    assert not orphan.exists() and alive.exists() and other.exists()


def test_inspect_models_in_process_starts_no_interpreter(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """With no cached answer, ``inspect_models_in_process`` (what a CPU server's plugin
    applies) has vLLM inspect the model class in this process, and the answer is still cached."""
    import subprocess

    import vllm.model_executor.models.registry as registry

    run = subprocess.run

    def no_inspection(command: object, *args: Any, **kwargs: Any) -> object:
        assert command != registry._SUBPROCESS_COMMAND, "an inspection subprocess was started"
        return run(command, *args, **kwargs)

    monkeypatch.setattr(registry, "_run_in_subprocess", registry._run_in_subprocess)  # undone
    monkeypatch.setattr(subprocess, "run", no_inspection)
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    inspect_models_in_process()
    info = registry.ModelRegistry.models["Qwen2ForCausalLM"].inspect_model_cls()
    assert info.is_text_generation_model
    cached = json.loads(next((tmp_path / "modelinfos").glob("*Qwen2ForCausalLM.json")).read_text())
    assert cached["modelinfo"]["is_text_generation_model"]


def test_pause_without_settling_asks_what_vllm_asks_without_the_sleep(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The installed vLLM's ``pause_generation`` is the one ``pause_without_settling`` knows;
    patched, it makes the original's calls of the engine client and the renderer, in order,
    and no ``asyncio.sleep`` (a recorder stands in for both; real servers pause in every sync
    test below)."""
    import asyncio
    from types import SimpleNamespace

    from vllm.v1.engine.async_llm import AsyncLLM

    calls: list[tuple] = []

    class Recorder:
        async def pause_scheduler_async(self, mode: str, clear_cache: bool) -> None:
            calls.append(("pause", mode, clear_cache))

        async def clear_mm_cache_async(self) -> None:
            calls.append(("clear",))

    async def sleep(seconds: float, *args: Any) -> None:
        calls.append(("sleep", seconds))

    client = SimpleNamespace(engine_core=Recorder(), renderer=Recorder())

    def pauses() -> list[tuple]:
        calls.clear()
        asyncio.run(AsyncLLM.pause_generation(client, mode="keep", clear_cache=False))
        asyncio.run(AsyncLLM.pause_generation(client))
        return list(calls)

    monkeypatch.setattr(AsyncLLM, "pause_generation", AsyncLLM.pause_generation)  # undone after
    monkeypatch.setattr(asyncio, "sleep", sleep)
    original = pauses()
    assert ("sleep", 0.02) in original
    assert pause_without_settling()
    assert pauses() == [c for c in original if c[0] != "sleep"]


def test_make_probe_is_fixed_and_avoids_special_tokens(checkpoint: str) -> None:
    tok = load_tokenizer(checkpoint)
    probe = make_probe(tok, 64, seed=3)
    assert probe == make_probe(tok, 64, seed=3) != make_probe(tok, 64, seed=4)
    assert not set(probe) & set(tok.all_special_ids)


# ---------------------------------------------------------------------------------------------
# Fixtures


class OneServer:
    """At most one vLLM server alive: serving another checkpoint stops the current one."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.server: VLLMServer | None = None
        self.model_dir: str | None = None

    def serve(self, model_dir: str) -> str:
        if self.server is None or self.model_dir != model_dir:
            self.stop()
            self.server = VLLMServer(model_dir, self.log_dir / f"{Path(model_dir).name}.log")
            self.server.start()
            self.model_dir = model_dir
        return self.server.url

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server, self.model_dir = None, None


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(init_model(tmp_path_factory.mktemp("weights") / "tiny"))


@pytest.fixture(scope="module")
def tied_checkpoint(checkpoint: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    from transformers import AutoConfig, Qwen2ForCausalLM

    config = AutoConfig.from_pretrained(checkpoint)
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("weights") / "tiny-tied"
    Qwen2ForCausalLM(config).save_pretrained(out)
    load_tokenizer(checkpoint).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OneServer]:
    slot = OneServer(tmp_path_factory.mktemp("vllm-logs"))
    yield slot
    slot.stop()


@pytest.fixture(scope="module")
def url(servers: OneServer, checkpoint: str) -> str:
    return servers.serve(checkpoint)


@pytest.fixture(scope="module")
def weight_sync(url: str) -> WeightSync:
    sync = WeightSync([url], ShmTransport(bucket_bytes=BUCKET_BYTES, timeout_s=120))
    sync.init()
    return sync


@pytest.fixture(scope="module")
def probe(checkpoint: str) -> list[int]:
    return make_probe(load_tokenizer(checkpoint), 64, seed=0)


def perturbed(model_dir: str, seed: int, scale: float = 0.02) -> torch.nn.Module:
    """The checkpoint's HF model with Gaussian noise added to every parameter."""
    model = load_causal_lm(model_dir)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return model


def engine_logprobs(url: str, probe: list[int]) -> list[float]:
    async def run() -> list[float]:
        client = VLLMClient(url)
        try:
            return await client.prompt_logprobs(probe)
        finally:
            await client.aclose()

    return asyncio.run(run())


def served_version(url: str) -> str:
    return httpx.get(f"{url}/weight_info", timeout=10).json()["weight_version"]


def max_abs_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def sync_to(
    sync: WeightSync, model: torch.nn.Module, probe: list[int], tied: bool = False
) -> tuple[int, list[float]]:
    """Push ``model`` as the next version and verify it; returns (version, probe logprobs)."""
    version = (sync.version or 0) + 1
    sync.push(hf_named_tensors(model, tied), version)
    expected = probe_logprobs(model, probe)
    sync.verify(probe, expected, version, TOLERANCE)
    return version, expected


# ---------------------------------------------------------------------------------------------
# Against a real server (file order matters only for the first test: it needs a fresh server)


def test_engine_matches_transformers_before_any_sync(
    url: str, checkpoint: str, probe: list[int]
) -> None:
    expected = probe_logprobs(load_causal_lm(checkpoint), probe)
    mismatch = max_abs_diff(engine_logprobs(url, probe), expected)
    print(f"\nbefore any sync: max |Δlogp| engine vs transformers = {mismatch:.3g}")
    assert mismatch < TOLERANCE


def test_sync_of_perturbed_weights_applies_and_bumps_version(
    url: str, weight_sync: WeightSync, checkpoint: str, probe: list[int]
) -> None:
    model = perturbed(checkpoint, seed=1)
    expected = probe_logprobs(model, probe)
    before = engine_logprobs(url, probe)
    assert max_abs_diff(before, expected) > 0.1  # the noise matters, so the check means something

    version = (weight_sync.version or 0) + 1
    pushed = weight_sync.push(hf_named_tensors(model, False), version)
    verified = weight_sync.verify(probe, expected, version, TOLERANCE)
    print(f"\npush: {pushed}\nverify: {verified}")

    assert served_version(url) == str(version)
    assert pushed["num_buckets"] >= 2 and pushed["num_tensors"] == len(model.state_dict())
    assert verified["max_abs_dlogp"] < TOLERANCE
    assert max_abs_diff(engine_logprobs(url, probe), expected) < TOLERANCE


def test_skipped_sync_is_detected(
    url: str, weight_sync: WeightSync, checkpoint: str, probe: list[int]
) -> None:
    sync_to(weight_sync, perturbed(checkpoint, seed=2), probe)
    changed = perturbed(checkpoint, seed=3)  # trained, but never pushed
    expected = probe_logprobs(changed, probe)
    version = weight_sync.version + 1

    with pytest.raises(WeightSyncError, match="version check failed") as err:
        weight_sync.verify(probe, expected, version, TOLERANCE)
    assert url in str(err.value)

    # A version bumped without its weights: caught by the probe.
    httpx.post(f"{url}/update_weight_version", json={"new_version": str(version)}, timeout=10)
    with pytest.raises(WeightSyncError, match="probe check failed") as err:
        weight_sync.verify(probe, expected, version, TOLERANCE)
    assert url in str(err.value) and "max |Δlogp|" in str(err.value)


def test_the_next_syncs_files_do_not_reach_the_served_weights_and_close_removes_them(
    url: str, checkpoint: str, probe: list[int], tmp_path: Path
) -> None:
    """The sender rewrites the same bucket files at every sync: the engine must have copied
    what it applied, not kept reading the files."""
    sync = WeightSync([url], ShmTransport(tmp_path, BUCKET_BYTES))
    sync.init()
    version, expected = sync_to(sync, perturbed(checkpoint, seed=11), probe)
    files = sorted(tmp_path.glob("trident-weights-*.safetensors"))
    assert len(files) >= 3
    for path in files:  # what a later sync would do to them, minus the update itself
        path.write_bytes(b"\x7f" * path.stat().st_size)
    sync.verify(probe, expected, version, TOLERANCE)  # still the weights of `version`
    version, expected = sync_to(sync, perturbed(checkpoint, seed=12), probe)
    assert sorted(tmp_path.glob("trident-weights-*.safetensors")) == files  # reused by name
    sync.close()
    assert not list(tmp_path.glob("trident-weights-*"))


def test_the_kept_copy_is_updated_in_place_and_a_failed_push_voids_it(
    url: str, checkpoint: str, probe: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``keep_served`` (what a restarted server is brought back to) is copied into the same
    tensors at every sync; a push that fails midway leaves it mixed, so ``rejoin`` must refuse
    until the next push succeeds."""
    transport = ShmTransport(bucket_bytes=BUCKET_BYTES, keep_served=True)
    sync = WeightSync([url], transport)
    sync.init()
    try:
        sync_to(sync, perturbed(checkpoint, seed=21), probe)
        assert transport._base is not None
        storage = {n: t.data_ptr() for n, t in transport._base.items()}
        model = perturbed(checkpoint, seed=22)
        version, expected = sync_to(sync, model, probe)
        assert {n: t.data_ptr() for n, t in transport._base.items()} == storage  # in place
        assert all(torch.equal(transport._base[n], t) for n, t in model.state_dict().items())
        sync.rejoin(url, probe, expected, TOLERANCE)  # the kept copy is that version

        def fail_on_bucket_1(bucket, path):
            if path.name.endswith("-b1.safetensors"):
                raise OSError("no space left on device")
            return real_write(bucket, path)

        real_write = shm.write_bucket
        monkeypatch.setattr(shm, "write_bucket", fail_on_bucket_1)
        with pytest.raises(WeightSyncError, match="no space left"):
            sync.push(hf_named_tensors(perturbed(checkpoint, seed=23), False), version + 1)
        monkeypatch.undo()
        with pytest.raises(WeightSyncError, match="holding a whole version: False"):
            sync.rejoin(url, probe, expected, TOLERANCE)
        version, expected = sync_to(sync, model, probe)  # the next push restores it
        sync.rejoin(url, probe, expected, TOLERANCE)
    finally:
        sync.close()


def test_corrupted_bucket_is_refused_and_leaves_weights_unchanged(
    url: str,
    weight_sync: WeightSync,
    checkpoint: str,
    probe: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    version, expected = sync_to(weight_sync, perturbed(checkpoint, seed=4), probe)
    real_write = shm.write_bucket
    written: list[str] = []

    def write_then_corrupt(bucket, path):  # bytes altered after the checksum was taken
        file = real_write(bucket, path)
        written.append(file.path)
        if len(written) == 2:
            data = bytearray(Path(file.path).read_bytes())
            data[-3] ^= 0xFF
            Path(file.path).write_bytes(bytes(data))
        return file

    monkeypatch.setattr(shm, "write_bucket", write_then_corrupt)
    with pytest.raises(WeightSyncError, match="checksum mismatch for bucket 1") as err:
        weight_sync.push(hf_named_tensors(perturbed(checkpoint, seed=5), False), version + 1)
    assert url in str(err.value) and "update_weights" in str(err.value)
    assert not any(Path(p).exists() for p in written)  # the trainer cleaned its files

    # Bucket 0 had been accepted; nothing was applied: same weights, same version, resumed.
    weight_sync.verify(probe, expected, version, TOLERANCE)
    monkeypatch.undo()
    sync_to(weight_sync, perturbed(checkpoint, seed=6), probe)  # the next sync goes through


def test_wrong_tensor_is_refused_or_caught_by_the_probe(
    url: str, weight_sync: WeightSync, checkpoint: str, probe: list[int]
) -> None:
    model = perturbed(checkpoint, seed=7)
    version, expected = sync_to(weight_sync, model, probe)
    state = model.state_dict()

    wrong_shape = {**state, "model.norm.weight": torch.ones(7)}
    with pytest.raises(WeightSyncError, match="'model.norm.weight' has shape"):
        weight_sync.push(wrong_shape.items(), version + 1)
    unknown = {**state, "model.layers.9.mlp.up_proj.weight": state["lm_head.weight"]}
    with pytest.raises(WeightSyncError, match="not in the served checkpoint"):
        weight_sync.push(unknown.items(), version + 1)
    weight_sync.verify(probe, expected, version, TOLERANCE)  # both refused before loading

    # Right names and shapes, wrong values (two layers swapped): only the probe can tell.
    a, b = "model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight"
    swapped = {**state, a: state[b], b: state[a]}
    weight_sync.push(swapped.items(), version + 1)
    with pytest.raises(WeightSyncError, match="probe check failed"):
        weight_sync.verify(probe, expected, version + 1, TOLERANCE)
    sync_to(weight_sync, model, probe)


class FailingRoute(BaseHTTPRequestHandler):
    """A fake server that accepts every control call but fails the one at ``failing``."""

    failing = "/update_weights"

    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path == self.failing:
            self._reply(500, {"error": "injected failure"})
        else:
            self._reply(200, {})

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("route", ["/start_weight_update", "/update_weights"])
def test_failure_on_one_server_aborts_the_update_on_all(
    route: str, url: str, weight_sync: WeightSync, checkpoint: str, probe: list[int]
) -> None:
    """A server that fails a step, even the first, leaves no update session open on the
    others: the next push to them goes through (it used to find the one the failed push had
    started still open when a server died between pause and start)."""
    version, expected = sync_to(weight_sync, perturbed(checkpoint, seed=8), probe)
    handler = type("Failing", (FailingRoute,), {"failing": route})
    fake = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=fake.serve_forever, daemon=True).start()
    fake_url = f"http://127.0.0.1:{fake.server_address[1]}"
    try:
        both = WeightSync([url, fake_url], ShmTransport(bucket_bytes=BUCKET_BYTES, timeout_s=60))
        both.init()
        with pytest.raises(WeightSyncError, match=route) as err:
            both.push(hf_named_tensors(perturbed(checkpoint, seed=9), False), version + 1)
        assert fake_url in str(err.value) and "injected failure" in str(err.value)
    finally:
        fake.shutdown()
    # The real server was aborted (having staged bucket 0, or nothing) and resumed: old weights,
    # old version.
    weight_sync.verify(probe, expected, version, TOLERANCE)
    sync_to(weight_sync, perturbed(checkpoint, seed=10), probe)


def test_unreachable_server_is_named() -> None:
    dead = WeightSync(["http://127.0.0.1:9"], ShmTransport(timeout_s=5), timeout_s=5)
    with pytest.raises(
        WeightSyncError, match="http://127.0.0.1:9: /init_weight_transfer_engine failed"
    ):
        dead.init()


def test_seeded_prompts_beyond_one_engine_steps_budget_are_sampled(
    url: str, checkpoint: str
) -> None:
    """``run.deterministic`` seeds every request. vLLM cannot rewind a seeded request's CPU
    generator when an engine step samples some requests while it splits another's prompt (its
    engine core died: "CPU Generator does not use offset"), so trident's CPU servers never split
    a prompt. 32 different 200-token prompts at once (6400 tokens, over one step's 2048): all
    sampled, and the server still answers."""
    tokenizer = load_tokenizer(checkpoint)
    prompts = [make_probe(tokenizer, 200, seed=i) for i in range(32)]

    async def run() -> list[list[Completion]]:
        client = VLLMClient(url)
        try:
            return await asyncio.gather(
                *(
                    client.generate(p, SamplingParams(max_tokens=4, seed=i))
                    for i, p in enumerate(prompts)
                )
            )
        finally:
            await client.aclose()

    completions = [c for group in asyncio.run(run()) for c in group]
    assert len(completions) == 32
    assert all(c.finish_reason in ("stop", "length") and c.token_ids for c in completions)
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200


# ---------------------------------------------------------------------------------------------
# Tied embeddings (a second checkpoint: the module's server switches to it)


@pytest.fixture(scope="module")
def tied_sync(servers: OneServer, tied_checkpoint: str) -> tuple[str, WeightSync]:
    tied_url = servers.serve(tied_checkpoint)
    sync = WeightSync([tied_url], ShmTransport(bucket_bytes=BUCKET_BYTES, timeout_s=120))
    sync.init()
    return tied_url, sync


def test_tied_embeddings_sync_needs_the_head_and_verify_catches_it(
    tied_sync: tuple[str, WeightSync], tied_checkpoint: str, probe: list[int]
) -> None:
    tied_url, sync = tied_sync
    model = perturbed(tied_checkpoint, seed=11)
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    expected = probe_logprobs(model, probe)

    # The pitfall: only the embedding is sent, the engine's head stays on the old weights.
    without_head = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    sync.push(hf_named_tensors(without_head, tie_word_embeddings=False), 1)
    with pytest.raises(WeightSyncError, match="probe check failed") as err:
        sync.verify(probe, expected, 1, TOLERANCE)
    print(f"\ntied model, head not sent: {err.value}")

    # hf_named_tensors adds the head for a tied model, even from a state dict without it.
    sync.push(hf_named_tensors(without_head, tie_word_embeddings=True), 2)
    verified = sync.verify(probe, expected, 2, TOLERANCE)
    print(f"tied model, head sent: {verified}")
    assert served_version(tied_url) == "2"


# ---------------------------------------------------------------------------------------------
# GPU backends (vLLM's native nccl / ipc engines); skipped without a GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("backend", ["nccl", "ipc"])
def test_gpu_backend_sync_verifies(backend: str, checkpoint: str, tmp_path: Path) -> None:
    server = VLLMServer(
        checkpoint,
        tmp_path / "gpu.log",
        weight_transfer_backend=backend,
        gpu_memory_utilization=0.3,
    )
    if backend == "ipc":
        server.env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    gpu_url = server.start()
    try:
        probe = make_probe(load_tokenizer(checkpoint), 64, seed=0)
        model = perturbed(checkpoint, seed=12).cuda()
        sync = WeightSync([gpu_url], make_transport(backend, SyncConfig()))
        sync.init()
        sync.push(hf_named_tensors(model, False), 1)
        sync.verify(probe, probe_logprobs(model, probe), 1, tolerance=1e-3)
        sync.close()
    finally:
        server.stop()
