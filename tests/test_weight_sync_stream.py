"""Streamed, fanned-out and delta weight sync into two real vLLM servers, still verified.

Two servers of the session's tiny checkpoint, shared by the module. Every sync is verified by the
probe on every server it went to; a delta additionally has to reconstruct tensors whose checksum
equals the trainer's before the engine applies it. Fakes appear only for failure injection: a
delta encoded against the wrong bits, a delta file corrupted after its checksum was taken.
"""

from __future__ import annotations

import json
import mmap
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from trident.models.load import load_causal_lm, load_tokenizer
from trident.rollout.vllm_server import VLLMServer
from trident.weights import delta as delta_codec
from trident.weights import shm
from trident.weights.buckets import iter_buckets
from trident.weights.shm import BucketServer, ShmTransport, same_host
from trident.weights.sync import (
    WeightSync,
    WeightSyncError,
    hf_named_tensors,
    make_probe,
    probe_logprobs,
)
from trident.weights.vllm_plugin import BASE_MISMATCH, fetch, map_file, safetensors_views

TOLERANCE = 1e-4  # float32 on both sides
BUCKET_BYTES = 1 << 20  # the tiny model (3.5 MB) travels in 4 buckets


# ---------------------------------------------------------------------------------------------
# Unit tests (no server)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("changed", [1.0, 0.03])  # every element (planes form), a few (sparse)
def test_delta_roundtrip_is_bit_exact(dtype: torch.dtype, changed: float) -> None:
    gen = torch.Generator().manual_seed(0)
    base = (torch.randn(64, 33, generator=gen) * 0.02).to(dtype)
    step = torch.randn(64, 33, generator=gen) * 0.01
    step *= torch.rand(64, 33, generator=gen) < changed
    new = (base.float() + step).to(dtype)
    new[0, :3] = torch.tensor([float("nan"), -0.0, float("inf")]).to(dtype)
    payload = delta_codec.encode(new, base)
    assert torch.equal(delta_codec.decode(payload, base).view(torch.uint8), new.view(torch.uint8))
    raw = base.numel() * base.element_size()
    if changed < 0.1:  # a few changed elements cost a few bytes each, not the tensor
        assert len(payload) < raw / 4
    unchanged = delta_codec.encode(base, base)  # nothing changed: a few bytes, still exact
    assert len(unchanged) < raw / 50
    assert torch.equal(
        delta_codec.decode(unchanged, base).view(torch.uint8), base.view(torch.uint8)
    )
    with pytest.raises(ValueError, match="base tensor"):
        delta_codec.decode(payload, base[:10])


def test_engine_maps_a_bucket_file_without_copying_it(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    tensors = {
        "w": torch.randn(5, 7),
        "h": torch.randn(3, 2).to(torch.bfloat16),
        "i": torch.arange(4),
        "s": torch.tensor(2.5),
        "e": torch.empty(0, 3),
    }
    path = tmp_path / "b.safetensors"
    save_file(tensors, str(path), metadata={"k": "v"})
    mapped = map_file(path)
    path.unlink()  # the trainer deletes a file once every server has read it
    metadata, views = safetensors_views(mapped)
    assert metadata == {"k": "v"} and views.keys() == tensors.keys()
    for name, t in tensors.items():
        assert views[name].dtype == t.dtype and torch.equal(views[name], t), name
    with pytest.raises(ValueError, match="not a safetensors file"):
        safetensors_views(mmap.mmap(-1, 64))


def test_a_server_on_another_host_fetches_the_same_bucket_bytes(tmp_path: Path) -> None:
    import urllib.error

    bucket = tmp_path / "trident-weights-x-v1-b0.safetensors"
    bucket.write_bytes(bytes(range(256)) * 4096)
    (tmp_path / "other.txt").write_text("not a bucket")
    server = BucketServer(tmp_path, "trident-weights-x", "127.0.0.1")
    try:
        assert fetch(server.url_of(str(bucket))) == bucket.read_bytes()
        for name in ("other.txt", "trident-weights-x-missing", "../etc/passwd"):
            with pytest.raises(urllib.error.HTTPError, match="404"):
                fetch(f"{server.base}/{name}")
    finally:
        server.close()
    assert same_host("http://10.0.0.2:8000", "node-a", "node-a", "10.0.0.9")  # same Ray node
    assert not same_host("http://127.0.0.1:8000", "node-b", "node-a", "127.0.0.1")
    assert same_host("http://127.0.0.1:8000", None, "node-a", "10.0.0.9")  # attached: by address
    assert not same_host("http://10.0.0.2:8000", None, "node-a", "10.0.0.9")


def test_weights_checksum_sees_names_values_and_shapes() -> None:
    def digest(*pairs: tuple[str, torch.Tensor]) -> str:
        h = delta_codec.WeightsChecksum()
        h.update_bucket(list(pairs))
        return h.hexdigest()

    a, b = torch.arange(6.0), torch.arange(6.0).flip(0)
    assert digest(("x", a), ("y", b)) == digest(("y", b), ("x", a))  # order within a bucket
    assert digest(("x", a)) != digest(("z", a))
    assert digest(("x", a)) != digest(("x", a.reshape(2, 3)))
    assert digest(("x", a)) != digest(("x", a + 1e-7))


# ---------------------------------------------------------------------------------------------
# Fixtures: two servers, started together


@pytest.fixture(scope="module")
def urls(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    logs = tmp_path_factory.mktemp("vllm-logs")
    servers = [VLLMServer(tiny_model, logs / f"server{i}.log") for i in range(2)]
    try:
        # One after the other: a server dies with the thread that started it (PDEATHSIG).
        yield [s.start() for s in servers]
    finally:
        for s in servers:
            s.stop()


@pytest.fixture(scope="module")
def probe(tiny_model: str) -> list[int]:
    return make_probe(load_tokenizer(tiny_model), 64, seed=0)


class Trainer:
    """The tiny model, trained by small AdamW-like steps (every element moves a little)."""

    def __init__(self, model_dir: str, seed: int) -> None:
        self.model = load_causal_lm(model_dir)
        self.gen = torch.Generator().manual_seed(seed)
        self.step(0.02)  # far from the served checkpoint, so a skipped sync shows in the probe

    def step(self, scale: float = 1e-4) -> None:
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn(p.shape, generator=self.gen).sign() * scale)

    def checksum(self) -> str:
        """What the engines must hold: the checksum of the trainer's weights, bucket by bucket."""
        h = delta_codec.WeightsChecksum()
        for bucket in iter_buckets(hf_named_tensors(self.model, False), BUCKET_BYTES):
            h.update_bucket(bucket)
        return h.hexdigest()


def sync_to(sync: WeightSync, trainer: Trainer, probe: list[int]) -> dict[str, float]:
    version = (sync.version or 0) + 1
    pushed = sync.push(hf_named_tensors(trainer.model, False), version)
    return pushed | sync.verify(probe, probe_logprobs(trainer.model, probe), version, TOLERANCE)


def served_version(url: str) -> str:
    return httpx.get(f"{url}/weight_info", timeout=10).json()["weight_version"]


# ---------------------------------------------------------------------------------------------
# Against two real servers


def test_fan_out_to_two_servers_leaves_both_verified(
    urls: list[str], tiny_model: str, probe: list[int]
) -> None:
    sync = WeightSync(urls, ShmTransport(bucket_bytes=BUCKET_BYTES))
    sync.init()
    trainer = Trainer(tiny_model, seed=1)
    metrics = sync_to(sync, trainer, probe)
    assert metrics["num_buckets"] >= 3 and metrics["delta"] == 0.0
    assert metrics["max_abs_dlogp"] < TOLERANCE  # the maximum over both servers
    assert [served_version(u) for u in urls] == ["1", "1"]
    # Without deltas or rejoins, nothing needs the weights' checksum: the files' checksums
    # alone check a full sync, and the sender does not hash the weights a second time.
    assert sync.transport.held == dict.fromkeys(urls, (1, ""))


def test_after_k_delta_syncs_engines_hold_the_trainers_weights(
    urls: list[str], tiny_model: str, probe: list[int]
) -> None:
    sync = WeightSync(urls, ShmTransport(bucket_bytes=BUCKET_BYTES, delta=True, full_every=4))
    sync.init()
    trainer = Trainer(tiny_model, seed=2)
    kinds, sizes = [], []
    for _ in range(6):
        metrics = sync_to(sync, trainer, probe)  # raises unless every server verified
        kinds.append("delta" if metrics["delta"] else "full")
        sizes.append(metrics["bytes"] / metrics["weights_bytes"])
        # each engine reconstructed exactly this (it refuses otherwise), and the probe agrees
        assert sync.transport.held == dict.fromkeys(urls, (sync.version, trainer.checksum()))
        trainer.step()
    print(f"\nkinds {kinds}, payload/raw {[f'{s:.2f}' for s in sizes]}")
    assert kinds == ["full", "delta", "delta", "delta", "full", "delta"]  # full_every=4
    assert max(s for s, k in zip(sizes, kinds, strict=True) if k == "delta") < 0.8
    assert [served_version(u) for u in urls] == [str(sync.version)] * 2


def test_delta_against_the_wrong_base_is_refused_or_resent_in_full(
    urls: list[str], tiny_model: str, probe: list[int]
) -> None:
    url = urls[0]
    ours = WeightSync([url], ShmTransport(bucket_bytes=BUCKET_BYTES, delta=True))
    ours.init()
    trainer = Trainer(tiny_model, seed=3)
    sync_to(ours, trainer, probe)
    # Behind our back the server gets other weights (another trainer, a restarted server).
    other = WeightSync([url], ShmTransport(bucket_bytes=BUCKET_BYTES, delta=True))
    other.init()  # keeps the server's base; sends version 1 as well
    intruder = Trainer(tiny_model, seed=4)
    sync_to(other, intruder, probe)

    trainer.step()
    assert ours.transport.next_is_delta(
        ours.targets
    )  # the sender still believes the server holds its base
    with pytest.raises(WeightSyncError, match=BASE_MISMATCH) as err:
        ours.push(hf_named_tensors(trainer.model, False), 2)
    message = str(err.value)
    print(f"\nrefused: {message}")
    assert url in message and "delta against base version 1" in message
    assert "on_base_mismatch=full" in message
    # Nothing applied: the intruder's weights and version are still served.
    other.verify(probe, probe_logprobs(intruder.model, probe), 1, TOLERANCE)

    ours.push(hf_named_tensors(trainer.model, False), 3)  # no longer trusted: sent in full
    ours.verify(probe, probe_logprobs(trainer.model, probe), 3, TOLERANCE)

    # With on_base_mismatch=full the same situation costs one resend, and verifies.
    another = WeightSync([url], ShmTransport(bucket_bytes=BUCKET_BYTES, delta=True))
    another.init()
    sync_to(another, intruder, probe)
    ours.transport.on_base_mismatch = "full"
    trainer.step()
    metrics = sync_to(ours, trainer, probe)
    assert metrics["fallback_full"] == 1.0 and metrics["delta"] == 0.0
    assert ours.transport.held[url] == (ours.version, trainer.checksum())


def test_a_repeated_version_goes_only_to_the_servers_that_do_not_hold_it(
    urls: list[str], tiny_model: str, probe: list[int]
) -> None:
    """``WeightGate.update`` repeats a push whose verification failed (a server died between
    them) on the servers still up: pushing the last version again sends it only to a target
    that does not hold it, so a delta is never applied twice, and the next delta still applies
    on both."""
    a, b = urls
    sync = WeightSync(urls, ShmTransport(bucket_bytes=BUCKET_BYTES, delta=True))
    sync.init()
    trainer = Trainer(tiny_model, seed=6)
    sync_to(sync, trainer, probe)
    trainer.step()
    expected = probe_logprobs(trainer.model, probe)
    version = sync.version + 1
    pushed = sync.push(hf_named_tensors(trainer.model, False), version, [a])  # b was down
    assert pushed["delta"] == 1.0 and pushed["servers_sent"] == 1
    for targets, sent in (([a], 0), ([a, b], 1), ([b, a], 0)):
        pushed = sync.push(hf_named_tensors(trainer.model, False), version, targets)
        assert pushed["servers_sent"] == sent
        assert pushed.get("delta", 0.0) == 0.0  # b, which missed the delta, gets it in full
        assert sync.verify(probe, expected, version, TOLERANCE)["max_abs_dlogp"] < TOLERANCE
    assert sync.transport.held == dict.fromkeys(urls, (version, trainer.checksum()))
    trainer.step()
    metrics = sync_to(sync, trainer, probe)  # a delta on both: they hold the same base
    assert metrics["delta"] == 1.0 and metrics["servers_sent"] == 2
    with pytest.raises(ValueError, match="older than the last pushed"):
        sync.push(hf_named_tensors(trainer.model, False), version)


def test_corrupted_delta_is_detected(
    urls: list[str], tiny_model: str, probe: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    sync = WeightSync(urls, ShmTransport(bucket_bytes=BUCKET_BYTES, delta=True))
    sync.init()
    trainer = Trainer(tiny_model, seed=5)
    before = sync_to(sync, trainer, probe)
    version, expected = sync.version, probe_logprobs(trainer.model, probe)
    trainer.step()

    # (a) A delta file altered after its checksum was taken: refused on read.
    real_write = shm.write_delta_bucket

    def write_then_corrupt(bucket, base, path):
        file = real_write(bucket, base, path)
        if file.path.endswith("-b1.safetensors"):
            data = bytearray(Path(file.path).read_bytes())
            data[-5] ^= 0x01
            Path(file.path).write_bytes(bytes(data))
        return file

    monkeypatch.setattr(shm, "write_delta_bucket", write_then_corrupt)
    with pytest.raises(WeightSyncError, match="checksum mismatch for bucket 1"):
        sync.push(hf_named_tensors(trainer.model, False), version + 1)
    monkeypatch.undo()
    sync.verify(probe, expected, version, TOLERANCE)  # weights and version unchanged
    assert before["delta"] == 0.0

    # (b) A well-formed delta of the wrong bits (one flipped mantissa bit in one element, as a
    # stale or bit-rotted sender base would give): the file checksums match, but the tensors
    # the engine reconstructs do not hash to the trainer's checksum, so nothing is applied.
    sync_to(sync, trainer, probe)  # after a failure the next sync is full; this re-arms deltas
    version, expected = sync.version, probe_logprobs(trainer.model, probe)
    trainer.step()
    real_encode = delta_codec.encode

    def encode_one_bit_off(new: torch.Tensor, base: torch.Tensor) -> bytes:
        if new.numel() > 1000:
            new = new.clone()
            new.view(torch.int32).reshape(-1)[7] ^= 1
        return real_encode(new, base)

    monkeypatch.setattr(delta_codec, "encode", encode_one_bit_off)
    assert sync.transport.next_is_delta(sync.targets)
    with pytest.raises(WeightSyncError, match="weights checksum mismatch") as err:
        sync.push(hf_named_tensors(trainer.model, False), version + 1)
    assert all(u in str(err.value) for u in urls)
    monkeypatch.undo()
    sync.verify(probe, expected, version, TOLERANCE)
    sync_to(sync, trainer, probe)  # the next sync (full) goes through


# ---------------------------------------------------------------------------------------------
# Streamed from the shards of 2 FSDP2 ranks


RANKS_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    import torch.multiprocessing as mp
    from trident.cluster.net import free_port

    def main(rank, world, port, model_dir, urls, out):
        import torch.distributed as dist
        from safetensors.torch import load_file
        from trident.models.load import load_causal_lm, load_tokenizer
        from trident.train import fsdp
        from trident.weights import shm
        from trident.weights.shm import ShmTransport
        from trident.weights.sync import (
            WeightSync, drain, hf_named_tensors, make_probe, probe_logprobs,
        )
        from trident.weights.tensors import full_tensor

        torch.set_num_threads(1)
        fsdp.init_distributed(rank, world, "127.0.0.1", port)
        model = fsdp.shard(load_causal_lm(model_dir))
        with torch.no_grad():  # each rank moves its own shard: the gather has to be right
            for p in model.parameters():
                p.to_local().add_(0.01 * (rank + 1))
        probe = make_probe(load_tokenizer(model_dir), 64, seed=0)
        expected = probe_logprobs(model, probe)  # collective
        sent = {}
        if rank == 0:
            real_write = shm.write_bucket

            def write_and_record(bucket, path):
                file = real_write(bucket, path)
                sent.update(load_file(file.path))
                return file

            shm.write_bucket = write_and_record
            sync = WeightSync(urls, ShmTransport(bucket_bytes=1 << 20))
            sync.init()
            metrics = sync.push(hf_named_tensors(model, False), 1)
            metrics |= sync.verify(probe, expected, 1, 1e-4)
        else:
            drain(hf_named_tensors(model, False))
        gathered = fsdp.full_state_dict(model)  # collective: the old way, all on rank 0
        # for a bfloat16 engine: each shard cast before its gather (collective)
        cast = {
            n: full_tensor(t) for n, t in hf_named_tensors(model, False, dtype=torch.bfloat16)
        }
        if rank == 0:
            same = sorted(sent) == sorted(gathered) and all(
                sent[k].dtype == gathered[k].dtype
                and torch.equal(sent[k].view(torch.uint8), gathered[k].view(torch.uint8))
                for k in gathered
            )
            cast_same = sorted(cast) == sorted(gathered) and all(
                cast[k].dtype == torch.bfloat16 and torch.equal(cast[k], gathered[k].bfloat16())
                for k in gathered
            )
            ratio = sum(t.nbytes for t in cast.values()) / sum(t.nbytes for t in sent.values())
            result = {"same": same, "cast_same": cast_same, "cast_bytes_ratio": ratio}
            json.dump({**result, "tensors": len(sent), **metrics}, open(out, "w"))
        dist.barrier()
        dist.destroy_process_group()

    if __name__ == "__main__":
        model_dir, urls, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
        mp.spawn(main, args=(2, free_port(), model_dir, urls, out), nprocs=2)
    """
)


def test_streamed_sync_on_two_fsdp_ranks_equals_the_gathered_one(
    urls: list[str], tiny_model: str, tmp_path: Path
) -> None:
    script, out = tmp_path / "ranks.py", tmp_path / "result.json"
    script.write_text(RANKS_SCRIPT)
    subprocess.run(
        [sys.executable, str(script), tiny_model, json.dumps(urls), str(out)],
        check=True,
        timeout=600,
    )
    result = json.loads(out.read_text())
    print(f"\n2 ranks, streamed: {result}")
    assert result["same"], "the streamed buckets differ from the gathered state dict"
    # float32 weights for a bfloat16 engine: cast shard by shard, half the bytes, same values
    assert result["cast_same"] and result["cast_bytes_ratio"] == 0.5
    assert result["num_buckets"] >= 3 and result["tensors"] == result["num_tensors"]
    assert result["max_abs_dlogp"] < TOLERANCE  # both servers serve the sharded model's weights
