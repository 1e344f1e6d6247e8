"""Weight-sync benchmark: memory-copy bound, gathered vs streamed vs fanned-out sync, delta sizes.

In one run, on this machine (targets from reference/peers-mechanisms.md §2.3 and issue #17):

1. **Bound**: ``numpy.copyto`` of the model's bytes (best of 5).
2. **Full sync into real vLLM servers** (fp32, every push verified by the probe), per model:
   ``gathered`` (the old path: ``fsdp.full_state_dict`` on rank 0, then push), ``streamed``
   (each bucket gathered from the FSDP2 shards just before it is sent, double-buffered) and,
   on the ~150 M model, ``streamed`` fanned out to 1, 2 and 4 servers at once; every sender
   keeps a copy of what it served (``keep_served``, as runs do for restarted servers). Peak sender
   memory is the process's resident set sampled every 2 ms during the push, above what it held
   before. Target: sync bandwidth (model bytes / push seconds) >= 50% of the copy.
3. **Delta payloads**: AdamW (lr 1e-5 and 1e-6, betas 0.9/0.999, no weight decay) on an fp32
   master copy, with synthetic N(0, 1) gradients (Adam's step is ~lr per element whatever the
   gradient's scale, so the fraction of changed bits is what a real step gives); after 1, 10
   and 100 steps the delta against step 0 is encoded for the fp32 weights and for their bf16
   cast. Target: bf16 payload after one step <= 1/30 of a full sync. The encodings compared
   on the ~150 M model after one step: the sync's (sparse gaps + XOR values when under half
   changed, else XOR byte planes; zstd), XOR + byte planes + zstd always, XOR + zstd,
   index/value + zstd.
4. **Delta sync into a real server**: a full sync and then a delta sync one step later
   (fp32, lr 1e-5), both verified.

Models: the ``small`` preset (25 M parameters) and a ~150 M-parameter Qwen2 built here.
Servers run on the same 2 CPU cores as the trainer. Writes JSON + a markdown table.

    .venv/bin/python benchmarks/weight_sync.py            # ~12 min here
    .venv/bin/python benchmarks/weight_sync.py --quick    # small model only, ~3 min
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trident.cluster.net import free_port
from trident.models.factory import init_model
from trident.models.load import load_causal_lm, load_tokenizer
from trident.rollout.vllm_server import VLLMServer
from trident.train import fsdp
from trident.weights import delta as delta_codec
from trident.weights.shm import ShmTransport
from trident.weights.sync import WeightSync, hf_named_tensors, make_probe, probe_logprobs

MB = 1 << 20
TOLERANCE = 1e-4


def build_150m(out: Path) -> Path:
    """A Qwen2 of ~150 M parameters on the ``small`` preset's tokenizer."""
    from transformers import AutoConfig, Qwen2ForCausalLM

    small = init_model(out / "small-for-tokenizer", "small")
    config = AutoConfig.from_pretrained(small)
    config.hidden_size, config.intermediate_size = 768, 3072
    config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads = 17, 12, 4
    config.layer_types = ["full_attention"] * config.num_hidden_layers
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(out / "m150")
    load_tokenizer(str(small)).save_pretrained(out / "m150")
    return out / "m150"


def memcpy_gbps(nbytes: int, repeats: int = 5) -> float:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


class PeakRSS:
    """Peak resident set of this process while the ``with`` block runs, above its start."""

    def __enter__(self) -> PeakRSS:
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.start = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _rss(self) -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * self.page

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self._rss())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def extra_mb(self) -> float:
        return (self.peak - self.start) / MB


def perturb(model: torch.nn.Module, scale: float = 1e-3) -> None:
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p  # an FSDP2 shard
            local.add_(scale)


def server_breakdown(log: Path) -> dict[str, float]:
    """The engine's own split of the last update: read+checksum+deserialize, then load."""
    hits = re.findall(r"read\+check ([\d.]+) s, load ([\d.]+) s", log.read_text(errors="replace"))
    return (
        {"engine_read_s": float(hits[-1][0]), "engine_load_s": float(hits[-1][1])} if hits else {}
    )


def full_syncs(
    name: str, checkpoint: str, servers: list[VLLMServer], fan_out: list[int], bucket: int
) -> list[dict[str, Any]]:
    """Gathered vs streamed to one server, then streamed to each fan-out size; all verified."""
    model = fsdp.shard(load_causal_lm(checkpoint))
    probe = make_probe(load_tokenizer(checkpoint), 32, seed=0)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    rows = []
    version = 0
    plans = [("gathered", 1), ("streamed", 1)] + [("streamed", n) for n in fan_out if n > 1]
    syncs = {  # keep_served: what `trident train` runs with (rollout.max_restarts > 0)
        n: WeightSync(
            [s.url for s in servers[:n]], ShmTransport(bucket_bytes=bucket, keep_served=True)
        )
        for n in fan_out
    }
    for s in syncs.values():
        s.init()
    for mode, n in plans:
        sync = syncs[n]
        for _ in range(2):  # the first push of a fresh server warms it up; keep the second
            perturb(model)
            version = max(version, sync.version or 0) + 1
            expected = probe_logprobs(model, probe)
            with PeakRSS() as mem:
                t0 = time.perf_counter()
                if mode == "gathered":
                    state = fsdp.full_state_dict(model)
                    gather_s = time.perf_counter() - t0
                    pushed = sync.push(hf_named_tensors(state, False), version)
                    del state
                else:
                    gather_s = 0.0
                    pushed = sync.push(hf_named_tensors(model, False), version)
                total = time.perf_counter() - t0
            verified = sync.verify(probe, expected, version, TOLERANCE)
        row = {
            "model": name,
            "mode": mode,
            "servers": n,
            "bucket_mb": bucket / MB,
            "model_mb": model_bytes / MB,
            "seconds": total,
            "full_state_dict_s": gather_s,
            "gbps": model_bytes / total / 1e9,
            "peak_extra_mb": mem.extra_mb,
            **{k: pushed[k] for k in ("num_buckets", "gather_s", "write_s", "keep_s", "update_s")},
            **{k: pushed[k] for k in ("pause_s", "finish_s", "resume_s")},
            "max_abs_dlogp": verified["max_abs_dlogp"],
            **server_breakdown(servers[0].log_path),
        }
        print(f"  {name} {mode} x{n}: {total:.2f} s, {row['gbps']:.2f} GB/s, "
              f"+{mem.extra_mb:.0f} MB peak, max|Δ| {verified['max_abs_dlogp']:.1e}")  # fmt: skip
        rows.append(row)
    return rows


def delta_sync(name: str, checkpoint: str, server: VLLMServer, bucket: int) -> dict[str, Any]:
    """A full sync, one AdamW step (lr 1e-5), then a delta sync: both verified."""
    model = load_causal_lm(checkpoint)
    probe = make_probe(load_tokenizer(checkpoint), 32, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
    sync = WeightSync([server.url], ShmTransport(bucket_bytes=bucket, delta=True))
    sync.init()
    out: dict[str, Any] = {"model": name}
    for kind in ("full", "delta"):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
        version = (sync.version or 0) + 1
        pushed = sync.push(hf_named_tensors(model, False), version)
        verified = sync.verify(probe, probe_logprobs(model, probe), version, TOLERANCE)
        assert pushed["delta"] == (kind == "delta")
        out[kind] = {
            "seconds": pushed["total_s"],
            "bytes": pushed["bytes"],
            "write_s": pushed["write_s"],
            "update_s": pushed["update_s"],
            "max_abs_dlogp": verified["max_abs_dlogp"],
            **server_breakdown(server.log_path),
        }
    print(f"  {name} delta sync: {out['delta']['seconds']:.2f} s for "
          f"{out['delta']['bytes'] / MB:.1f} MB vs full {out['full']['seconds']:.2f} s")  # fmt: skip
    return out


def delta_sizes(
    name: str, checkpoint: str, lrs: list[float], checkpoints_at: list[int], encodings: bool
) -> list[dict[str, Any]]:
    """Delta payload / full bytes after k AdamW steps, fp32 and bf16, plus encode/decode time."""
    rows = []
    for lr in lrs:
        model = load_causal_lm(checkpoint)
        params = [p for p in model.parameters()]
        base32 = [p.detach().clone() for p in params]
        base16 = [b.bfloat16() for b in base32]
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
        gen = torch.Generator().manual_seed(0)
        for step in range(1, max(checkpoints_at) + 1):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
            if step not in checkpoints_at:
                continue
            for dtype, base in (("fp32", base32), ("bf16", base16)):
                new = [
                    p.detach().to(torch.bfloat16 if dtype == "bf16" else torch.float32)
                    for p in params
                ]
                full = sum(t.numel() * t.element_size() for t in new)
                changed = sum(int((n != b).sum()) for n, b in zip(new, base, strict=True))
                t0 = time.perf_counter()
                payloads = [delta_codec.encode(n, b) for n, b in zip(new, base, strict=True)]
                encode_s = time.perf_counter() - t0
                t0 = time.perf_counter()
                for payload, b in zip(payloads, base, strict=True):
                    delta_codec.decode(payload, b)
                decode_s = time.perf_counter() - t0
                size = sum(len(p) for p in payloads)
                row = {
                    "model": name, "dtype": dtype, "lr": lr, "steps": step,
                    "full_mb": full / MB, "delta_mb": size / MB, "ratio": size / full,
                    "changed_fraction": changed / sum(t.numel() for t in new),
                    "encode_s": encode_s, "decode_s": decode_s,
                }  # fmt: skip
                if encodings and step == 1:
                    row |= other_encodings(new, base, full)
                print(f"  {name} {dtype} lr {lr:g} after {step}: 1/{1 / row['ratio']:.1f} "
                      f"({row['changed_fraction']:.1%} changed), encode {encode_s:.2f} s")  # fmt: skip
                rows.append(row)
        del model, opt, base32, base16
    return rows


def other_encodings(
    new: list[torch.Tensor], base: list[torch.Tensor], full: int
) -> dict[str, float]:
    import zstandard

    zstd = zstandard.ZstdCompressor(level=1)
    plain = planes = index_value = 0
    for n, b in zip(new, base, strict=True):
        width = n.element_size()
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[width]
        xor = torch.bitwise_xor(n.reshape(-1).view(bits), b.reshape(-1).view(bits))
        plain += len(zstd.compress(xor.numpy().tobytes()))
        by_plane = xor.view(torch.uint8).reshape(-1, width).T.contiguous()
        planes += len(zstd.compress(by_plane.numpy().tobytes()))
        idx = torch.nonzero(xor).reshape(-1).to(torch.int32)
        values = n.reshape(-1)[idx.long()].view(bits)
        index_value += len(zstd.compress(idx.numpy().tobytes() + values.numpy().tobytes()))
    return {
        "ratio_xor_planes_zstd": planes / full,
        "ratio_xor_zstd": plain / full,
        "ratio_index_value_zstd": index_value / full,
    }


def write_markdown(result: dict[str, Any], path: Path) -> None:
    lines = [
        "# Weight sync (benchmarks/weight_sync.py)",
        "",
        f"memcpy bound (numpy copyto): **{result['memcpy_gbps']:.2f} GB/s**. "
        "Every sync below was verified by the probe on every server.",
        "",
        "| model | mode | servers | bucket MB | seconds | GB/s | % of copy | peak extra MB "
        "| write s | keep s | update s | engine read s | engine load s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["full_sync"]:
        lines.append(
            f"| {r['model']} ({r['model_mb']:.0f} MB) | {r['mode']} | {r['servers']} "
            f"| {r['bucket_mb']:.0f} | {r['seconds']:.2f} | {r['gbps']:.2f} "
            f"| {r['gbps'] / result['memcpy_gbps']:.0%} | {r['peak_extra_mb']:.0f} "
            f"| {r['write_s']:.2f} | {r['keep_s']:.2f} | {r['update_s']:.2f} "
            f"| {r.get('engine_read_s', 0):.2f} "
            f"| {r.get('engine_load_s', 0):.2f} |"
        )
    lines += ["", "| model | sync | seconds | MB sent | max abs dlogp |", "|---|---|---|---|---|"]
    for d in result["delta_sync"]:
        for kind in ("full", "delta"):
            k = d[kind]
            lines.append(
                f"| {d['model']} | {kind} | {k['seconds']:.2f} | {k['bytes'] / MB:.1f} "
                f"| {k['max_abs_dlogp']:.1e} |"
            )
    lines += [
        "",
        "| model | dtype | lr | steps | changed | delta MB / full MB | full / delta | encode s "
        "| decode s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["delta_sizes"]:
        lines.append(
            f"| {r['model']} | {r['dtype']} | {r['lr']:g} | {r['steps']} "
            f"| {r['changed_fraction']:.1%} | {r['delta_mb']:.1f} / {r['full_mb']:.0f} "
            f"| {1 / r['ratio']:.1f}x | {r['encode_s']:.2f} | {r['decode_s']:.2f} |"
        )
    enc = [r for r in result["delta_sizes"] if "ratio_xor_zstd" in r]
    if enc:
        lines += [
            "",
            "Encodings after one step (payload / full; the sync's: sparse gaps + XOR values when"
            " under half the elements changed, else XOR byte planes; zstd-1 for all):",
            "",
            "| model | dtype | lr | the sync's | XOR+planes+zstd | XOR+zstd | index/value+zstd |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in enc:
            lines.append(
                f"| {r['model']} | {r['dtype']} | {r['lr']:g} | {r['ratio']:.3f} "
                f"| {r['ratio_xor_planes_zstd']:.3f} | {r['ratio_xor_zstd']:.3f} "
                f"| {r['ratio_index_value_zstd']:.3f} |"
            )
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small model, 2 servers, 1/10 steps")
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results/weight_sync.json")
    args = ap.parse_args()
    torch.set_num_threads(2)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    bucket = args.bucket_mb * MB
    fsdp.init_distributed(0, 1, "127.0.0.1", free_port())
    result: dict[str, Any] = {"quick": args.quick, "bucket_mb": args.bucket_mb}
    result |= {"full_sync": [], "delta_sync": [], "delta_sizes": []}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        models = {"small": str(init_model(Path(tmp) / "small", "small"))}
        if not args.quick:
            models["150M"] = str(build_150m(Path(tmp)))
        biggest = max(
            sum(t.numel() * t.element_size() for t in load_causal_lm(m).state_dict().values())
            for m in models.values()
        )
        result["memcpy_gbps"] = memcpy_gbps(biggest)
        print(f"memcpy: {result['memcpy_gbps']:.2f} GB/s over {biggest / MB:.0f} MB")
        for name, checkpoint in models.items():
            fan_out = [1, 2, 4] if name == "150M" else ([1, 2] if args.quick else [1])
            servers = [
                VLLMServer(checkpoint, Path(tmp) / f"{name}.server{i}.log")
                for i in range(max(fan_out))
            ]
            try:
                for s in servers:  # one at a time: a server dies with the thread that started it
                    s.start()
                result["full_sync"] += full_syncs(name, checkpoint, servers, fan_out, bucket)
                result["delta_sync"].append(delta_sync(name, checkpoint, servers[0], bucket))
            finally:
                for s in servers:
                    s.stop()
            steps = [1, 10] if args.quick else [1, 10, 100]
            lrs = [1e-5] if args.quick else [1e-5, 1e-6]
            result["delta_sizes"] += delta_sizes(
                name, checkpoint, lrs, steps, name != "small" or args.quick
            )
    result["seconds"] = time.perf_counter() - t_start
    out.write_text(json.dumps(result, indent=2) + "\n")
    write_markdown(result, out.with_suffix(".md"))
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
