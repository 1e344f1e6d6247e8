"""LoRA: the adapters alone to vLLM against trident's merged full sync, bytes and seconds, verified.

trident syncs a LoRA policy (``model.lora``) by merging the adapters into the base weights and
pushing the full model, verified by the probe like every sync. vLLM can also serve adapters
itself (``--enable-lora``; ``/v1/load_lora_adapter`` while it runs, with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``): a sync would then send only the adapters. This measures
both into one real vLLM server and checks whether the adapter path computes what the trainer
computes: the engine's probe logprobs with the adapter (requests name it as their model) against
the trainer's logprobs of the same probe through its peft model.

The model is ``--like`` (default Qwen2.5-0.5B's architecture, float32, random weights), with
LoRA r=16 on every projection; the adapters' B matrices are made non-zero (as after training),
so the adapter changes what the model computes. The adapter is loaded into the server while it
serves the base weights; then the merged weights are pushed in full (``WeightSync``, shm) and
verified, as a LoRA run does at every step.

    .venv/bin/python benchmarks/lora_sync.py     # ~3 min on 2 cores

Writes ``benchmarks/results/lora_sync.{json,md}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from provenance import REPO, provenance

from trident.config.schema import LoraConfig
from trident.models.load import load_causal_lm, load_tokenizer
from trident.rollout.engine import VLLMClient
from trident.rollout.vllm_server import VLLMServer
from trident.train import lora
from trident.weights.shm import ShmTransport
from trident.weights.sync import WeightSync, hf_named_tensors, make_probe, probe_logprobs


def adapter_logprobs(url: str, name: str, probe: list[int]) -> list[float]:
    async def ask() -> list[float]:
        client = VLLMClient(url, model=name)
        try:
            return await client.prompt_logprobs(probe)
        finally:
            await client.aclose()

    return asyncio.run(ask())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--like", default="qwen2.5-0.5b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lora_sync-"))
    model_dir = work / "model"
    init = [sys.executable, "-m", "trident.cli", "model", "init", str(model_dir)]
    init += ["--like", args.like, "--dtype", "float32"]
    init += ["--layers", str(args.layers)] if args.layers else []
    subprocess.run(init, check=True, cwd=REPO)

    torch.manual_seed(0)
    model = lora.wrap(load_causal_lm(str(model_dir)), LoraConfig(r=args.rank))
    with torch.no_grad():  # as after training: B = 0 would leave the base model unchanged
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    model.eval()
    adapter_dir = work / "adapter"
    model.save_pretrained(str(adapter_dir))
    adapter_bytes = sum(f.stat().st_size for f in adapter_dir.iterdir())
    probe = make_probe(load_tokenizer(str(model_dir)), 32, seed=0)
    expected = probe_logprobs(model, probe)  # the trainer's, through the peft model

    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    extra = ["--enable-lora", "--max-lora-rank", str(args.rank), "--max-loras", "1"]
    server = VLLMServer(str(model_dir), work / "server.log", extra_args=extra)
    result: dict = {"provenance": provenance(), "model": args.like, "rank": args.rank}
    try:
        url = server.start()
        # 1. the adapter alone (the server serves the base weights)
        t0 = time.perf_counter()
        r = httpx.post(
            f"{url}/v1/load_lora_adapter",
            json={"lora_name": "v1", "lora_path": str(adapter_dir)},
            timeout=600,
        )
        load_s = time.perf_counter() - t0
        if r.status_code != 200:
            result["adapter"] = {"error": f"HTTP {r.status_code}: {r.text[:300]}"}
        else:
            t0 = time.perf_counter()  # the first request with it (vLLM may load it lazily)
            got = adapter_logprobs(url, "v1", probe)
            probe_s = time.perf_counter() - t0
            dlogp = max(abs(a - b) for a, b in zip(got, expected, strict=True))
            result["adapter"] = {
                "bytes": adapter_bytes,
                "seconds": load_s,
                "verify_s": probe_s,
                "max_abs_dlogp": dlogp,
            }
        # 2. the merged weights in full, as a LoRA run syncs today
        sync = WeightSync([url], ShmTransport())
        sync.init()
        weights = hf_named_tensors(lora.MergedWeights(model), True)
        t0 = time.perf_counter()
        pushed = sync.push(weights, 1)
        full_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        verified = sync.verify(probe, expected, 1, 2e-3)
        result["merged"] = {
            "bytes": pushed["bytes"],
            "seconds": full_s,
            "verify_s": time.perf_counter() - t0,
            "max_abs_dlogp": verified["max_abs_dlogp"],
        }
        sync.close()
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)  # the model and the adapter: ~2 GB
    a, m = result.get("adapter", {}), result["merged"]
    lines = [
        f"# LoRA sync: the adapters alone against the merged weights ({args.like}, r={args.rank})",
        "",
        f"Commit `{result['provenance']['commit']}`, {result['provenance']['date']}, "
        f"{result['provenance']['host']['cpu']}. `benchmarks/lora_sync.py`: one vLLM server "
        "(CPU, float32); |Δlogp|: the engine's probe logprobs against the trainer's.",
        "",
        "| sync | MB | install s | verify s (first request after it) | max abs dlogp |",
        "|---|---:|---:|---:|---:|",
    ]
    if "error" in a:
        lines.append(f"| adapter (`/v1/load_lora_adapter`) | failed: {a['error']} | | | |")
    else:
        lines.append(
            f"| adapter (`/v1/load_lora_adapter`) | {a['bytes'] / 1e6:.1f} | {a['seconds']:.2f} "
            f"| {a['verify_s']:.2f} | {a['max_abs_dlogp']:.1e} |"
        )
    lines.append(
        f"| merged, in full (trident's sync) | {m['bytes'] / 1e6:.1f} | {m['seconds']:.2f} "
        f"| {m['verify_s']:.2f} | {m['max_abs_dlogp']:.1e} |"
    )
    if "bytes" in a:
        lines += ["", f"The adapter is {a['bytes'] / m['bytes']:.1%} of the merged sync's bytes."]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "lora_sync.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out_dir / "lora_sync.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
