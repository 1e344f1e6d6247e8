"""Weight-sync benchmark: bucketed vs per-tensor push into a real vLLM server, and bandwidth.

Targets (reference/peers-mechanisms.md §2.3): bucketing ≥ 2.5× faster than per-tensor send for a
model with ≥ 500 small tensors; effective bandwidth reported against the host's single-stream
memcpy. A deep, narrow Qwen2 model (``--layers`` × 12 tensors) is written next to the tiny
checkpoint's tokenizer, one server is started, and each bucket size is pushed ``--repeats`` times
(every push verified). Writes JSON (the server log beside it) and prints a table.

    .venv/bin/python benchmarks/weight_sync.py --out benchmarks/results/weight_sync.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from trident.models.factory import init_model
from trident.models.load import load_causal_lm, load_tokenizer
from trident.rollout.vllm_server import VLLMServer
from trident.weights.sync import WeightSync, hf_named_tensors, make_probe, probe_logprobs


def build_checkpoint(out: Path, layers: int, hidden: int) -> Path:
    from transformers import AutoConfig, Qwen2ForCausalLM

    base = init_model(out / "tiny")
    config = AutoConfig.from_pretrained(base)
    config.num_hidden_layers, config.hidden_size = layers, hidden
    config.intermediate_size = 3 * hidden
    config.layer_types = ["full_attention"] * layers
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(out / "deep")
    load_tokenizer(str(base)).save_pretrained(out / "deep")
    return out / "deep"


def memcpy_gbps(nbytes: int, repeats: int = 5) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return nbytes / min(times) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--buckets",
        default="1,1048576,16777216,268435456",
        help="bucket sizes in bytes; 1 sends one tensor per bucket",
    )
    ap.add_argument("--out", default="benchmarks/results/weight_sync.json")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = str(build_checkpoint(Path(tmp), args.layers, args.hidden))
        model = load_causal_lm(checkpoint)
        probe = make_probe(load_tokenizer(checkpoint), 64, seed=0)
        num_tensors = len(model.state_dict())
        model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        server = VLLMServer(checkpoint, Path(args.out).with_suffix(".server.log"))
        url = server.start()
        try:
            rows = []
            version = 0
            for bucket_bytes in (int(b) for b in args.buckets.split(",")):
                sync = WeightSync([url], bucket_bytes=bucket_bytes)
                sync.init()
                runs = []
                for _ in range(args.repeats):
                    with torch.no_grad():
                        for p in model.parameters():
                            p.add_(torch.randn_like(p) * 1e-3)
                    version += 1
                    pushed = sync.push(hf_named_tensors(model, False), version)
                    checked = sync.verify(probe, probe_logprobs(model, probe), version, 1e-4)
                    runs.append({**pushed, **checked})
                median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                rows.append({"bucket_bytes": bucket_bytes, **median})
        finally:
            server.stop()

    memcpy = memcpy_gbps(model_bytes)
    per_tensor = rows[0]["total_s"]
    for row in rows:
        row["gbps"] = row["bytes"] / row["total_s"] / 1e9
        row["gbps_vs_memcpy"] = row["gbps"] / memcpy
        row["speedup_vs_per_tensor"] = per_tensor / row["total_s"]
    result = {
        "model": {
            "layers": args.layers,
            "hidden": args.hidden,
            "tensors": num_tensors,
            "bytes": model_bytes,
        },
        "memcpy_gbps": memcpy,
        "repeats": args.repeats,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")

    print(f"model: {num_tensors} tensors, {model_bytes / 1e6:.1f} MB; memcpy {memcpy:.2f} GB/s")
    print(
        f"{'bucket':>12} {'buckets':>8} {'total s':>8} {'write s':>8} {'update s':>8} "
        f"{'GB/s':>6} {'/memcpy':>8} {'speedup':>8} {'max|Δ|':>8}"
    )
    for r in rows:
        print(
            f"{r['bucket_bytes']:>12} {r['num_buckets']:>8.0f} {r['total_s']:>8.3f} "
            f"{r['write_s']:>8.3f} {r['update_s']:>8.3f} {r['gbps']:>6.2f} "
            f"{r['gbps_vs_memcpy']:>8.1%} {r['speedup_vs_per_tensor']:>7.1f}x "
            f"{r['max_abs_dlogp']:>8.1e}"
        )


if __name__ == "__main__":
    main()
